"""The run folder (trainer.run_dir): checked before anything runs, and its config.json.

- A run_dir that cannot be created or written to is refused, naming trainer.run_dir.
- config.json is the resolved config of the run the folder holds, written when training
  starts (after every check passed, so a refused launch never replaces it). Starting
  again on the same folder with the same config is how a run resumes. A config that
  differs in a field that defines the run (architecture, data, optimizer, seed, batch,
  steps) is refused, naming the fields, unless trainer.overwrite=True: then the old file
  is kept as config.replaced-<time>.json and the run goes on with the new config (it still
  resumes from the folder's checkpoints, whose architecture trainer/checkpoints.py checks).
- Fields that may change between launches of one run: where and how it runs (parallel.*,
  intervals, hard_stop, the reliability knobs, the metric sinks and profiler, the named
  eval sets, data read-ahead) and the model fields a checkpoint does not
  depend on (trainer/checkpoints.py FREE_MODEL_FIELDS, FREE_MOE_FIELDS).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from olmo_jax.config import RunConfig
from olmo_jax.errors import ConfigError
from olmo_jax.trainer.checkpoints import FREE_MODEL_FIELDS, FREE_MOE_FIELDS

CONFIG_FILE = "config.json"
FREE_TRAINER_FIELDS = {
    "run_dir", "cache_dir", "log_every", "eval_every", "eval_batches", "expert_counts_every",
    "sample_prompt", "sample_tokens", "sample_temperature", "save_every", "keep_last", "keep_every", "resume",
    "init_from", "hard_stop", "overwrite", "grad_accum", "nan_policy", "max_skipped",
    "spike_sigma", "memory_limit_gb", "peer_timeout_s", "loggers", "profile_steps",
}
# Fields of other sections that change what is logged or how data is read, not the run.
FREE_DATA_FIELDS = {"prefetch", "remote_cache_mb"}


def _is_free(dotted: str) -> bool:
    section, _, rest = dotted.partition(".")
    if section == "parallel":
        return True
    if section == "trainer":
        return rest in FREE_TRAINER_FIELDS or rest.startswith("wandb.")
    if section == "data":
        return rest in FREE_DATA_FIELDS or rest.startswith("eval_sets.")
    if section == "model":
        if rest.startswith("moe."):
            return rest[4:] in FREE_MOE_FIELDS
        return rest in FREE_MODEL_FIELDS
    return False


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def as_json(cfg: RunConfig) -> dict:
    """The config as config.json holds it."""
    return json.loads(json.dumps(cfg.to_dict(), default=str))


def differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(field, saved value, current value) of the run-defining fields that differ (fields
    only one side has, e.g. from another olmo_jax version, are ignored)."""
    a, b = _flat(saved), _flat(current)
    return [(k, a[k], b[k]) for k in a if k in b and a[k] != b[k] and not _is_free(k)]


def prepare(cfg: RunConfig) -> Path:
    """Creates trainer.run_dir, checks it is writable and that it does not hold a run with a
    different config (unless trainer.overwrite). Returns the folder."""
    run_dir = Path(cfg.trainer.run_dir).expanduser()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir, prefix=".write_check"):
            pass
    except OSError as e:
        raise ConfigError(
            f"trainer.run_dir={cfg.trainer.run_dir} cannot be written to ({e.strerror or e}); "
            "choose a folder you can write (the run's checkpoints and metrics go there)"
        ) from e
    saved_path = run_dir / CONFIG_FILE
    if not saved_path.is_file():
        return run_dir
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{saved_path} (the config of the run in trainer.run_dir) cannot be read: {e}; "
            "remove it or choose another trainer.run_dir"
        ) from e
    diff = differences(saved, as_json(cfg))
    if diff and not cfg.trainer.overwrite:
        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diff[:5])
        more = f" and {len(diff) - 5} more" if len(diff) > 5 else ""
        raise ConfigError(
            f"trainer.run_dir={cfg.trainer.run_dir} holds a run with a different config "
            f"({saved_path}): {shown}{more}. Use that run's settings to resume it, choose a new "
            "trainer.run_dir, or pass --config.trainer.overwrite=True to continue it with this "
            "config"
        )
    return run_dir


def write_config(run_dir: Path, cfg: RunConfig) -> None:
    """Writes config.json (atomically); with trainer.overwrite, a different config.json
    already there is kept as config.replaced-<time>.json."""
    path = run_dir / CONFIG_FILE
    current = as_json(cfg)
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            saved = None
        if saved is not None and saved != current:
            if differences(saved, current):
                stamp = time.strftime("%Y%m%d-%H%M%S")
                os.replace(path, run_dir / f"config.replaced-{stamp}.json")
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".config.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(current, f, indent=2)
    os.replace(tmp, path)
