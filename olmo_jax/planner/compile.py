"""Ahead-of-time compilation of a config's real training step on abstract inputs.

The step is the trainer's (`make_train_step` under the config's `ParallelPlan`, jitted by
`plan.jit_train_step` with the state's shardings), lowered on `jax.ShapeDtypeStruct`s that
carry those shardings: nothing is initialized or allocated. The devices are whatever the
caller passes: abstract GPUs of one kind (olmo_jax.targets, in an interpreter with the jax
CUDA plugin: the program is XLA:GPU's, `compiler` "XLA:GPU") or the planner's fake CPU
devices (XLA:CPU's). planner/xla_gpu.py chooses.

XLA writes its buffer assignment and live ranges into a dump folder (compile option
`xla_dump_to`), which memory.py reads for the buffers live at the peak (of XLA:GPU, whose
`Compiled.as_text()` renames some instructions, the module is read from the same dump, so
the names agree). Options that
change no HLO, buffer or collective, only compile time (`planner_options`): XLA:CPU's
backend at optimization level 0 (less LLVM time); XLA:GPU without autotuning (nothing to
time candidate kernels on: each GEMM fusion takes its default tiling, as
tests/gpu/test_compile_matrix.py compiles).

`compile_train_step(cfg, devices, trainer_step=True)` compiles exactly what
`python -m olmo_jax.train` runs: the step wrapped in the trainer's bad-step guard
(olmo_jax/trainer/guard.py) on a state that carries the guard's counters, compiled with
the backend's default options (no dump, full optimisation): what tests/gpu compiles for
abstract GPUs (olmo_jax.targets). `lowered` keeps the StableHLO, where the JAX-level
choices (ragged_dot, Pallas kernels, scaled_matmul) are still visible by name.

On fake CPU devices a planner compile for a GPU kind (`kind`: one of olmo_jax.targets'
kinds, or None) is the XLA:CPU fallback of a GPU's program, so `model.attention_impl=auto`
compiles the xla attention core there (a GPU's choice in float32; where the GPU runs
cuDNN's, plan_build.py takes the core's [T, S] buffers off), not the CPU's FFI kernel
(olmo_jax/kernels/cpu_attention.py), which `kind="cpu"` and the trainer's step keep.

A pipelined step's module is counted with each pipeline branch run as often as the
schedule runs it, averaged over the stages (pipeline_cost.branch_weights).

`batch_size` compiles the step of another batch size of `trainer.batch_size_schedule`, as
the trainer runs it: the microbatch of global_batch_size / grad_accum sequences kept, so
that size's microbatches (`TrainerConfig.grad_accum_at`) are accumulated; the learning rate
is the trainer's (`trainer.loop.schedule_args`: with a schedule, its per-step table).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from olmo_jax import targets
from olmo_jax.config import RunConfig
from olmo_jax.data import load_tokenizer
from olmo_jax.kernels import platform
from olmo_jax.model import TransformerConfig
from olmo_jax.optim import build_optimizer
from olmo_jax.parallel.strategy import ParallelPlan, build_plan
from olmo_jax.planner import hlo, memory, pipeline_cost
from olmo_jax.trainer import guard as guard_lib
from olmo_jax.trainer.loop import schedule_args
from olmo_jax.trainer.state import TrainState, abstract_train_state
from olmo_jax.trainer.step import make_train_step


@dataclasses.dataclass
class CompiledStep:
    cfg: RunConfig
    model_cfg: TransformerConfig
    plan: ParallelPlan
    compiled: jax.stages.Compiled
    module: hlo.HloModule  # pipeline branches counted per the schedule (module docstring)
    state: TrainState  # of ShapeDtypeStructs with their shardings
    shardings: TrainState
    batch: jax.ShapeDtypeStruct
    lower_s: float
    compile_s: float
    live_range: str  # XLA's live-range report ("" when it wrote none)
    lowered: jax.stages.Lowered | None = None
    buffer_assignment: str = ""  # XLA's buffer assignment report ("" when it wrote none)
    batch_size: int = 0  # sequences per step (0: trainer.global_batch_size)
    grad_accum: int = 0  # microbatches accumulated per step (0: trainer.grad_accum)

    def __post_init__(self):
        t = self.cfg.trainer
        self.batch_size = self.batch_size or t.global_batch_size
        self.grad_accum = self.grad_accum or t.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.cfg.trainer.seq_len

    @property
    def n_devices(self) -> int:
        return self.plan.mesh.devices.size

    @property
    def gpu_kind(self) -> str | None:
        """The olmo_jax.targets kind the program was compiled for (None: XLA:CPU)."""
        return targets.kind_of(self.plan.mesh.devices.flat[0])

    @property
    def compiler(self) -> str:
        return "XLA:GPU" if self.gpu_kind else "XLA:CPU"


def planner_options(devices, dump: str) -> dict:
    """The planner's compile options (module docstring) for `devices`, dumping to `dump`."""
    options = {"xla_dump_to": dump, "xla_dump_hlo_module_re": ".*train_step.*"}
    if targets.kind_of(list(devices)[0]) is not None:
        return {**options, "xla_gpu_autotune_level": 0}
    return {**options, "xla_backend_optimization_level": 0}


def model_config(cfg: RunConfig) -> TransformerConfig:
    """The model config; model.vocab_size 0 takes the tokenizer's (padded) vocabulary, as
    the trainer does, without reading any data."""
    vocab = cfg.data.vocab_size or None
    if not cfg.model.vocab_size and vocab is None:
        vocab = load_tokenizer(cfg.data.tokenizer).padded_vocab_size
    return cfg.model_config(vocab)


def compile_train_step(cfg: RunConfig, devices, *, trainer_step: bool = False,
                       options: dict | None = None, kind: str | None = None,
                       batch_size: int | None = None) -> CompiledStep:
    """Lowers and compiles the train step of the validated config `cfg` (config.validate)
    for a mesh over `devices`: the planner's
    (unguarded, `planner_options` with the buffer dump), or with
    `trainer_step` the trainer's exact program (module docstring), compiled with XLA
    `options` (None: the backend's defaults, as the trainer compiles); `batch_size`: the
    step of that many sequences (a size of trainer.batch_size_schedule; None:
    trainer.global_batch_size)."""
    t0 = time.perf_counter()
    model_cfg = compiled_model_cfg = model_config(cfg)
    if (not trainer_step and kind != "cpu" and model_cfg.attention_impl == "auto"
            and platform.target_of(devices).platform == "cpu"):  # module docstring
        compiled_model_cfg = dataclasses.replace(model_cfg, attention_impl="xla")
    plan = build_plan(cfg.parallel, cfg.trainer, compiled_model_cfg, optim=cfg.optim,
                      devices=devices)
    t = cfg.trainer
    size = batch_size or t.global_batch_size
    grad_accum = t.grad_accum_at(size)  # = trainer.grad_accum at global_batch_size
    tx, schedule = build_optimizer(cfg.optim, t.total_steps, **schedule_args(t))
    guard_cfg = guard_lib.GuardConfig.from_trainer(t) if trainer_step else None
    graphdef, abstract = abstract_train_state(plan.model_cfg, tx, dispatcher=plan.dispatcher,
                                              guard_cfg=guard_cfg)
    shardings = plan.state_shardings(abstract, tx)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         abstract, shardings)
    shape = plan.batch_shape(size, t.seq_len, None if size == t.global_batch_size else grad_accum)
    batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=plan.batch_sharding())
    train_step = make_train_step(graphdef, plan.model_cfg, tx, schedule, grad_accum, parallel=plan,
                                 expert_ranks=plan.mesh.shape["expert"])
    if trainer_step:
        train_step = guard_lib.guarded(train_step, guard_cfg)
    step = plan.jit_train_step(train_step, shardings)
    lowered = step.lower(state, batch)
    t1 = time.perf_counter()
    if trainer_step:
        compiled, live_range, assignment = lowered.compile(options), "", ""
        program = compiled
    else:
        assert options is None, "options are for trainer_step compiles"
        with tempfile.TemporaryDirectory(prefix="olmo_jax_plan_") as dump:
            compiled = lowered.compile(planner_options(devices, dump))
            path = memory.live_range_file(Path(dump))
            live_range = path.read_text() if path else ""
            path = memory.buffer_assignment_file(Path(dump))
            assignment = path.read_text() if path else ""
            gpu_text = memory.gpu_module_file(Path(dump))
            program = gpu_text.read_text() if gpu_text else compiled
    t2 = time.perf_counter()
    module = hlo.parse_module(program)
    if plan.pipeline is not None:
        module = module.counted(pipeline_cost.branch_weights(module, plan.pipeline.schedule))
    return CompiledStep(cfg, model_cfg, plan, compiled, module, state, shardings, batch,
                        t1 - t0, t2 - t1, live_range, lowered, assignment, size, grad_accum)
