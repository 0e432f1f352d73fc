"""Per-device figures of a pipelined run, extrapolated from the plan of the same config
compiled with its pipeline axis folded into `data` (used while the trainer's step cannot run
pipeline stages). Everything here is arithmetic on the compiled plan, labeled as such.

With `pipe` stages each device runs 1/pipe of the blocks on pipe x the tokens, so:
  unchanged   FLOPs per device, the per-operation roofline (same work per device), the
              MoE all-to-alls (same token-layers per device), stored parameters and
              optimizer state per device (ZeRO-1 over pipe x fewer data ranks, 1/pipe of
              the blocks), activations held (1F1B keeps up to `pipe` microbatches of the
              stage's 1/pipe of the blocks)
  1/pipe      parameter gathers and gradient reductions over `data` (1/pipe of the weights,
              groups pipe x smaller) and the float32 weights gathered for compute
  added       stage-to-stage activations and their gradients (bf16 [tokens, d_model] each
              way per step, over the network), and the 1F1B bubble, (pipe - 1) / m of the
              step with m microbatches per step (not interleaved)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from olmo_jax.planner import roofline
from olmo_jax.planner.hardware import DeviceSpec

PARAMETER_TRAFFIC = ("zero_gather", "zero_reduce", "fsdp_gather")


@dataclasses.dataclass(frozen=True)
class PipelineEstimate:
    pipe: int
    mesh: dict[str, int]
    projection: roofline.Projection  # before the bubble
    p2p_bytes: float  # per device per step
    microbatches: int  # per step per pipeline (one sequence each)
    bubble: float  # fraction of the step idle in a plain 1F1B schedule
    peak_bytes: float
    weight_bytes: float  # float32 weights gathered for compute, per device


def estimate(plan, pipe: int, spec: DeviceSpec) -> PipelineEstimate:
    """`plan`: a report.Plan of the config compiled with pipe folded into data."""
    step = plan.step
    mesh = dict(step.plan.mesh.shape)
    mesh = {"pipe": pipe, "data": mesh["data"] // pipe, "expert": mesh["expert"]}
    links = []
    for c in plan.colls:
        size, group = c.jax_bytes, c.group_size
        if c.purpose in PARAMETER_TRAFFIC and "data" in c.axes:
            size, group = size / pipe, group // pipe
        links.append(roofline.LinkUse(c.kind, size, c.count, group, c.axes))
    t, d = step.cfg.trainer, step.model_cfg.d_model
    ranks = mesh["data"] * mesh["expert"]
    stage_tokens = t.global_batch_size * t.seq_len / ranks
    p2p = 2 * stage_tokens * d * np.dtype(step.model_cfg.compute_dtype).itemsize
    links.append(roofline.LinkUse("collective-permute", p2p, 1, 2, ("pipe",)))
    base = plan.projection
    proj = roofline.project(plan.cost.ops, links, spec, step.cfg.model.dtype, mesh,
                            base.tokens_per_device, base.model_flops_per_device)
    microbatches = max(1, t.global_batch_size // ranks)
    weights = sum(g.bytes for g in plan.peak if "weight copies" in g.label)
    return PipelineEstimate(pipe, mesh, proj, p2p, microbatches, (pipe - 1) / microbatches,
                            plan.peak_bytes - weights * (1 - 1 / pipe), weights / pipe)


def format_estimate(e: PipelineEstimate) -> str:
    p = e.projection
    mesh = " x ".join(f"{k}={v}" for k, v in e.mesh.items())
    with_bubble = p.step_s * (1 + e.bubble)
    return "\n".join([
        f"EXTRAPOLATED to the configured pipeline (mesh {mesh}; arithmetic on the plan above, "
        "not a compiled program; olmo_jax/planner/extrapolate.py)",
        f"  live at the peak   ~{e.peak_bytes / 1e9:,.1f} GB per device (the weight-shaped "
        f"buffers 1/{e.pipe})",
        f"  collectives        {p.links_s:8.3f} s   NVLink {p.link_s['nvlink']:.3f} s, network "
        f"{p.link_s['network']:.3f} s (parameter traffic 1/{e.pipe}; stage-to-stage "
        f"activations {e.p2p_bytes / 1e9:,.2f} GB/step)",
        f"  step               {p.step_s:8.3f} s   nothing overlapped, no bubble: "
        f"{p.tokens_per_s():,.0f} tokens/s/device, MFU {p.mfu():.1%}",
        f"                     {p.overlapped_s:8.3f} s   collectives fully overlapped: "
        f"{p.tokens_per_s(True):,.0f} tokens/s/device, MFU {p.mfu(True):.1%}",
        f"  1F1B bubble        {e.bubble:8.1%}     of a step with {e.microbatches} microbatches "
        f"per pipeline (one sequence each): {p.tokens_per_device / with_bubble:,.0f} "
        f"tokens/s/device, MFU {p.model_flops_per_device / with_bubble / p.peak_flops:.1%} "
        "(interleaving v chunks per stage divides it by v)",
    ])
