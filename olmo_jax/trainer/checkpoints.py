"""Checkpoints inside a training run (what `olmo_jax/trainer/loop.py` calls): when the run
saves, what it resumes from and what it checks first. The storage itself (orbax, the
folder layout, the saved config) is olmo_jax/checkpoint's, which knows nothing of the
trainer.

- Start: a run_dir that already holds checkpoints continues from the latest COMPLETE one
  (`trainer.resume`, default on): params, optimizer state, step, RNG, data position, all
  read onto this run's shardings, and the grain iterator state of this process's batch
  stream (`iterator_state`, applied by the loop). Otherwise `trainer.init_from` (if set) loads a
  checkpoint's weights into a fresh run (new optimizer state, step 0).
- metrics.jsonl on resume: the records of steps after the restored checkpoint (trained,
  then lost with the process) are dropped, the file is then appended to. Every step
  therefore appears once, with the values of the run that produced the checkpoints.
- Save: every `trainer.save_every` steps and at the last step (max_steps or hard_stop),
  asynchronously; `trainer.keep_last` newest kept, plus multiples of `trainer.keep_every`.
- A failed save (a full disk, an I/O error) stops the run: the loop polls the save in
  flight after every step, and the next save or the end waits for it. The failure is one
  StorageError naming the run folder, the cause, the space a checkpoint takes and the space
  free, and the last complete checkpoint; the failed save's temporary folder is removed.
  At start, a warning when fewer than two checkpoints fit in the free space.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from rich.console import Console

from olmo_jax import storage
from olmo_jax.checkpoint import manager as m
from olmo_jax.errors import CheckpointError, StorageError
from olmo_jax.model.config import TransformerConfig
from olmo_jax.trainer.config import TrainerConfig
from olmo_jax.trainer.state import TrainState, initial_rng

# Model fields that change numerics or cost but not what the weights mean: a checkpoint
# may be resumed / fine-tuned with other values (the kernel choices among them). The RoPE
# scaling too (not rope_theta): extending the context of a trained checkpoint is starting
# from it (trainer.init_from) with a new scaling, e.g. YaRN or ABF's new base.
FREE_MODEL_FIELDS = {"dtype", "remat", "init_std", "scan_unroll", "attention_impl", "norm_impl",
                     "mxfp8_gemm_impl", "lm_loss_chunk", "rope_scaling", "rope_scaling_factor",
                     "rope_new_theta", "rope_old_context_len", "rope_low_freq_proportion",
                     "rope_high_freq_proportion", "rope_beta_fast", "rope_beta_slow",
                     "rope_attention_factor", "rope_scaling_layers",
                     # context parallelism: how attention runs over the sequence's shards (a
                     # run resumes onto another parallel.context)
                     "context_attention", "context_parallel", "context_ring_hops"}
FREE_MOE_FIELDS = {
    "capacity_factor", "gmm_impl", "lb_loss_coef", "z_loss_coef", "lb_loss_type", "lb_granularity",
    "routing_mode", "router_jitter",
}


def architecture_difference(saved: TransformerConfig, run: TransformerConfig):
    """(field, saved value, run value) of the first architecture field that differs."""
    for f in dataclasses.fields(TransformerConfig):
        if f.name in FREE_MODEL_FIELDS:
            continue
        if f.name == "moe":
            for g in dataclasses.fields(type(saved.moe)):
                a, b = getattr(saved.moe, g.name), getattr(run.moe, g.name)
                if g.name not in FREE_MOE_FIELDS and a != b:
                    return f"model.moe.{g.name}", a, b
        elif getattr(saved, f.name) != getattr(run, f.name):
            return f"model.{f.name}", getattr(saved, f.name), getattr(run, f.name)
    return None


def model_tree(state: TrainState) -> dict:
    return {"params": state.params, "model_state": state.model_state}


def train_tree(state: TrainState) -> dict:
    return {"step": state.step, "rng": state.rng, "opt_state": state.opt_state,
            "guard": state.guard}


def _fresh_guard(abstract: TrainState, shardings: TrainState):
    """A new bad-step guard state (all zeros, as trainer/guard.py init_guard), placed."""
    return jax.device_put(
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract.guard), shardings.guard)


def tree_bytes(tree) -> int:
    """The bytes of the arrays (or ShapeDtypeStructs) of `tree`, as a whole (all shards)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _cause(err: BaseException) -> str:
    """The first line of the deepest message of `err`'s chain, shortened."""
    text = " ".join(str(e) for e in (err, err.__cause__, err.__context__) if e is not None)
    if "No space left on device" in text or "os_error_code='28'" in text:
        return "no space left on device"
    if "Disk quota exceeded" in text:
        return "disk quota exceeded"
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return f"{type(err).__name__}: {first[:300]}"


def truncate_metrics(path: Path, step: int) -> list[dict]:
    """Keeps the records of steps <= `step` (and drops a line cut short by a crash);
    rewrites the file atomically; returns the kept records."""
    if not path.exists():
        return []
    kept, lines = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", math.inf) <= step:
            kept.append(record)
            lines.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in lines))
    os.replace(tmp, path)
    return kept


class RunCheckpoints:
    """The checkpoints of one run: {run_dir}/checkpoints, as its `trainer` section asks;
    `run_config` (RunConfig.to_dict()) is saved with each one."""

    def __init__(
        self,
        trainer: TrainerConfig,
        run_config: dict,
        run_dir: Path,
        model_cfg: TransformerConfig,
        console: Console | None = None,
        checkpoint_dir: str | Path | None = None,
        on_save: Callable[[int], None] | None = None,
    ):
        t = self.trainer = trainer
        self.run_config, self.model_cfg = run_config, model_cfg
        self.console = console or Console()
        self.save_every = t.save_every
        self.remote = storage.is_remote(checkpoint_dir or "")
        # a run folder in a bucket: its checkpoints there, `on_save(step)` before each save
        self.on_save = on_save
        self.ckpts = m.Checkpoints(
            checkpoint_dir or run_dir / m.RUN_SUBDIR, keep_last=t.keep_last,
            keep_every=t.keep_every)
        self.latest = self.ckpts.latest_step()
        if self.latest is not None and not t.resume:
            self.ckpts.close()
            raise CheckpointError(
                f"trainer.run_dir={t.run_dir if self.remote else run_dir} already holds "
                f"checkpoints (latest step "
                f"{self.latest}) and trainer.resume=False; set trainer.resume=True to continue "
                "that run, or choose a new trainer.run_dir"
            )
        self.resumed_from: int | None = None
        self.previous_records: list[dict] = []
        self.last_saved: int | None = self.latest
        self.run_dir = run_dir
        self.where = t.run_dir if self.remote else run_dir  # as messages name it
        self.pending: int | None = None  # the step of the save in flight
        self.failure: StorageError | None = None
        self.checkpoint_bytes = 0  # set by start(): what one checkpoint takes
        # The grain iterator state (data/stream.py) of the checkpoint resumed from, if any.
        self.iterator_state: dict | None = None

    def _check_architecture(self, ckpts: m.Checkpoints, step: int, what: str) -> None:
        saved = m.saved_model_config(ckpts, step)
        diff = architecture_difference(saved, self.model_cfg)
        if diff:
            field, a, b = diff
            raise CheckpointError(
                f"{what}: checkpoint {ckpts.step_dir(step)} was written with {field}={a!r} but "
                f"this run has {field}={b!r}; set --config.{field}={a!r} (or use the config "
                "saved with the checkpoint)"
            )

    def verify(self) -> None:
        """Checks, before anything is compiled or allocated, that the checkpoint this run
        would start from (its latest, or trainer.init_from) has this run's architecture."""
        try:
            if self.latest is not None:
                self._check_architecture(self.ckpts, self.latest, "resume")
            elif self.trainer.init_from:
                ckpts, step = m.resolve(self.trainer.init_from)
                with ckpts:
                    self._check_architecture(
                        ckpts, step, f"trainer.init_from={self.trainer.init_from}")
        except BaseException:
            self.close()
            raise

    def start(
        self,
        abstract: TrainState,
        shardings: TrainState,
        tx,
        train_loader,
        metrics_path: Path,
        init: Callable[[], TrainState],
    ) -> TrainState:
        """The state to train from, on `shardings`: resumed from this run's latest
        checkpoint, or a fresh state with trainer.init_from's weights, or `init()` (which
        makes it on `shardings`). `abstract` is the state's structure (ShapeDtypeStructs);
        nothing is initialized (or allocated twice) when a checkpoint provides the values."""
        t = self.trainer
        self.checkpoint_bytes = tree_bytes(model_tree(abstract)) + tree_bytes(train_tree(abstract))
        if jax.process_index() == 0:
            self._check_space()
        try:
            if self.latest is not None:
                return self._resume(self.latest, abstract, shardings, train_loader, metrics_path)
            if not t.init_from:
                return init()
            return self._init_from(t.init_from, abstract, shardings, tx)
        except BaseException:
            self.close()
            raise

    def _init_from(self, path, abstract, shardings, tx) -> TrainState:
        ckpts, step = m.resolve(path)
        with ckpts:
            self._check_architecture(ckpts, step, f"trainer.init_from={path}")
            model = m.restore_tree(
                ckpts, step, m.MODEL, model_tree(abstract), model_tree(shardings)
            )
        self.console.print(f"initialized the weights from {ckpts.step_dir(step)}")
        seed = self.trainer.seed
        return TrainState(
            step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step),
            params=model["params"],
            opt_state=jax.jit(tx.init, out_shardings=shardings.opt_state)(model["params"]),
            model_state=model["model_state"],
            rng=jax.device_put(initial_rng(seed), shardings.rng),
            guard=_fresh_guard(abstract, shardings),
        )

    def _resume(self, step, abstract, shardings, train_loader, metrics_path) -> TrainState:
        self._check_architecture(self.ckpts, step, "resume")
        model = m.restore_tree(
            self.ckpts, step, m.MODEL, model_tree(abstract), model_tree(shardings)
        )
        like, on = train_tree(abstract), train_tree(shardings)
        saved_names = self.ckpts.array_metadata(step, m.TRAIN)
        if not any(name.startswith("guard/") for name in saved_names):
            # Written before the bad-step guard existed: its counters start afresh.
            like, on = {k: v for k, v in like.items() if k != "guard"}, {
                k: v for k, v in on.items() if k != "guard"}
        train = m.restore_tree(self.ckpts, step, m.TRAIN, like, on)
        if "guard" not in train:
            train["guard"] = _fresh_guard(abstract, shardings)
        train_loader.load_state_dict(self.ckpts.read_json(step, m.DATA))
        self.iterator_state = self.ckpts.read_iterator_state(step)
        if train_loader.step != int(train["step"]) or step != int(train["step"]):
            raise CheckpointError(
                f"checkpoint {self.ckpts.step_dir(step)} is inconsistent: folder step {step}, "
                f"state step {int(train['step'])}, data step {train_loader.step}"
            )
        self.resumed_from = step
        if jax.process_index() == 0:  # the process that writes metrics (multi-process runs)
            self.previous_records = truncate_metrics(metrics_path, step)
        init_from = self.trainer.init_from
        note = f" (trainer.init_from={init_from} ignored: resuming wins)" if init_from else ""
        self.console.print(f"resumed from checkpoint step {step} in {self.ckpts.directory}{note}")
        return TrainState(
            step=train["step"],
            params=model["params"],
            opt_state=train["opt_state"],
            model_state=model["model_state"],
            rng=train["rng"],
            guard=train["guard"],
        )

    def _check_space(self) -> None:
        """A warning when fewer than two checkpoints fit in the run folder's free space
        (none for a bucket)."""
        if self.remote:
            return
        free = shutil.disk_usage(self.run_dir).free
        need = self.checkpoint_bytes
        if self.latest is not None:  # what one really takes on disk
            need = max(need, folder_bytes(self.ckpts.step_dir(self.latest)))
        if free < 2 * need:
            self.console.print(
                f"[yellow]warning:[/] trainer.run_dir={self.run_dir} has {_mb(free)} free and a "
                f"checkpoint takes about {_mb(need)}: fewer than two fit; free space or "
                "move the run folder before a save fails", highlight=False, soft_wrap=True)

    def _storage_error(self, step: int, err: BaseException) -> StorageError:
        if self.remote:
            return self._bucket_error(step, err)
        complete = [s for s in self.ckpts.complete_steps_on_disk() if s != step]
        last = (f"the last complete checkpoint is step {complete[-1]} "
                f"({self.ckpts.step_dir(complete[-1])}); free space (or move the folder), then "
                "run the same command again to resume from it" if complete else
                "there is no complete checkpoint yet; free space (or choose another "
                "trainer.run_dir) and start again")
        need = self.checkpoint_bytes
        if complete:
            need = max(need, folder_bytes(self.ckpts.step_dir(complete[-1])))
        free = shutil.disk_usage(self.run_dir).free
        return StorageError(
            f"cannot write checkpoint step {step} in trainer.run_dir={self.run_dir}: "
            f"{_cause(err)} (a checkpoint takes about {_mb(need)}, {_mb(free)} is free); "
            f"{last}. The run stopped; details in "
            f"{self.run_dir / 'errors.log'}")

    def _bucket_error(self, step: int, err: BaseException) -> StorageError:
        try:
            complete = [s for s in self.ckpts.complete_steps_on_disk() if s != step]
        except Exception:  # the store is unreachable
            complete = []
        last = (f"the last complete checkpoint is step {complete[-1]} "
                f"({self.ckpts.step_dir(complete[-1])}); run the same command again to resume "
                "from it" if complete else "there is no complete checkpoint yet")
        return StorageError(
            f"cannot write checkpoint step {step}: "
            f"{storage.storage_error(self.ckpts.step_dir(step), err, 'writing')}; {last}. The "
            f"run stopped; details in {self.run_dir / 'errors.log'} (also uploaded to "
            f"{storage.join(self.trainer.run_dir, 'errors.log')})")

    def _guarded(self, step: int, action: Callable[[], object]):
        """action() of the save of `step`; a failure stops the run as one StorageError
        (its temporary folder removed, orbax's threads stopped)."""
        try:
            return action()
        except Exception as e:
            self.failure = self._storage_error(step, e)
            self.pending = None
            try:
                self.ckpts.close()
            except Exception:  # the failed save again: already reported
                pass
            self.ckpts.remove_temporary(step)
            raise self.failure from e

    def poll(self) -> None:
        """Raises StorageError when the save in flight has failed (never waits for it)."""
        if self.pending is not None and self._guarded(self.pending, self.ckpts.poll):
            self.pending = None

    @property
    def resumed(self) -> bool:
        return self.resumed_from is not None

    def due(self, step: int, force: bool = False) -> bool:
        """Whether `maybe_save(step, ..., force)` will save."""
        return bool(force or (self.save_every and step % self.save_every == 0)) and (
            self.last_saved != step)

    def maybe_save(self, step: int, state: TrainState, train_loader, force: bool = False,
                   stream=None) -> None:
        """Saves after `step` completed steps when it is a save step (or `force`);
        `stream`: the train batch stream, whose grain iterator state is saved too."""
        if not self.due(step, force):
            return
        train_loader.step = step  # the next batch to train on
        data_iter = None
        if stream is not None:
            data_iter = stream.get_state()
            if int(data_iter["next_index"]) != step:
                raise CheckpointError(
                    f"the data stream is at step {data_iter['next_index']} when saving step {step}")
        config = {"config": self.run_config, "model": m.model_config_to_dict(self.model_cfg)}
        if self.pending is not None:  # the previous save must have succeeded
            self._guarded(self.pending, self.ckpts.wait)
            self.pending = None
        if self.on_save is not None:  # a bucket: still the owner; the run's files uploaded
            self.on_save(step)
        self._guarded(step, lambda: self.ckpts.save(
            step,
            model=model_tree(state),
            train=train_tree(state),
            json_items={m.DATA: train_loader.state_dict(), m.CONFIG: config},
            data_iter=data_iter,
        ))
        self.pending = self.last_saved = step

    def close(self) -> None:
        """Waits for the last save to be complete on disk (StorageError if it failed)."""
        if self.failure is not None:
            return  # closed when it failed
        if self.pending is None:
            self.ckpts.close()
            return
        step, self.pending = self.pending, None
        self._guarded(step, self.ckpts.close)
