"""A run's plan from its compiled step: parameters, FLOPs (formula vs compiled HLO, term by
term), memory per device, collectives per step and the projected step time, as one
`Plan` of numbers (`build`) and its JSON (`Plan.to_json`). planner/plan_text.py renders it
as text; nothing here builds text but the short notes a plan carries.

The program is XLA:GPU's for a GPU device kind wherever the planner could compile for
it (planner/xla_gpu.py), else XLA:CPU's, labelled as the fallback it is (`Plan.compiler`).
The attention core is counted as the GPU runs it (`attention_impl`: model.attention_impl
resolved for the device kind): cuDNN's fused kernel keeps the [T, S] score matrices on
chip, the xla core materializes them. An XLA:GPU program shows which it compiled; of an
XLA:CPU program (always the xla core) the planner subtracts the scores' bytes, from the
HBM traffic and from the peak it compares with the HBM, where the GPU would fuse them.

The step time comes three ways (roofline.Projection): nothing overlapped, as the
compiler scheduled it (the program replayed in its instruction order, planner/overlap.py:
per collective what is asynchronous, what runs between its start and done, and what
stays exposed), and collectives fully overlapped.

Per-token HLO figures are per-device program FLOPs x devices / tokens per step (every
device runs the same program on its share of the batch). In a pipelined step the stages
take different branches of that program: per-device figures are the mean over the stages
(planner/pipeline_cost.py), and the projected step adds the schedule's idle time.
"""

from __future__ import annotations

import dataclasses

from olmo_jax import metrics, targets
from olmo_jax.kernels import platform, select
from olmo_jax.model.moe import sizing
from olmo_jax.parallel.expert import buffer_rows, rowwise_capacity_factor
from olmo_jax.parallel.mesh import batch_shards
from olmo_jax.planner import comms, gpu_hlo, hardware, hlo_cost, memory, overlap, pipeline_cost, roofline
from olmo_jax.planner import optimizer_cost as optimizer_lib
from olmo_jax.planner.compile import CompiledStep
from olmo_jax.trainer import preflight

TERMS = {  # formula term -> label
    "attention_proj": "attention q/k/v/o",
    "attention_scores": "attention scores",
    "router": "router",
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "dense_mlp": "dense MLP",
    "lm_head": "LM head",
}
# The terms that are matmuls against parameters (everything but the attention scores).
PARAM_TERMS = tuple(t for t in TERMS if t != "attention_scores")
PALLAS_GMMS = ("pallas", "pallas_tcgen05")  # the grouped-matmul kernels (declared costs)


@dataclasses.dataclass
class Plan:
    step: CompiledStep
    spec: hardware.DeviceSpec
    label: str  # e.g. "ddp + rowwise"
    formula: dict[str, float]  # FLOPs per token by term
    hlo: dict[str, float]  # dot FLOPs per token by term (+ "other"), recomputation excluded
    recomputed: dict[str, float]  # dot FLOPs per token the backward pass recomputes (remat)
    cost: hlo_cost.ProgramCost
    xla_flops_once: float  # XLA's cost analysis, loop bodies counted once (per device)
    walk_flops_once: float  # this walk, loop bodies counted once
    buffer_factor: float | None  # expected routed-expert buffer rows / routed rows
    buffer_note: str
    colls: list[comms.Collective]
    args: dict[str, int]
    peak_bytes: int
    peak: list[memory.PeakGroup]
    projection: roofline.Projection
    notes: list[str]
    pipeline: pipeline_cost.PipelineCost | None = None  # parallel.pipe > 1
    layer_factor: dict[str, float] = dataclasses.field(default_factory=dict)  # layer_factors
    optimizer: optimizer_lib.OptimizerCost | None = None  # the update's share, per device
    attention_impl: str = "xla"  # the attention core on the device kind (module docstring)
    scores_bytes: int = 0  # of peak_bytes: [T, S] score matrices of the xla core
    scheduled: overlap.Scheduled | None = None  # the step replayed as the compiler scheduled it
    errors: list[str] = dataclasses.field(default_factory=list)  # what the plan must not run

    @property
    def compiler(self) -> str:
        """XLA:GPU, or XLA:CPU: the fallback for a GPU kind (module docstring)."""
        return self.step.compiler

    @property
    def fused_scores(self) -> bool:
        """The compiled program holds score matrices a GPU's fused attention would not."""
        return self.step.compiler == "XLA:CPU" and self.attention_impl == "cudnn"

    @property
    def counted_peak_bytes(self) -> int:
        """The peak the HBM is compared with: without score matrices the GPU fuses."""
        return self.peak_bytes - (self.scores_bytes if self.fused_scores else 0)

    @property
    def memory_limit(self) -> tuple[float, str]:
        """(bytes per device the step must fit in, where that number comes from):
        trainer.memory_limit_gb (GiB, as the trainer's preflight reads it) when > 0, else
        the device kind's HBM (0: unknown, no verdict)."""
        t = self.step.cfg.trainer
        if t.memory_limit_gb > 0:
            return t.memory_limit_gb * 2**30, f"trainer.memory_limit_gb={t.memory_limit_gb:g}"
        return self.spec.hbm_bytes, (f"{self.spec.kind.upper()} HBM" if self.spec.hbm_bytes else "")

    @property
    def fits(self) -> bool | None:
        """The peak the HBM is compared with fits the memory limit (None: no limit, or no
        live-range report, known)."""
        limit = self.memory_limit[0]
        return self.counted_peak_bytes <= limit if limit and self.peak_bytes else None

    @property
    def allocated_bytes(self) -> int:
        """What XLA allocates per device for the step (trainer/preflight.py's estimate)."""
        return preflight.MemoryEstimate.of(self.step.compiled).total

    @property
    def matmul_ratio(self) -> float:
        """HLO / formula for the parameter matmuls, the routed experts' buffer padding and
        a pipeline's padding layers taken out (the number that should be 1)."""
        expect = {t: self.layer_factor.get(t, 1.0) for t in PARAM_TERMS}
        expect["routed_experts"] *= self.buffer_factor or 1.0
        hlo = sum(self.hlo.get(t, 0.0) / expect[t] for t in PARAM_TERMS)
        return hlo / sum(self.formula[t] for t in PARAM_TERMS)

    def to_json(self) -> dict:
        s, p = self.step, self.projection
        mem = s.compiled.memory_analysis()
        return {
            "label": self.label, "devices": s.n_devices, "mesh": dict(s.plan.mesh.shape),
            "batch_size": s.batch_size, "grad_accum": s.grad_accum,
            "tokens_per_step": s.tokens_per_step,
            "device_kind": self.spec.kind, "params": metrics.param_counts(s.model_cfg),
            "flops_per_token_formula": self.formula, "flops_per_token_hlo": self.hlo,
            "flops_per_token_recomputed": self.recomputed,
            "matmul_ratio": self.matmul_ratio, "buffer_factor": self.buffer_factor,
            "layer_factor": self.layer_factor,
            "xla_flops_once": self.xla_flops_once, "walk_flops_once": self.walk_flops_once,
            "argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "argument_parts": self.args, "peak_bytes": self.peak_bytes,
            "peak_bytes_counted": self.counted_peak_bytes, "scores_bytes": self.scores_bytes,
            "memory_limit_bytes": self.memory_limit[0], "fits": self.fits,
            "allocated_bytes": self.allocated_bytes,
            "compiler": self.compiler, "attention_impl": self.attention_impl,
            "matmul_efficiency": self.spec.matmul_efficiency,
            "link_efficiency": self.spec.link_efficiency,
            "peak": [dataclasses.asdict(g) for g in self.peak[:8]],
            "collectives": comms.summary(self.colls),
            "collective_bytes": comms.total_bytes(self.colls),
            "collective_jax_bytes": sum(c.jax_bytes_per_run for c in self.colls),
            "compute_s": p.compute_s, "roofline_s": p.roofline_s, "link_s": p.link_s,
            "hbm_bytes": p.hbm_bytes, "step_s": p.step_s, "overlapped_s": p.overlapped_s,
            "tokens_per_s_per_device": p.tokens_per_s(), "mfu": p.mfu(),
            "tokens_per_s_per_device_overlapped": p.tokens_per_s(True),
            "mfu_overlapped": p.mfu(True), "scheduled_s": p.scheduled_s,
            "tokens_per_s_per_device_scheduled": p.tokens_per_s(overlap="scheduled"),
            "mfu_scheduled": p.mfu(overlap="scheduled"),
            "overlap": self.scheduled.to_json() if self.scheduled is not None else None,
            "lower_s": s.lower_s, "compile_s": s.compile_s,
            "notes": self.notes, "errors": self.errors,
            "pipeline": self.pipeline.to_json() if self.pipeline is not None else None,
            "optimizer": self.optimizer.to_json() if self.optimizer is not None else None,
        }


def expert_buffer_factor(step: CompiledStep) -> tuple[float | None, str]:
    """Rows the compiled expert matmuls run over, per routed (token, choice) row, from the
    dispatcher's own sizing functions, and what sets it."""
    m, plan, t = step.model_cfg.moe, step.plan, step.cfg.trainer
    S = step.batch_size // (step.grad_accum * plan.microbatches) // batch_shards(plan.mesh) * t.seq_len
    E, N = m.num_experts, S * m.top_k
    ep = plan.mesh.shape["expert"]
    impl = plan.kernels.gmm  # model.moe.gmm_impl as the plan resolved it
    if not step.model_cfg.n_moe_layers:
        return None, "no MoE layers"
    rows = buffer_rows(plan.dispatch, S, m, plan.kernels.run_padding, ep)  # the dispatcher's sizing
    if plan.dispatch == "rowwise":
        cf = rowwise_capacity_factor(m.capacity_factor)
        return rows / N, f"rowwise receive slots (capacity factor {cf})"
    if impl in PALLAS_GMMS and (plan.dispatch in ("ragged", "allgather") or m.capacity_factor <= 0):
        # Runs buffers: the kernels skip the row tiles past the routed rows and declare
        # their cost over the rows routed at balanced routing (buffer.Runs.balanced_rows).
        return 1.0, (f"gmm_impl={impl}: the kernels declare their cost over the rows routed "
                     f"at balanced routing, not the {rows / N:.3f}x rows of the {plan.dispatch} "
                     "buffer, sized for any routing (the kernels skip its unrouted row tiles)")
    if plan.dispatch in ("ragged", "allgather"):
        if impl != "einsum":
            return None, f"{plan.dispatch} buffers sized for the worst case ({impl})"
        return rows / N, (f"{plan.dispatch} receive buffer sized for the worst case (every "
                          f"assignment of the {ep} senders to one rank)")
    if m.capacity_factor > 0:
        return rows / N, f"capacity buffers (model.moe.capacity_factor={m.capacity_factor})"
    if impl == "einsum":
        return (rows / N, f"blocked dropless layout, blocks of {sizing.block_size(N, E)} rows, "
                          "sized for the worst padding")
    if impl == "tiled":
        return None, ("gmm_impl=tiled: per-expert GEMM loops whose trip counts are the routing's "
                      "(at most 7 padding rows per expert); the HLO counts each loop body once")
    if impl == "blas":
        return None, "gmm_impl=blas: one BLAS SGEMM per expert over its routed rows (an FFI call)"
    return None, f"gmm_impl={impl} (on CPU ragged_dot expands to a dense product over experts)"


def layer_factors(step: CompiledStep) -> dict[str, float]:
    """Compiled / formula factors of the layer terms from a pipeline's padding layers: its
    K chunks run c layer slots each, K x c >= the MoE blocks (the extra slots are masked
    identity layers, computed and discarded). Empty without padding."""
    p, c = step.plan.pipeline, step.model_cfg
    if p is None or p.chunks.chunks * p.chunks.slots == c.n_moe_layers:
        return {}
    slots = p.chunks.chunks * p.chunks.slots
    moe = slots / c.n_moe_layers
    attention = (c.n_dense_layers + slots) / c.n_layers
    return {"attention_proj": attention, "attention_scores": attention, "router": moe,
            "routed_experts": moe, "shared_experts": moe}


def attention_impl(step: CompiledStep, kind: str) -> str:
    """The attention core on device kind `kind`: what an XLA:GPU program compiled (cuDNN's
    custom calls or not); for a CPU, what its program runs (the blas FFI kernel or not);
    else (a GPU kind planned on XLA:CPU) model.attention_impl resolved for that GPU by the
    kernel table (olmo_jax/kernels/select.py)."""
    if step.gpu_kind is not None:
        return "cudnn" if gpu_hlo.cudnn_attention(step.module) else "xla"
    if kind not in targets.KINDS:
        return "blas" if cpu_attention_kernel(step) else "xla"
    g = targets.spec(kind)
    target = platform.Target("gpu", g.capability, g.num_sms, abstract=True)
    return select.resolve_attention_impl(step.model_cfg.attention_impl, target,
                                         step.model_cfg.compute_dtype)


def cpu_attention_kernel(step: CompiledStep) -> bool:
    """The program runs the CPU attention FFI kernel (attention_impl=blas)."""
    return any(gpu_hlo.call_target(i) in gpu_hlo.CPU_ATTENTION for i in step.module.instructions)


def scores_bytes(peak: list[memory.PeakGroup]) -> int:
    return sum(g.bytes for g in peak if g.label.startswith("attention_scores"))


def dense_group_errors(step: CompiledStep, hlo: dict[str, float], formula: dict[str, float],
                       factor: float | None, per_token: float) -> list[str]:
    """The plan's error for routed-expert matmuls the compiler lowered as a dense product
    over the expert groups (gpu_hlo.dense_grouped_dots: read from the compiled HLO, not
    from the config), with what they cost against the rows' own FLOPs."""
    dense = gpu_hlo.dense_grouped_dots(step.module)
    if not dense:
        return []
    flops = sum(d.flops * d.count for d in dense) * per_token
    runs = sum(d.count for d in dense)
    times = ""
    if formula["routed_experts"]:
        x = hlo["routed_experts"] / formula["routed_experts"] / (factor or 1.0)
        if x < 1.5:  # one local expert: a product over its one group is the grouped GEMM
            return []
        times = f"; the routed experts' matmuls run x{x:.1f} their rows' FLOPs"
    return [f"{step.compiler} compiled jax.lax.ragged_dot (model.moe.gmm_impl="
            f"{step.plan.kernels.gmm}) as a dense product over the expert groups: "
            f"{len(dense)} dot(s), {runs:,.0f} runs a step, {flops / 1e9:,.3f} GFLOP/token, "
            f"every row against every local expert's weights{times}. Set "
            "model.moe.gmm_impl=auto (the kernel table never picks ragged_dot on a GPU) "
            "or einsum"]


def build(step: CompiledStep, spec: hardware.DeviceSpec, label: str = "",
          notes: list[str] | None = None) -> Plan:
    n, tokens = step.n_devices, step.tokens_per_step
    per_token = n / tokens
    cost = hlo_cost.program_cost(step.module)
    formula = metrics.flops_per_token_parts(step.model_cfg, step.cfg.trainer.seq_len)
    def by_term(flops: dict[str, float]) -> dict[str, float]:
        out = {hlo_cost.SCOPE_TERM.get(k, k): v * per_token for k, v in flops.items()}
        return {t: out.get(t, 0.0) for t in (*TERMS, hlo_cost.OTHER)}

    recomputed = by_term(cost.recomputed_dot_flops)
    hlo = {t: v - recomputed[t] for t, v in by_term(cost.dot_flops).items()}
    ca = step.compiled.cost_analysis()  # None from a deviceless XLA:GPU compile
    ca = (ca[0] if isinstance(ca, list) else ca) or {}
    factor, note = expert_buffer_factor(step)
    colls = [c for c in comms.collectives(step.module) if c.group_size > 1]  # 1: no traffic
    dtype, mesh = step.cfg.model.dtype, dict(step.plan.mesh.shape)
    model_flops = metrics.flops_per_token(step.model_cfg, step.cfg.trainer.seq_len) * tokens / n
    impl = attention_impl(step, spec.kind)
    accounting = roofline.Accounting.for_program(step.gpu_kind is not None, impl == "cudnn")
    pipe = None
    if step.plan.pipeline is not None:
        pipe = pipeline_cost.cost(step.module, step.plan.pipeline.schedule, step.plan.grad_accum,
                                  spec, dtype, mesh, accounting)
    scheduled = overlap.simulate(step.module, cost.ops, spec, dtype, mesh, accounting)
    proj = roofline.project(cost.ops, roofline.link_uses(colls), spec, dtype, mesh, tokens / n,
                            model_flops, pipe.bubble_s if pipe else 0.0,
                            pipe.bubble_overlapped_s if pipe else 0.0, accounting,
                            scheduled.step_s, pipe.bubble_scheduled_s if pipe else 0.0)
    shapes = memory.param_shapes(step.state.params, step.plan)
    peak_bytes, peak = memory.peak_groups(step.live_range, step.module, shapes,
                                          step.buffer_assignment)
    notes = list(notes or [])
    errors = dense_group_errors(step, hlo, formula, factor, per_token)
    if uncounted := gpu_hlo.uncounted_kernels(step.module):
        notes.append(f"{len(uncounted)} Mosaic GPU kernel call(s) declare no cost estimate: "
                     "their FLOPs are not in the compiled counts or the roofline")
    return Plan(step, spec, label or f"{step.plan.strategy} + {step.plan.dispatch}", formula,
                hlo, recomputed, cost, float(ca.get("flops", 0.0)),
                hlo_cost.program_cost(step.module, loops_once=True).flops, factor, note, colls,
                memory.argument_bytes(step.state, step.shardings, step.batch), peak_bytes, peak,
                proj, notes, pipe, layer_factors(step),
                optimizer_lib.optimizer_cost(step, cost, colls, spec, accounting), impl,
                0 if step.gpu_kind is not None and impl == "cudnn" else scores_bytes(peak),
                scheduled, errors)
