"""Pipeline parallelism over the mesh axis `pipe`: GPipe, 1F1B and interleaved 1F1B, in
SPMD JAX (one program; `shard_map` + `ppermute` inside a `lax.scan` over schedule ticks).

    parallel.pipe = P                 stages
    parallel.pipeline_schedule        gpipe | 1f1b | interleaved_1f1b
    parallel.microbatches = M         microbatches per pipeline flush (per trainer.grad_accum step)
    parallel.virtual_stages = V       chunks per stage (interleaved_1f1b, or circular gpipe)

The pieces: schedule.py (pure tables: which op each stage runs at each tick, buffer
slots, bubble fraction), layout.py (which layers each stage runs, parameter storage and
the per-step gather / gradient reduction over `pipe`), run.py (the executor), stash.py
(a jax.vjp's residuals kept across ticks). `ParallelPlan` (strategy.py) holds a
`Pipeline` when P > 1 (an `objective.PipelineRunner`); the trainer's step then takes its
gradients from `Pipeline.grad_fn` (M microbatches = M-step gradient accumulation on one
device, the losses and router statistics summed exactly as there) and its evaluation
from `Pipeline.eval_fn`; downstream scoring its per-row sums from `Pipeline.rows_fn`.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from olmo_jax.errors import ConfigError
from olmo_jax.model.config import TransformerConfig
from olmo_jax.objective import Plan
from olmo_jax.parallel.pipeline import layout, run, schedule
from olmo_jax.parallel.pipeline.layout import Chunking, StageLayout, chunking
from olmo_jax.parallel.pipeline.schedule import PIPELINE_SCHEDULES, Schedule, textbook_bubble


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline:
    schedule: Schedule
    chunks: Chunking
    layouts: object  # tree of StageLayout, the params' structure

    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    @property
    def bubble(self) -> float:
        """The schedule table's idle fraction (logged as `pipeline_bubble`)."""
        return self.schedule.bubble

    # inside the step's shard_map
    def gather(self, params):
        return layout.gather(params, self.layouts, self.chunks)

    def reduce(self, grads):
        return layout.reduce(grads, self.layouts, self.chunks)

    def grad_fn(self, graphdef, cfg: TransformerConfig, ops: Plan):
        return run.make_grad_fn(self.schedule, self.chunks, graphdef, cfg, ops)

    def eval_fn(self, graphdef, cfg: TransformerConfig, ops: Plan):
        s = self.schedule
        return run.make_eval_fn(s.stages, s.virtual, s.microbatches, self.chunks, graphdef, cfg, ops)

    def rows_fn(self, graphdef, cfg: TransformerConfig, ops: Plan, row_head):
        """Per-row sums of the logits (downstream scoring), forwards only: run.make_rows_fn."""
        s = self.schedule
        return run.make_rows_fn(s.stages, s.virtual, s.microbatches, self.chunks, graphdef, cfg, ops,
                                row_head)


def build_pipeline(parallel_cfg, model_cfg: TransformerConfig, mesh: Mesh, abstract_params,
                   compute_specs, shard: bool) -> Pipeline:
    """Validates the pipeline fields against the model and mesh (ConfigError naming the
    field) and builds the schedule, chunking and parameter layouts."""
    p = parallel_cfg
    if p.strategy != "ddp":
        raise ConfigError(
            f"parallel.pipe={mesh.shape['pipe']} runs with parallel.strategy=ddp (experts "
            f"resident, ZeRO-1); parallel.strategy={p.strategy!r} is the non-pipelined baseline")
    try:
        sched = schedule.build(p.pipeline_schedule, mesh.shape["pipe"], p.virtual_stages,
                               p.microbatches)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    chunks = chunking(model_cfg.n_moe_layers, mesh.shape["pipe"], p.virtual_stages)
    layouts = layout.param_layouts(abstract_params, compute_specs, mesh, shard)
    return Pipeline(sched, chunks, layouts)


def check_unpipelined(parallel_cfg) -> None:
    """With parallel.pipe = 1 the pipeline fields must keep their defaults."""
    p = parallel_cfg
    if p.microbatches != 1:
        raise ConfigError(
            f"parallel.microbatches={p.microbatches} splits the batch for pipeline stages, but "
            f"parallel.pipe=1; use trainer.grad_accum for microbatches without a pipeline")
    if p.virtual_stages != 1:
        raise ConfigError(
            f"parallel.virtual_stages={p.virtual_stages} needs parallel.pipe > 1")


__all__ = ["PIPELINE_SCHEDULES", "Chunking", "Pipeline", "Schedule", "StageLayout", "build_pipeline",
           "check_unpipelined", "chunking", "textbook_bubble"]
