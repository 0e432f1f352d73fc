"""`build_data`: the train loader, the default eval split and the named eval sets from the
`data` config section (token files or the embedded corpus, the tokenizer, the checks that
name the field to fix)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from olmo_jax import storage
from olmo_jax.data.batch_schedule import BatchSizeSchedule
from olmo_jax.data.corpus import CORPUS_DTYPE, stdlib_corpus
from olmo_jax.data.loader import SPLIT_SEED, BatchLoader, TokenWindows, split_windows
from olmo_jax.data.mix_file import check_exist, read_mix
from olmo_jax.data.mixture import FilePrefix, Mixture, parse_sources, select_mixture
from olmo_jax.data.repetition import RepetitionFilter
from olmo_jax.data.token_file import (
    TOKEN_DTYPES,
    TokenFile,
    dtype_for_vocab,
    open_token_file,
    token_dtype,
)
from olmo_jax.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from olmo_jax.errors import DataError


@dataclass(frozen=True)
class Data:
    """What `build_data` returns. `eval` (the default split) is None when
    data.eval_fraction is 0; `eval_sets` are the named sets of data.eval_sets."""

    train: BatchLoader
    eval: BatchLoader | None
    tokenizer: Tokenizer
    vocab_size: int
    windows: TokenWindows
    eval_sets: dict[str, BatchLoader] = field(default_factory=dict)
    mixture: Mixture | None = None  # data.sources' selection (mixture.py), if set

    def describe_eval(self) -> str:
        """What evaluation reads, for the startup banner."""
        parts = []
        if self.eval is not None:
            n, total = self.eval.n_windows, len(self.windows)
            parts.append(
                f"eval_loss on the default split: {n} of the {total} training-file windows "
                f"({100 * n / total:.1f}%, data.eval_fraction; a fixed draw, seed {SPLIT_SEED}), "
                "held out of training")
        else:
            parts.append("no default split (data.eval_fraction=0)")
        for name, loader in self.eval_sets.items():
            files = ", ".join(str(f.path) for f in loader.windows.files)
            parts.append(f"eval/{name}/loss on {loader.n_windows} windows of {files}")
        return "; ".join(parts)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "olmo_jax"


def _field(cfg: Any, name: str, default: Any) -> Any:
    """`cfg[name]` for mappings, `cfg.name` otherwise (DataConfig)."""
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def build_data(
    data_cfg: Any,
    seq_len: int,
    global_batch_size: int,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    run_tokens: int = 0,
    batch_schedule: BatchSizeSchedule | None = None,
) -> Data:
    """Train and eval loaders from the `data` config section: a DataConfig (data/config.py)
    or a dict with `paths` (token files, a list or one comma-separated string; empty: the embedded
    stdlib corpus, cached in `cache_dir`),
    `tokenizer` ('' | 'bytes' | path to tokenizer.json), `vocab_size` (0: the tokenizer's
    padded vocabulary), `eval_fraction` (default 0: no default split; > 0 holds that share
    of the windows, at least one global batch, out of training), `dtype` ('' from the
    vocabulary, 'uint8', 'uint16', 'uint32'), `instances` ('olmo_core' | 'plus_one':
    loader.py) and `repetition_filter` (with `repetition_max_period`, `_min_period`,
    `_max_count`: OLMo-core's instance filter, repetition.py), `mix` / `mix_root` /
    `mix_tokenizer` (an OLMo-core mix file: mix_file.py) and `sources` / `requested_tokens`
    (a source mixture, mixture.py; requested_tokens 0 = `run_tokens`, the run's tokens:
    trainer.max_steps or max_tokens). `batch_schedule` (trainer.batch_size_schedule, whose
    reference is `global_batch_size`) sets the training batches' sizes by step."""
    paths = _paths(_field(data_cfg, "paths", ()))
    sources = dict(_field(data_cfg, "sources", {}) or {})
    mix = str(_field(data_cfg, "mix", ""))
    if mix:
        lines = read_mix(mix, str(_field(data_cfg, "mix_root", "")),
                         str(_field(data_cfg, "mix_tokenizer", "")))
        check_exist(lines, mix)
        if sources:
            sources = _sources_from_mix(sources, lines, mix)
        else:
            paths = [m.path for m in lines]
    tokenizer_spec = str(_field(data_cfg, "tokenizer", ""))
    tokenizer = load_tokenizer(tokenizer_spec)
    vocab_size = int(_field(data_cfg, "vocab_size", 0)) or tokenizer.padded_vocab_size
    eval_fraction = float(_field(data_cfg, "eval_fraction", 0.0))
    dtype_name = str(_field(data_cfg, "dtype", ""))
    layout = _layout(data_cfg)
    if vocab_size < tokenizer.vocab_size:
        raise DataError(
            f"data.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set it to 0 (the padded tokenizer vocabulary, "
            f"{tokenizer.padded_vocab_size}) or at least {tokenizer.vocab_size}"
        )
    # Token files in an object store are read by byte ranges through one bounded cache, in
    # blocks of one instance (a window is one block; plus_one windows touch two).
    names = {d.name for d in TOKEN_DTYPES}
    token_bytes = (np.dtype(dtype_name) if dtype_name in names else dtype_for_vocab(vocab_size)).itemsize
    cache = storage.RangeCache(int(_field(data_cfg, "remote_cache_mb", 256)) << 20,
                               block_bytes=seq_len * token_bytes)

    mixture = None
    if sources:
        dtype = token_dtype(dtype_name) if dtype_name else dtype_for_vocab(vocab_size)
        requested = int(_field(data_cfg, "requested_tokens", 0)) or run_tokens
        if requested <= 0:
            raise DataError("data.sources needs a token budget: set data.requested_tokens")
        mixture = select_mixture(parse_sources(sources), requested, global_batch_size * seq_len,
                                 seq_len, dtype.itemsize)
        files = _mixture_files(mixture, dtype, vocab_size, layout["instances"], cache)
    elif not paths:
        if not isinstance(tokenizer, ByteTokenizer):
            raise DataError(
                "data.paths is empty, so the byte-tokenized embedded corpus is used, but "
                f"data.tokenizer={tokenizer_spec!r}; set data.tokenizer='' or list token "
                "files made with that tokenizer in data.paths"
            )
        if dtype_name and token_dtype(dtype_name) != CORPUS_DTYPE:
            raise DataError(
                f"data.dtype={dtype_name!r}, but the embedded corpus (data.paths empty) is "
                "uint16; set data.dtype=''"
            )
        corpus_path = stdlib_corpus(cache_dir if cache_dir is not None else default_cache_dir())
        files = [TokenFile(corpus_path, CORPUS_DTYPE, vocab_size)]
    else:
        dtype = token_dtype(dtype_name) if dtype_name else dtype_for_vocab(vocab_size)
        files = _token_files(paths, "data.paths", dtype, vocab_size,
                             " (or leave data.paths empty for the embedded stdlib corpus)", cache)

    windows = TokenWindows(files, seq_len, **layout)
    n_batches_needed = 2 if eval_fraction > 0 else 1  # train, and eval when enabled
    if len(windows) < n_batches_needed * global_batch_size:
        raise DataError(
            f"the data ({windows.n_tokens} tokens in {len(files)} file(s)) gives "
            f"{len(windows)} windows of seq_len {seq_len} (data.instances={windows.instances!r}), fewer than "
            f"{n_batches_needed} global batch(es) of {global_batch_size} (training"
            + (", and eval since data.eval_fraction > 0" if eval_fraction > 0 else "")
            + "); lower seq_len or the global batch size, or add token files to data.paths"
        )
    min_eval_windows = global_batch_size if eval_fraction > 0 else 0
    train_ids, eval_ids = split_windows(len(windows), eval_fraction, SPLIT_SEED, min_eval_windows)
    if len(train_ids) < global_batch_size:
        raise DataError(
            f"after holding out {len(eval_ids)} of {len(windows)} windows for eval "
            f"(data.eval_fraction={eval_fraction}, at least one global batch), "
            f"{len(train_ids)} remain for training, fewer than one global batch of "
            f"{global_batch_size} at seq_len {seq_len}; lower data.eval_fraction, seq_len or "
            "the global batch size, or add token files to data.paths"
        )
    # Eval batches ignore the training seed too: every run evaluates the same batches.
    eval_loader = None
    if len(eval_ids):
        eval_loader = BatchLoader(windows, eval_ids, global_batch_size, SPLIT_SEED)
    dtype = token_dtype(dtype_name) if dtype_name else dtype_for_vocab(vocab_size)
    eval_sets = {
        name: _eval_set(name, set_paths, seq_len, global_batch_size, dtype, vocab_size, layout,
                        cache)
        for name, set_paths in _mapping(_field(data_cfg, "eval_sets", {})).items()
    }
    return Data(
        train=BatchLoader(windows, train_ids, global_batch_size, seed,
                          mixture=mixture.fingerprint() if mixture else "none",
                          schedule=batch_schedule),
        eval=eval_loader,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        windows=windows,
        eval_sets=eval_sets,
        mixture=mixture,
    )


def _sources_from_mix(sources: dict, lines: list, mix: str) -> dict:
    """data.sources with data.mix: a source without `paths` takes the mix lines labelled
    with its name."""
    by_label: dict[str, list[str]] = {}
    for m in lines:
        by_label.setdefault(m.label, []).append(m.path)
    out = {}
    for name, fields in sources.items():
        fields = dict(fields) if isinstance(fields, Mapping) else fields
        if isinstance(fields, dict) and not fields.get("paths"):
            if name not in by_label:
                raise DataError(
                    f"data.sources.{name} has no paths and data.mix={mix!r} has no label "
                    f"{name!r}; its labels are {', '.join(sorted(by_label))}")
            fields["paths"] = by_label[name]
        out[name] = fields
    return out


def _mixture_files(mixture: Mixture, dtype: np.dtype, vocab_size: int,
                   instances: str, cache: storage.RangeCache | None = None) -> list[FilePrefix]:
    """The mixture's entries as token files cut to their selected tokens (one token more
    for data.instances='plus_one', whose windows read one past their stride)."""
    opened: dict[str, TokenFile] = {}
    extra = 1 if instances == "plus_one" else 0
    out = []
    for path, tokens in mixture.entries():
        if path not in opened:
            opened[path] = open_token_file(path, dtype, vocab_size, cache)
        out.append(FilePrefix(opened[path], tokens + extra))
    return out


def _layout(data_cfg: Any) -> dict:
    """TokenWindows' layout arguments: `instances` and the repetition filter, if on."""
    instances = str(_field(data_cfg, "instances", "olmo_core"))
    if not bool(_field(data_cfg, "repetition_filter", False)):
        return {"instances": instances, "repetition_filter": None}
    rule = RepetitionFilter(
        max_period=int(_field(data_cfg, "repetition_max_period", 13)),
        min_period=int(_field(data_cfg, "repetition_min_period", 1)),
        max_count=int(_field(data_cfg, "repetition_max_count", 32)),
    )
    if rule.problem():
        raise DataError(rule.problem())
    return {"instances": instances, "repetition_filter": rule}


def _paths(paths: Any) -> list:
    if isinstance(paths, str):  # the config's form: comma-separated paths
        return [p.strip() for p in paths.split(",") if p.strip()]
    return [paths] if isinstance(paths, Path) else list(paths)


def _mapping(value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise DataError(
            f"data.eval_sets={value!r} must map names to token files, e.g. "
            "{'wiki': '/data/wiki_val.npy'}")
    return dict(value)


def _token_files(paths: list, where: str, dtype: np.dtype, vocab_size: int,
                 hint: str = "", cache: storage.RangeCache | None = None) -> list:
    for i, path in enumerate(paths):
        if not storage.is_remote(path) and Path(path).expanduser().is_dir():
            raise DataError(f"{where}[{i}]: {path} is a directory, not a token file; list the "
                            "token files in it, or a glob of them in a source mixture "
                            "(data.sources paths take globs)")
        try:
            found = storage.is_file(path)
        except (OSError, ValueError) as e:
            raise DataError(f"{where}[{i}]: " + storage.storage_error(path, e, "token file")) from None
        if not found:
            raise DataError(
                f"{where}[{i}]: token file {path} does not exist; make one from text "
                f"files with `python -m olmo_jax.tokenize INPUTS -o OUTPUT`{hint}"
            )
    return [open_token_file(path, dtype, vocab_size, cache) for path in paths]


def _eval_set(name: str, paths: Any, seq_len: int, global_batch_size: int, dtype: np.dtype,
              vocab_size: int, layout: dict, cache: storage.RangeCache | None = None) -> BatchLoader:
    """A named eval set: every window of its files, in a fixed shuffled order (seed
    SPLIT_SEED, like the default split), one global batch at a time."""
    where = f"data.eval_sets.{name}"
    if not name or not all(c.isalnum() or c in "_-." for c in name):
        raise DataError(
            f"data.eval_sets name {name!r} is logged as eval/<name>/loss: use letters, "
            "digits, '_', '-' or '.'")
    paths = _paths(paths)
    if not paths:
        raise DataError(f"{where} lists no token files; give it one or more, or remove it")
    windows = TokenWindows(_token_files(paths, where, dtype, vocab_size, cache=cache), seq_len,
                           **layout)
    if len(windows) < global_batch_size:
        raise DataError(
            f"{where}: {windows.n_tokens} tokens give {len(windows)} windows of seq_len "
            f"{seq_len}, fewer than one global batch of {global_batch_size} "
            "(evaluation runs whole global batches); add token files to it, or lower "
            "seq_len or the global batch size")
    return BatchLoader(windows, np.arange(len(windows)), global_batch_size, SPLIT_SEED)
