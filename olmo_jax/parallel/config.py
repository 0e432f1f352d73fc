"""The run config's `parallel` section: the device mesh, the strategy, expert dispatch and
the pipeline, as a typed dataclass (olmo_jax/config.py generates the ConfigDict from it).
Each choice list is imported from the module that implements it."""

from __future__ import annotations

from dataclasses import dataclass

from olmo_jax.errors import ConfigError, check_choice
from olmo_jax.parallel.expert import BACKENDS
from olmo_jax.parallel.pipeline.schedule import PIPELINE_SCHEDULES
from olmo_jax.parallel.rules import STRATEGIES


@dataclass(frozen=True)
class ParallelConfig:
    pipe: int = 1
    data: int = -1  # -1 = fill the remaining devices
    expert: int = 1
    # Context parallelism: each sequence's tokens split over this many devices (the mesh's
    # `context` axis) in the zig-zag layout; attention by model.context_attention (ring |
    # allgather; olmo_jax/kernels/ring_attention.py). trainer.seq_len must divide by 2 x it.
    context: int = 1
    strategy: str = "ddp"  # rules.STRATEGIES: ddp (experts resident, tokens travel) | fsdp (baseline)
    # Expert-parallel dispatch with expert > 1 (parallel/expert BACKENDS): rowwise (receive
    # slots sized by model.moe.capacity_factor) | ragged | allgather (both dropless).
    dispatch: str = "rowwise"
    zero1: bool = True  # shard fp32 params + AdamW moments over the data-parallel devices
    # Pipeline (parallel.pipe > 1; olmo_jax/parallel/pipeline):
    pipeline_schedule: str = "1f1b"  # schedule.PIPELINE_SCHEDULES: gpipe | 1f1b | interleaved_1f1b
    microbatches: int = 1  # microbatches per pipeline flush (the batch rows split in order)
    virtual_stages: int = 1  # chunks per stage: interleaved_1f1b needs >= 2 (gpipe: circular)

    def validate(self, prefix: str = "parallel") -> ParallelConfig:
        check_choice(f"{prefix}.strategy", self.strategy, STRATEGIES)
        check_choice(f"{prefix}.dispatch", self.dispatch, BACKENDS)
        check_choice(f"{prefix}.pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        for name in ("context", "microbatches", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name} must be >= 1, got {getattr(self, name)}")
        return self
