"""Projected step time of a compiled program on a device kind: a roofline per operation
plus the collectives on the links, and the tokens/s and MFU that follow.

  compute    sum over operations of dot FLOPs / matmul FLOP/s (the peak x the device's
             measured matmul efficiency, hardware.py; the router's float32 dots at the
             float32 peak's, every other dot at the compute dtype's)
  roofline   sum over operations of max(dot FLOPs / matmul FLOP/s, bytes / HBM
             bandwidth): each operation is bound by its arithmetic or by its memory traffic
  links      sum over collectives of bus bytes / (link bandwidth x link efficiency)
             (hardware.link_seconds), one after another
  step       roofline + links (nothing overlapped: an upper bound on the step time);
             `overlapped` = max(roofline, links) is the lower bound; `scheduled` lies
             between them: the program replayed in the compiler's schedule, each
             asynchronous collective hidden by at most the compute scheduled between its
             start and done (planner/overlap.py); a pipelined step adds to each the time
             its stages idle in the schedule (planner/pipeline_cost.py)
  MFU        model FLOPs per device (OLMo-core's formula) / step time / datasheet peak

Which bytes the HBM term counts (`Accounting`): of an XLA:GPU program every operation's
but the collectives' (their bytes are on the links). Of an XLA:CPU program (the fallback)
neither the converts and layout copies XLA:CPU inserts around its matmuls (bf16 widened to
f32; no op_name: not the JAX program's) nor, where the GPU would run cuDNN's fused
attention (model.attention_impl, resolved for the GPU), the attention core's [T, S] score
matrices, which that kernel keeps on chip (its FLOPs stay).
"""

from __future__ import annotations

import dataclasses

from olmo_jax.planner.hardware import DeviceSpec, intra_node, link_seconds
from olmo_jax.planner.hlo_cost import OpCost

OVERLAPS = ("none", "scheduled", "full")  # nothing overlapped, as scheduled, fully overlapped
ON_CHIP_SCOPES = ("attention_scores",)  # fused on a GPU: no HBM traffic of their own
FLOAT32_SCOPES = ("router", "optimizer")  # float32 dots whatever model.dtype


@dataclasses.dataclass(frozen=True)
class Accounting:
    """Which bytes of a compiled program the HBM term counts (module docstring)."""

    on_chip_scopes: tuple[str, ...] = ()  # scopes whose bytes a GPU kernel keeps on chip
    backend_copies: bool = True  # count the converts / copies the compiler inserted

    @classmethod
    def for_program(cls, gpu_program: bool, fused_attention: bool) -> Accounting:
        """XLA:GPU's program as it is; XLA:CPU's without its own converts and, where the
        GPU runs fused attention, without the score matrices."""
        if gpu_program:
            return cls()
        return cls(ON_CHIP_SCOPES if fused_attention else (), backend_copies=False)


XLA_CPU_AS_GPU = Accounting.for_program(gpu_program=False, fused_attention=True)


@dataclasses.dataclass(frozen=True)
class LinkUse:
    """One collective of the compiled program, as the roofline sees it."""

    kind: str
    bytes: float  # per execution, per device (at the JAX program's dtype)
    count: int | float
    group_size: int
    axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Projection:
    compute_s: float
    roofline_s: float
    hbm_bytes: float  # per step per device, as counted by the roofline
    link_s: dict[str, float]  # seconds per link class ("nvlink", "network")
    tokens_per_device: float  # per step
    model_flops_per_device: float  # per step, OLMo-core's formula
    peak_flops: float  # of the compute dtype
    bubble_s: float = 0.0  # pipeline: idle time in the schedule (nothing overlapped)
    bubble_overlapped_s: float = 0.0  # the same with collectives overlapped
    replayed_s: float | None = None  # the program replayed as scheduled (overlap.simulate)
    bubble_scheduled_s: float = 0.0  # pipeline: idle time with each op as scheduled

    @property
    def links_s(self) -> float:
        return sum(self.link_s.values())

    @property
    def step_s(self) -> float:
        return self.roofline_s + self.links_s + self.bubble_s

    @property
    def overlapped_s(self) -> float:
        return max(self.roofline_s, self.links_s) + self.bubble_overlapped_s

    @property
    def scheduled_s(self) -> float:
        """As the compiler scheduled it (nothing overlapped where no replay was made)."""
        if self.replayed_s is None:
            return self.step_s
        return self.replayed_s + self.bubble_scheduled_s

    def seconds(self, overlap: str = "none") -> float:
        """The step: overlap "none" | "scheduled" | "full" (OVERLAPS)."""
        return {"none": self.step_s, "scheduled": self.scheduled_s,
                "full": self.overlapped_s}[overlap]

    def tokens_per_s(self, overlapped: bool = False, overlap: str | None = None) -> float:
        return self.tokens_per_device / self.seconds(overlap or ("full" if overlapped else "none"))

    def mfu(self, overlapped: bool = False, overlap: str | None = None) -> float:
        step = self.seconds(overlap or ("full" if overlapped else "none"))
        return self.model_flops_per_device / step / self.peak_flops


def op_seconds(op: OpCost, spec: DeviceSpec, dtype: str,
               accounting: Accounting = XLA_CPU_AS_GPU) -> tuple[float, float]:
    """(compute, roofline) seconds of one execution of an operation."""
    flops = spec.matmul_flops("float32" if op.scope in FLOAT32_SCOPES else dtype)
    compute = op.dot_flops / flops
    return compute, max(compute, hbm_bytes(op, accounting) / spec.hbm_bw)


def hbm_bytes(op: OpCost, accounting: Accounting = XLA_CPU_AS_GPU) -> float:
    """The bytes the HBM term counts for one execution (see the module docstring)."""
    if (op.collective or (op.backend_inserted and not accounting.backend_copies)
            or op.scope in accounting.on_chip_scopes):
        return 0.0
    return op.bytes


def link_uses(colls) -> list[LinkUse]:
    """The collectives (comms.Collective) that move data: a group of one sends nothing."""
    return [LinkUse(c.kind, c.jax_bytes, c.count, c.group_size, c.axes)
            for c in colls if c.group_size > 1]


def project(ops: list[OpCost], links: list[LinkUse], spec: DeviceSpec, dtype: str,
            mesh_shape: dict[str, int], tokens_per_device: float,
            model_flops_per_device: float, bubble_s: float = 0.0,
            bubble_overlapped_s: float = 0.0,
            accounting: Accounting = XLA_CPU_AS_GPU, replayed_s: float | None = None,
            bubble_scheduled_s: float = 0.0) -> Projection:
    compute = roofline = hbm = 0.0
    for op in ops:
        c, r = op_seconds(op, spec, dtype, accounting)
        compute += op.count * c
        roofline += op.count * r
        hbm += op.count * hbm_bytes(op, accounting)
    link_s = {"nvlink": 0.0, "network": 0.0}
    for c in links:
        intra = intra_node(mesh_shape, c.axes, c.group_size, spec)
        link_s["nvlink" if intra else "network"] += c.count * link_seconds(
            c.kind, c.bytes, c.group_size, intra, spec)
    return Projection(compute, roofline, hbm, link_s, tokens_per_device,
                      model_flops_per_device, spec.peak(dtype), bubble_s, bubble_overlapped_s,
                      replayed_s, bubble_scheduled_s)
