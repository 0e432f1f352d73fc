"""Source mixtures: OLMo-core's `SourceMixtureDatasetConfig` (olmo_core/data/source_mixture.py)
and the instances its `NumpyFSLDatasetMixture` reads, for the `data.sources` config.

Each source has `paths` (globs allowed, OLMo-core's `*` / `**` rules, matches sorted), a
`target_ratio` (the ratios sum to 1), `max_repetition_ratio` (>= 1; above 1 the source is
upsampled: repeated up to that many times) and `max_source_fraction` (in (0, 1]: the share of
the source that may be used). `select_mixture` follows OLMo-core's `build()` step by step:

1. population = the source's tokens (file bytes // itemsize); needed =
   int(requested_tokens * target_ratio); the cap int(population * max_source_fraction *
   max_repetition_ratio) must reach it, else OLMo-core's "Insufficient tokens" error.
2. take = needed / population, cut into chunks of at most 1 (one per repetition); each chunk
   asks ceil(file_tokens * chunk) tokens of every file of the source, in order.
3. Those asks are rounded to whole instances so the mixture fills exactly
   ceil(requested_tokens / global_batch_tokens) global batches: floor to instances (at most
   the file's instances), spread the shortfall evenly over the files with room, then the
   rest by largest remainder (Hamilton's method), ties to the later file.

An entry (file, tokens) then stands for the first tokens // seq_len instances of the file
(OLMo-core's dataset reads an entry as the file cut to that many tokens), and an upsampled
file is listed once per repetition. Entries of zero tokens are dropped, as OLMo-core's
`NumpyFSLDatasetConfig.build` does. OLMo-core also writes a seeded sample of each file's
document spans to its work dir, but its 3.0.0 dataset does not read them: the instances
depend on the sizes alone, and so do ours.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmo_jax import storage
from olmo_jax.errors import DataError

MIXTURE_FILE = "mixture.json"  # the run folder's record of the selection (Mixture.outcome)
SOURCE_FIELDS = ("paths", "target_ratio", "max_repetition_ratio", "max_source_fraction")


@dataclass(frozen=True)
class Source:
    """One source of a mixture (OLMo-core's `SourceMixtureConfig`)."""

    name: str
    paths: tuple[str, ...]
    target_ratio: float
    max_repetition_ratio: float = 1.0
    max_source_fraction: float = 1.0


def parse_sources(spec: Mapping, where: str = "data.sources") -> list[Source]:
    """`data.sources` ({name: {paths, target_ratio, max_repetition_ratio,
    max_source_fraction}}) as Sources, in the mapping's order, checked as OLMo-core's
    `SourceMixtureConfig.validate` and `SourceMixtureList.validate` check them; each error
    names the field."""
    if not isinstance(spec, Mapping):
        raise DataError(f"{where}={spec!r} must map source names to "
                        "{'paths': [...], 'target_ratio': r, ...}")
    sources = []
    for name, fields in spec.items():
        at = f"{where}.{name}"
        if not isinstance(fields, Mapping):
            raise DataError(f"{at}={fields!r} must be a mapping with {', '.join(SOURCE_FIELDS)}")
        unknown = sorted(set(fields) - set(SOURCE_FIELDS))
        if unknown:
            raise DataError(f"{at} has no field(s) {', '.join(unknown)}: a source has "
                            f"{', '.join(SOURCE_FIELDS)}")
        if "target_ratio" not in fields:
            raise DataError(f"{at}.target_ratio is missing: the source's share of the "
                            "requested tokens, in (0, 1]")
        paths = fields.get("paths", ())
        paths = [p.strip() for p in paths.split(",")] if isinstance(paths, str) else list(paths)
        paths = tuple(str(p) for p in paths if str(p))
        source = Source(str(name), paths, float(fields["target_ratio"]),
                        float(fields.get("max_repetition_ratio", 1.0)),
                        float(fields.get("max_source_fraction", 1.0)))
        _check_source(source, at)
        sources.append(source)
    if not sources:
        raise DataError(f"{where} is empty; give at least one source")
    total = float(np.sum([s.target_ratio for s in sources]))
    if not np.allclose(total, 1.0):
        listed = ", ".join(f"{s.name}={s.target_ratio}" for s in sources)
        raise DataError(f"{where}.*.target_ratio must sum to 1.0, got {total} ({listed})")
    return sources


def _check_source(s: Source, at: str) -> None:
    if s.target_ratio and not 0 < s.target_ratio <= 1:
        raise DataError(f"{at}.target_ratio={s.target_ratio} must be > 0 and <= 1")
    if not 0 < s.max_source_fraction <= 1:
        raise DataError(f"{at}.max_source_fraction={s.max_source_fraction} must be > 0 and <= 1")
    if s.max_repetition_ratio < 1:
        raise DataError(f"{at}.max_repetition_ratio={s.max_repetition_ratio} must be >= 1 "
                        "(1 = no repetition; above 1 upsamples the source)")
    if not s.paths:
        raise DataError(f"{at}.paths must not be empty; list the source's token files "
                        "(globs allowed)")


def glob_paths(pattern: str) -> list[str]:
    """OLMo-core's `deterministic_glob_directory` on a local path: every file and folder
    under the pattern's fixed prefix whose path matches it (`*` within a path part, `**/`
    any run of parts), sorted."""
    if storage.is_remote(pattern):  # s3:// / gs://: the store's listing, same rules
        return storage.glob(str(pattern).rstrip("/"))
    pattern = str(pattern).rstrip("/").replace("file://", "")
    base = []
    for part in pattern.split("/"):
        if "*" in part:
            break
        base.append(part)
    root = "/".join(base) if base else "."
    regex = re.compile("^" + re.escape(pattern).replace(r"\*\*/", ".*").replace(r"\*\*", ".*")
                       .replace(r"\*", "[^/]*") + "$")
    recurse = "**" in pattern

    def listing(folder: Path):
        for p in folder.iterdir():
            if p.is_file() or p.is_dir():
                yield str(p)
            if recurse and p.is_dir():
                yield from listing(p)

    if not Path(root).is_dir():
        return []
    return sorted(p for p in listing(Path(root)) if regex.match(p))


def resolve_paths(source: Source, where: str = "data.sources") -> list[str]:
    """The source's files: globs expanded (sorted), every path checked to exist."""
    resolved = []
    for i, path in enumerate(source.paths):
        path = os.path.expanduser(path)
        try:
            matches = ([m for m in glob_paths(path) if storage.is_file(m)] if "*" in path
                       else None)
            found = matches is not None or storage.is_file(path)
        except (OSError, ValueError) as e:
            raise DataError(f"{where}.{source.name}.paths[{i}]: "
                            + storage.storage_error(path, e, "token file")) from None
        if matches is not None:
            if not matches:
                raise DataError(f"{where}.{source.name}.paths[{i}]: the glob {path!r} matches "
                                "no files; fix the pattern or the folder")
            resolved.extend(matches)
        elif not found:
            raise DataError(f"{where}.{source.name}.paths[{i}]: token file {path} does not exist")
        else:
            resolved.append(path)
    return resolved


@dataclass
class PathTokens:
    """OLMo-core's `SourcePathTokens`: `tokens` of `path` (at most its `max_tokens`)."""

    path: str
    tokens: int
    max_tokens: int


@dataclass(frozen=True)
class SourceOutcome:
    """One source's selection: OLMo-core's `SourceMixtureOutcome` with the numbers of its
    outcome table (`SourceTokenDetails`)."""

    source: Source
    population: int  # tokens in the source's files
    num_selected: int  # int(requested_tokens * target_ratio), before rounding to instances
    path_tokens: tuple[PathTokens, ...]  # one per file and repetition, after rounding

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.path_tokens)


@dataclass(frozen=True)
class Mixture:
    """The selection `select_mixture` makes: per source its files' token counts."""

    sources: tuple[SourceOutcome, ...]
    requested_tokens: int
    global_batch_tokens: int
    seq_len: int

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.sources)

    def entries(self) -> list[tuple[str, int]]:
        """(path, tokens) for each file and repetition with tokens > 0, in OLMo-core's order:
        its dataset's paths and `path_offset_index`."""
        return [(p.path, p.tokens) for s in self.sources for p in s.path_tokens if p.tokens > 0]

    def fingerprint(self) -> str:
        """A hash of the selection (files, token counts, seq_len), recorded in checkpoints."""
        text = json.dumps([self.seq_len, self.entries()])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def outcome(self) -> dict:
        """OLMo-core's outcome tables (by source, global) and the per-file selection, as the
        run folder's mixture.json holds them."""
        population = sum(s.population for s in self.sources)
        selected = sum(s.num_selected for s in self.sources)
        total = self.total_tokens
        return {
            "requested_tokens": self.requested_tokens,
            "global_batch_tokens": self.global_batch_tokens,
            "seq_len": self.seq_len,
            "total_tokens": total,
            "fingerprint": self.fingerprint(),
            "global": {"total_tokens": population, "selected_tokens": selected,
                       "observed_global_ratio": selected / population},
            "sources": [{
                "source_name": s.source.name,
                "source_population": s.population,
                "num_selected": s.num_selected,
                "target_ratio": s.source.target_ratio,
                "max_repetition_ratio": s.source.max_repetition_ratio,
                "max_source_fraction": s.source.max_source_fraction,
                "observed_source_ratio": s.num_selected / s.population,
                "observed_global_ratio": s.num_selected / self.requested_tokens,
                "final_tokens": s.tokens,
                "final_ratio": s.tokens / total,
                "paths": [{"path": p.path, "tokens": p.tokens, "max_tokens": p.max_tokens}
                          for p in s.path_tokens],
            } for s in self.sources],
        }

    def describe(self) -> str:
        """The banner's lines: per source what OLMo-core's outcome table shows, and the
        ratio the rounded selection holds."""
        lines = [f"data mixture: {self.total_tokens:,} tokens selected for "
                 f"{self.requested_tokens:,} requested "
                 f"({100 * (self.total_tokens / self.requested_tokens - 1):+.2f}%), "
                 f"fingerprint {self.fingerprint()}"]
        for s in self.sources:
            lines.append(
                f"  {s.source.name}: target {s.source.target_ratio:.4g}, "
                f"population {s.population:,}, selected {s.num_selected:,} "
                f"(source ratio {s.num_selected / s.population:.4}, global ratio "
                f"{s.num_selected / self.requested_tokens:.4}); after rounding to instances "
                f"{s.tokens:,} tokens = {s.tokens / self.total_tokens:.4f} of the mixture")
        return "\n".join(lines)


def select_mixture(
    sources: Sequence[Source],
    requested_tokens: int,
    global_batch_tokens: int,
    seq_len: int,
    itemsize: int,
    resolve: Callable[[Source], list[str]] = resolve_paths,
    file_bytes: Callable[[str], int] = storage.size,
) -> Mixture:
    """OLMo-core's `SourceMixtureDatasetConfig(source_list, requested_tokens,
    global_batch_size=global_batch_tokens).build(npdtype, sequence_length=seq_len)`, as a
    Mixture (module docstring)."""
    if requested_tokens <= 0:
        raise DataError(f"data.requested_tokens={requested_tokens} must be > 0")
    if global_batch_tokens % seq_len:
        raise DataError(f"the global batch ({global_batch_tokens} tokens) must be a multiple "
                        f"of seq_len {seq_len}")
    files = {s.name: resolve(s) for s in sources}
    counts = {path: file_bytes(path) // itemsize for paths in files.values() for path in paths}

    details = []
    for s in sources:
        population = sum(counts[p] for p in files[s.name])
        needed = int(requested_tokens * s.target_ratio)
        cap = int((population * s.max_source_fraction) * s.max_repetition_ratio)
        if cap < needed:
            raise DataError(
                f"Insufficient tokens for source: {s.name} @ target global ratio: "
                f"{s.target_ratio} :: {cap} < {needed} (data.sources.{s.name}: its files hold "
                f"{population} tokens, max_source_fraction {s.max_source_fraction} x "
                f"max_repetition_ratio {s.max_repetition_ratio} allow {cap}); add files, raise "
                "max_repetition_ratio, or lower its target_ratio or data.requested_tokens")
        if population == 0:
            raise DataError(f"data.sources.{s.name}: its files hold no tokens")
        details.append((s, population, needed))

    per_source: list[list[PathTokens]] = []
    for s, population, needed in details:
        take = needed / population
        chunks = [take]
        if take > 1:
            chunks, remaining = [], take
            while remaining > 0:
                chunk = min(1.0, remaining)
                chunks.append(chunk)
                remaining -= chunk
        per_source.append([PathTokens(p, int(math.ceil(counts[p] * chunk)), counts[p])
                           for chunk in chunks for p in files[s.name]])

    everything = [p for tokens in per_source for p in tokens]
    steps = math.ceil(requested_tokens / global_batch_tokens)
    requested_instances = steps * (global_batch_tokens // seq_len)
    capacity = [p.max_tokens // seq_len for p in everything]
    instances = [min(p.tokens // seq_len, cap) for p, cap in zip(everything, capacity, strict=True)]
    remainders = [(p.tokens % seq_len) / seq_len if n < cap else 0.0
                  for p, n, cap in zip(everything, instances, capacity, strict=True)]
    short = requested_instances - sum(instances)
    if short > 0:
        eligible = [i for i in range(len(instances)) if instances[i] < capacity[i]]
        if eligible:
            base, _ = divmod(short, len(eligible))
            if base:
                for i in eligible:
                    instances[i] += min(base, capacity[i] - instances[i])
            short = requested_instances - sum(instances)
            if short > 0:
                ranked = sorted(((remainders[i], i) for i in eligible
                                 if instances[i] < capacity[i]), reverse=True)
                for _, i in ranked[:short]:
                    instances[i] += 1
    for p, n in zip(everything, instances, strict=True):
        p.tokens = n * seq_len

    outcomes = tuple(SourceOutcome(s, population, needed, tuple(tokens))
                     for (s, population, needed), tokens in zip(details, per_source, strict=True))
    return Mixture(outcomes, requested_tokens, global_batch_tokens, seq_len)


class FilePrefix:
    """The first `n_tokens` of a token file, read like one (`len`, `[a:b]`, `path`): one
    mixture entry, which TokenWindows cuts into instances as it cuts a whole file."""

    def __init__(self, file, n_tokens: int):
        self.file = file
        self.path = file.path
        self.n_tokens = min(n_tokens, len(file))

    def __len__(self) -> int:
        return self.n_tokens

    def __getitem__(self, span: slice) -> np.ndarray:
        start, stop, step = span.indices(self.n_tokens)
        if step != 1:
            raise ValueError(f"FilePrefix reads contiguous slices; got step {step}")
        return self.file[start:stop]

    def prefetch(self, spans: list[tuple[int, int]]) -> None:
        """The underlying file's read-ahead (RemoteTokenFile), if it has one."""
        if hasattr(self.file, "prefetch"):
            self.file.prefetch([(a, min(b, self.n_tokens)) for a, b in spans])

    def __repr__(self) -> str:
        return f"FilePrefix({str(self.path)!r}, {self.n_tokens} tokens)"
