"""What a report is drawn from: a run folder or a config, read into plain Python.

A run folder (written by `olmo_jax.trainer.loop`) holds `config.json` (the resolved
config), `metrics.jsonl` (one record per logged step), optionally `expert_counts.jsonl`
(per-block expert counts every `trainer.expert_counts_every` steps) and `mesh.json` (the
mesh the run trained on). A run folder in a bucket (`s3://`) is read by copying those
four files (`fetch_run`: never the checkpoints). A plan starts from a config file with overrides. Either way the
report needs the config, the typed model config and the number of devices of the mesh.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from olmo_jax import config as config_lib
from olmo_jax import storage
from olmo_jax.config import RunConfig
from olmo_jax.data import load_tokenizer
from olmo_jax.model.config import TransformerConfig
from olmo_jax.parallel.mesh import AXES


class ReportError(ValueError):
    """A report input that cannot be used; the message names the file or field and the fix."""


@dataclasses.dataclass
class RunFolder:
    path: Path
    cfg: RunConfig  # parsed, not yet checked (model_config checks it)
    metrics: list[dict]  # metrics.jsonl records, in file order
    counts: list[dict]  # expert_counts.jsonl records ({"step", "blocks", "counts"}), maybe empty
    mesh_shape: dict[str, int] | None  # from mesh.json (None for runs that predate it)


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}: line {n} is not JSON ({e.msg}); is the file truncated?") from e
    return records


def config_from_dict(d: dict, where: str) -> RunConfig:
    """The typed sections of `d` (a resolved config as written to config.json) over the
    defaults."""
    try:
        return config_lib.from_saved(d)
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise ReportError(f"{where} does not fit this version's config schema: {e}") from e


RUN_FILES = ("config.json", "metrics.jsonl", "expert_counts.jsonl", "mesh.json")


def fetch_run(url: str, local: Path) -> Path:
    """The report's inputs of the run folder `url` (in a bucket) copied into `local`."""
    try:
        if not storage.is_file(storage.join(url, "config.json")):
            raise ReportError(f"{url}/config.json not found: {url} is not a run folder (the "
                              "trainer writes config.json into trainer.run_dir when a run starts)")
        for name in RUN_FILES:
            src = storage.join(url, name)
            if storage.is_file(src):
                (local / name).write_bytes(storage.read_bytes(src))
    except OSError as e:
        raise ReportError(storage.storage_error(url, e)) from None
    return local


def load_run(run_dir: str | Path) -> RunFolder:
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"run folder {path} does not exist (pass the trainer.run_dir of a run)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ReportError(
            f"{cfg_path} not found: {path} is not a run folder (the trainer writes config.json "
            f"into trainer.run_dir when a run starts)")
    cfg = config_from_dict(json.loads(cfg_path.read_text()), str(cfg_path))
    metrics_path = path / "metrics.jsonl"
    metrics = _read_jsonl(metrics_path) if metrics_path.is_file() else []
    counts_path = path / "expert_counts.jsonl"
    counts = _read_jsonl(counts_path) if counts_path.is_file() else []
    mesh_path = path / "mesh.json"
    mesh_shape = json.loads(mesh_path.read_text()) if mesh_path.is_file() else None
    return RunFolder(path, cfg, metrics, counts, mesh_shape)


def model_config(cfg: RunConfig) -> TransformerConfig:
    """The typed model config, every section checked (config.check); a vocabulary of 0 is
    taken from the tokenizer, as the trainer does (without reading any token file)."""
    vocab = cfg.data.vocab_size or load_tokenizer(cfg.data.tokenizer).padded_vocab_size
    config_lib.check(cfg)
    return cfg.model_config(vocab)


def device_count(cfg: RunConfig, mesh_shape: dict[str, int] | None,
                 devices: int) -> int:
    """Devices of the mesh to draw: `devices` if > 0 (--devices), else the run's mesh.json,
    else the product of parallel.pipe/data/expert; 0 when one of them is -1 (fill: the
    mesh takes whatever devices there are, as in training)."""
    if devices > 0:
        return devices
    if mesh_shape is not None:
        mesh_shape = {"context": 1, **mesh_shape}  # runs from before the context axis
        missing = [a for a in AXES if a not in mesh_shape]
        if missing:
            raise ReportError(f"mesh.json lacks the axes {missing}; expected {list(AXES)}")
        return math.prod(int(mesh_shape[a]) for a in AXES)
    sizes = [getattr(cfg.parallel, a) for a in AXES]
    return 0 if -1 in sizes else math.prod(sizes)
