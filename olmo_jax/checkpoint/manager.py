"""Checkpoints on disk: an orbax `CheckpointManager` over a directory of step folders.

    {dir}/{step}/model       params + model_state     (orbax arrays, named trees)
    {dir}/{step}/train       step, rng, opt_state     (absent in converted checkpoints)
    {dir}/{step}/data        the data loader's position (JSON)
    {dir}/{step}/data_iter   the grain iterator state of each process's batch stream
                             (grain's orbax handler: process_I-of-N.json)
    {dir}/{step}/config      the resolved run config + the typed model config (JSON)
    {dir}/{step}/hf_config   the Hugging Face config.json a model came from (JSON, optional)

Saves are asynchronous (the arrays are copied to host memory before `save` returns, so
the caller may donate them at once) and atomic: orbax writes into a temporary folder and
renames it only when every file is written, so a crash or `kill -9` mid-save leaves the
previous checkpoints untouched and an incomplete temporary folder that every reader
ignores (and a writer deletes). In an `s3://` or `gs://` bucket
(checkpoint/object_store.py), which has no atomic rename, a step is written in place and
is complete only once its commit marker (`commit_success.txt`) exists; a step folder
without it is ignored the same way.
Restores read every array straight onto the target shardings given, whatever mesh
wrote them, after checking that names, shapes and dtypes fit (a mismatch names the first
parameter and both shapes).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from olmo_jax import storage
from olmo_jax.checkpoint import object_store
from olmo_jax.checkpoint.tree import (
    check_fits,
    flatten_named,
    flatten_nested,
    nest,
    unflatten_named,
)
from olmo_jax.errors import CheckpointError
from olmo_jax.model.config import ABSENT_FIELD_MEANING, MoEConfig, TransformerConfig

MODEL, TRAIN, DATA, CONFIG, HF_CONFIG = "model", "train", "data", "config", "hf_config"
DATA_ITER = "data_iter"
_ARRAY_ITEMS = (MODEL, TRAIN)
_JSON_ITEMS = (DATA, CONFIG, HF_CONFIG)
RUN_SUBDIR = "checkpoints"  # a run's checkpoints live in {run_dir}/checkpoints


class Checkpoints:
    """Save and restore named items of numbered steps in `directory`.

    keep_last: keep the N newest steps (0 = all); keep_every: also keep every step that is
    a multiple of K (0 = off); read_only: never create, write or delete anything."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int = 0,
        keep_every: int = 0,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.remote = storage.is_remote(directory)
        if self.remote:  # s3:// / gs://: epath (fsspec) for folders, tensorstore for arrays
            object_store.install()
            self.directory = epath.Path(str(directory).rstrip("/"))
        else:
            self.directory = Path(directory).absolute()
        if read_only and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint folder {self.directory} does not exist")
        extra = {"atomicity_options": object_store.atomicity_options()} if self.remote else {}
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep_last or None,
            keep_period=keep_every or None,
            enable_async_checkpointing=async_save,
            create=not read_only,
            cleanup_tmp_directories=not read_only,
            **extra,
        )
        self.read_only = read_only
        handlers = {name: ocp.StandardCheckpointHandler() for name in _ARRAY_ITEMS}
        handlers.update({name: ocp.JsonCheckpointHandler() for name in _JSON_ITEMS})
        handlers[DATA_ITER] = grain.checkpoint.CheckpointHandler()
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # ---- listing -------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest COMPLETE step (temporary folders of interrupted saves are ignored)."""
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def step_dir(self, step: int) -> Path | epath.Path:
        return self.directory / str(step)

    def has_item(self, step: int, item: str) -> bool:
        return (self.step_dir(step) / item).is_dir()

    # ---- saving --------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        model: dict,
        train: dict | None = None,
        json_items: dict[str, Any] | None = None,
        data_iter: dict | None = None,
    ) -> None:
        """Starts an asynchronous save of step `step`. `model` / `train` are pytrees
        (saved under their leaves' names); `json_items` maps DATA/CONFIG/HF_CONFIG to
        JSON-serializable values; `data_iter` is this process's grain iterator state."""
        if self.read_only:
            raise ValueError(f"{self.directory} was opened read-only")
        args = {MODEL: ocp.args.StandardSave(nest(flatten_named(model)))}
        if train is not None:
            args[TRAIN] = ocp.args.StandardSave(nest(flatten_named(train)))
        for name, value in (json_items or {}).items():
            if name not in _JSON_ITEMS:
                raise ValueError(f"unknown JSON item {name!r}")
            args[name] = ocp.args.JsonSave(value)
        if data_iter is not None:  # a snapshot: the stream moves on while the save runs
            args[DATA_ITER] = grain.checkpoint.CheckpointSave(_IteratorState(data_iter))
        self._mgr.save(step, args=ocp.args.Composite(**args), force=True)

    def poll(self) -> bool:
        """Whether no save is in flight; raises the error of the last asynchronous save if
        it failed (never waits for a save in progress)."""
        if self._mgr.is_saving_in_progress():
            return False
        self._mgr.wait_until_finished()  # the finished save's thread: joined, its error raised
        return True

    def complete_steps_on_disk(self) -> list[int]:
        """The steps whose folders exist under their final names (orbax renames a save's
        temporary folder only once every file is written), read from the disk; in a
        bucket, the step folders that hold their commit marker."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and (
            not self.remote or (p / object_store.COMMIT_MARKER).exists()))

    def remove_temporary(self, step: int) -> None:
        """Deletes the temporary folder(s) of an interrupted or failed save of `step` (in a
        bucket: the step's folder when it has no commit marker)."""
        if self.remote:
            p = self.step_dir(step)
            if p.exists() and not (p / object_store.COMMIT_MARKER).exists():
                p.rmtree(missing_ok=True)
            return
        for p in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(p, ignore_errors=True)

    def wait(self) -> None:
        """Blocks until the last save is complete on disk."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Waits for the last save, then stops orbax's background threads."""
        self._mgr.wait_until_finished()
        self._mgr.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- restoring -----------------------------------------------------------------
    def _require(self, step: int, item: str) -> None:
        if step not in self._mgr.all_steps():
            raise CheckpointError(
                f"{self.directory} has no complete checkpoint for step {step} "
                f"(complete steps: {self.all_steps() or 'none'})"
            )
        if not self.has_item(step, item):
            hint = (
                "; it holds model weights only (e.g. from `python -m olmo_jax.convert "
                "hf-to-orbax`): start a run from it with trainer.init_from, not by resuming"
                if item == TRAIN
                else ""
            )
            raise CheckpointError(f"checkpoint {self.step_dir(step)} has no '{item}' item{hint}")

    def array_metadata(self, step: int, item: str) -> dict[str, Any]:
        """{name: metadata with .shape and .dtype} of an array item."""
        self._require(step, item)
        try:
            meta = self._mgr.item_metadata(step)[item]
            tree = meta.tree if hasattr(meta, "tree") else meta
        except Exception as e:  # orbax raises many types for unreadable metadata
            raise CheckpointError(
                f"cannot read the metadata of {self.step_dir(step) / item}: {e}; the "
                "checkpoint is corrupt: delete that step folder to resume from an earlier one"
            ) from e
        return flatten_nested(tree)

    def restore_arrays(self, step: int, item: str, target: dict[str, Any]) -> dict[str, jax.Array]:
        """Reads item `item` of step `step`. `target` maps each name to a
        jax.ShapeDtypeStruct carrying the sharding to read it onto."""
        where = str(self.step_dir(step) / item)
        check_fits(target, self.array_metadata(step, item), where)
        try:
            restored = self._mgr.restore(
                step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(nest(target))})
            )[item]
        except Exception as e:
            raise CheckpointError(
                f"cannot read {where}: {type(e).__name__}: {e}; the checkpoint is corrupt: "
                "delete that step folder to resume from an earlier one"
            ) from e
        return flatten_nested(restored)

    def read_json(self, step: int, item: str) -> Any:
        self._require(step, item)
        try:
            return self._mgr.restore(
                step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()})
            )[item]
        except Exception as e:
            raise CheckpointError(f"cannot read {self.step_dir(step) / item}: {e}") from e


    def read_iterator_state(self, step: int) -> dict | None:
        """This process's grain iterator state saved with step `step`; None when the
        checkpoint has none for it (written before grain, or by another process count)."""
        where = self.step_dir(step) / DATA_ITER
        index, count = jax.process_index(), jax.process_count()
        if not (where / f"process_{index}-of-{count}.json").is_file():
            return None
        holder = _IteratorState(None)
        try:
            self._mgr.restore(
                step, args=ocp.args.Composite(**{DATA_ITER: grain.checkpoint.CheckpointRestore(holder)}))
        except Exception as e:
            raise CheckpointError(f"cannot read {where}: {e}") from e
        return holder.state


class _IteratorState:
    """A grain iterator's state, held still: what grain's orbax handler saves (get_state)
    and restores into (set_state)."""

    def __init__(self, state: dict | None):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, state: bytes) -> None:
        self.state = json.loads(state)

    def start_prefetch(self) -> None:
        pass


def targets(like: Any, shardings: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """{name: ShapeDtypeStruct(shape, dtype, sharding)} for a tree and a matching tree of
    shardings (or one sharding for every leaf)."""
    leaves = flatten_named(like)
    if isinstance(shardings, jax.sharding.Sharding):
        sh = dict.fromkeys(leaves, shardings)
    else:
        sh = flatten_named(shardings)
        if set(sh) != set(leaves):
            raise ValueError(
                f"shardings do not match the tree: {sorted(set(sh) ^ set(leaves))[:3]}"
            )
    return {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh[n]) for n, x in leaves.items()}


def restore_tree(ckpts: Checkpoints, step: int, item: str, like: Any, shardings: Any) -> Any:
    """Item `item` read into a tree shaped like `like`, each leaf on its sharding."""
    return unflatten_named(like, ckpts.restore_arrays(step, item, targets(like, shardings)))


# ---- the typed model config stored in CONFIG ----------------------------------------
def model_config_to_dict(cfg: TransformerConfig) -> dict:
    return dataclasses.asdict(cfg)


def model_config_from_dict(d: dict) -> TransformerConfig:
    """The typed model config of a saved dict; a field it lacks (it was written before the
    field existed) takes the value it meant then (model/config.ABSENT_FIELD_MEANING)."""
    d = {**ABSENT_FIELD_MEANING, **d}
    return TransformerConfig(**{**d, "moe": MoEConfig(**d["moe"])}).validate()


def saved_model_config(ckpts: Checkpoints, step: int) -> TransformerConfig:
    saved = ckpts.read_json(step, CONFIG)
    if not isinstance(saved, dict) or "model" not in saved:
        raise CheckpointError(
            f"{ckpts.step_dir(step) / CONFIG} has no typed model config ('model'); it was not "
            "written by olmo_jax"
        )
    return model_config_from_dict(saved["model"])


def saved_run_config(path: str | Path) -> dict:
    """The run config (RunConfig.to_dict()) an olmo_jax checkpoint recorded beside its model
    (`resolve`'s step); {} when it recorded none."""
    ckpts, step = resolve(path)
    with ckpts:
        saved = ckpts.read_json(step, CONFIG) if ckpts.has_item(step, CONFIG) else {}
    config = saved.get("config") if isinstance(saved, dict) else None
    return config if isinstance(config, dict) else {}


def resolve(path: str | Path) -> tuple[Checkpoints, int]:
    """A checkpoint named by a run folder ({path}/checkpoints, its latest step), a
    checkpoints folder (its latest step) or one step folder ({dir}/{step}): (an open
    read-only Checkpoints, to close after use, e.g. `with`; the step). `path` may be in a
    bucket (`s3://`, `gs://`)."""
    p = epath.Path(str(path).rstrip("/")) if storage.is_remote(path) else Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    step = None
    if (p / RUN_SUBDIR).is_dir():
        root = p / RUN_SUBDIR
    elif p.name.isdigit() and (p / MODEL).is_dir():
        root, step = p.parent, int(p.name)
    else:
        root = p
    ckpts = Checkpoints(root, read_only=True)
    if step is None:
        step = ckpts.latest_step()
        if step is None:
            ckpts.close()
            raise CheckpointError(
                f"{root} holds no complete checkpoint (interrupted saves are ignored); pass a "
                "run folder, its checkpoints folder or one step folder"
            )
    return ckpts, step
