"""The optimizer's share of a compiled step, per device: its stored state, the update's
FLOPs, HBM bytes and roofline time (every operation under the train step's "optimizer"
scope: AdamW's elementwise update, Muon's Newton-Schulz), and the collectives it adds
(Muon under ZeRO-1: matrices to their owners and the results back, parallel/muon_owners.py),
next to what the ownership plan predicts (Newton-Schulz FLOPs, matrices per rank)."""

from __future__ import annotations

import dataclasses

from olmo_jax.parallel import zero
from olmo_jax.planner import comms, hardware, roofline
from olmo_jax.planner.hlo_cost import ProgramCost

SCOPE = "optimizer"  # trainer/step.py
COLLECTIVE_SCOPES = ("muon_gather", "muon_return")


@dataclasses.dataclass(frozen=True)
class OptimizerCost:
    name: str  # optim.name
    state_bytes: int  # the optimizer state one device stores
    dot_flops: float  # per step (Newton-Schulz matmuls)
    other_flops: float  # elementwise and reductions
    hbm_bytes: float
    compute_s: float  # roofline of the update's operations (float32 peak for dots)
    link_s: float  # its collectives, one after another
    collective_bytes: float  # per step, per device
    colls: tuple[comms.Collective, ...]
    ns_flops_planned: int  # the ownership plan's Newton-Schulz FLOPs per device (0: AdamW)
    matrices_per_rank: dict  # data-parallel axes -> matrices each rank orthogonalizes

    @property
    def step_s(self) -> float:
        return self.compute_s + self.link_s

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["colls"] = comms.summary(list(self.colls))
        d["matrices_per_rank"] = {",".join(k) or "none": v for k, v in self.matrices_per_rank.items()}
        return d


def optimizer_cost(step, cost: ProgramCost, colls, spec: hardware.DeviceSpec,
                   accounting: roofline.Accounting = roofline.XLA_CPU_AS_GPU) -> OptimizerCost:
    """`step`: a planner CompiledStep; `cost`: its program_cost; `colls`: its collectives;
    `accounting`: which bytes the roofline counts (roofline.Accounting)."""
    ops = [op for op in cost.ops if op.scope == SCOPE]
    compute = sum(op.count * roofline.op_seconds(op, spec, "float32", accounting)[1]
                  for op in ops)
    mine = tuple(c for c in colls if c.purpose in COLLECTIVE_SCOPES)
    mesh = dict(step.plan.mesh.shape)
    link = 0.0
    for c in mine:
        intra = hardware.intra_node(mesh, c.axes, c.group_size, spec)
        link += c.count * hardware.link_seconds(c.kind, c.jax_bytes, c.group_size, intra, spec)
    own, o = step.plan.muon, step.cfg.optim
    return OptimizerCost(
        o.name, zero.per_device_bytes(step.state.opt_state, step.shardings.opt_state),
        cost.dot_flops.get(SCOPE, 0.0), cost.other_flops.get(SCOPE, 0.0),
        sum(op.count * roofline.hbm_bytes(op, accounting) for op in ops), compute, link,
        float(sum(c.jax_bytes_per_run for c in mine)), mine,
        own.ns_flops_per_device(o.muon_ns_steps) if own is not None else 0,
        own.matrices_per_rank() if own is not None else {})
