"""A run's plan from its compiled step: parameters, FLOPs (formula vs compiled HLO, term by
term), memory per device, collectives per step and the projected step time, as one
`Plan` (numbers) and its text rendering; and several plans side by side.

The program is XLA:GPU's for a GPU device kind wherever the planner could compile for
it (planner/xla_gpu.py), else XLA:CPU's, labelled as the fallback it is (`Plan.compiler`).
The attention core is counted as the GPU runs it (`attention_impl`: model.attention_impl
resolved for the device kind): cuDNN's fused kernel keeps the [T, S] score matrices on
chip, the xla core materializes them. An XLA:GPU program shows which it compiled; of an
XLA:CPU program (always the xla core) the planner subtracts the scores' bytes, from the
HBM traffic and from the peak it compares with the HBM, where the GPU would fuse them.

The step time comes three ways (roofline.Projection): nothing overlapped, as the
compiler scheduled it (the program replayed in its instruction order, planner/overlap.py,
with its own "Overlap" section: per collective what is asynchronous, what runs between
its start and done, and what stays exposed), and collectives fully overlapped.

Per-token HLO figures are per-device program FLOPs x devices / tokens per step (every
device runs the same program on its share of the batch). In a pipelined step the stages
take different branches of that program: per-device figures are the mean over the stages
(planner/pipeline_cost.py), and the projected step adds the schedule's idle time.
"""

from __future__ import annotations

import dataclasses

from olmo_jax import metrics, targets
from olmo_jax.kernels import platform, select
from olmo_jax.model.attention import query_chunks
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

# What the reference measured (OLMo-core 3, docs/reference.md), keyed by the model's shape
# (d_model, n_layers, num_experts, top_k, seq_len).
REFERENCE = {
    (4096, 8, 128, 4, 8192): ("47B on 8 B300 with EP8", "b300", 52e3, None),
    (6144, 63, 128, 4, 8192): ("1.2T on 512 GPUs with EP8 x PP8", "b300", None, 858e12),
}


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
            "device_kind": self.spec.kind, "params": metrics.param_counts(s.model_cfg),
            "flops_per_token_formula": self.formula, "flops_per_token_hlo": self.hlo,
            "flops_per_token_recomputed": self.recomputed,
            "matmul_ratio": self.matmul_ratio, "buffer_factor": self.buffer_factor,
            "layer_factor": self.layer_factor,
            "xla_flops_once": self.xla_flops_once, "walk_flops_once": self.walk_flops_once,
            "argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "argument_parts": self.args, "peak_bytes": self.peak_bytes,
            "peak_bytes_counted": self.counted_peak_bytes, "scores_bytes": self.scores_bytes,
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
            "notes": self.notes,
            "pipeline": self.pipeline.to_json() if self.pipeline is not None else None,
            "optimizer": self.optimizer.to_json() if self.optimizer is not None else None,
        }


def tokens_per_step(step: CompiledStep) -> int:
    t = step.cfg.trainer
    return t.global_batch_size * t.seq_len


def expert_buffer_factor(step: CompiledStep) -> tuple[float | None, str]:
    """Rows the compiled expert matmuls run over, per routed (token, choice) row, from the
    dispatcher's own sizing functions, and what sets it."""
    m, plan, t = step.model_cfg.moe, step.plan, step.cfg.trainer
    S = t.global_batch_size // (t.grad_accum * plan.microbatches) // batch_shards(plan.mesh) * t.seq_len
    E, N = m.num_experts, S * m.top_k
    ep = plan.mesh.shape["expert"]
    impl = plan.kernels.gmm  # model.moe.gmm_impl as the plan resolved it
    if not step.model_cfg.n_moe_layers:
        return None, "no MoE layers"
    rows = buffer_rows(plan.dispatch, S, m, plan.kernels.run_padding, ep)  # the dispatcher's sizing
    if plan.dispatch == "rowwise":
        cf = rowwise_capacity_factor(m.capacity_factor)
        return rows / N, f"rowwise receive slots (capacity factor {cf})"
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


def build(step: CompiledStep, spec: hardware.DeviceSpec, label: str = "",
          notes: list[str] | None = None) -> Plan:
    n, tokens = step.n_devices, tokens_per_step(step)
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
    if (step.gpu_kind is not None and step.plan.kernels.gmm == "ragged_dot" and formula["routed_experts"]
            and (x := hlo["routed_experts"] / formula["routed_experts"] / (factor or 1.0)) > 1.5):
        notes.append(f"XLA:GPU compiles jax.lax.ragged_dot (model.moe.gmm_impl="
                     f"{step.model_cfg.moe.gmm_impl} resolves to ragged_dot here) as a dense "
                     f"masked product over the expert groups: the routed experts' matmuls run "
                     f"x{x:.1f} their rows' FLOPs; --config.model.moe.gmm_impl=einsum runs "
                     "batched / blocked GEMMs instead")
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
                scheduled)


# ---- text ------------------------------------------------------------------------------

def _g(x: float, unit: float = 1e9) -> str:
    return f"{x / unit:,.3f}"


def _secs(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x >= 1e-3 else f"{x * 1e6:,.1f} us"


def _runs(x: float) -> str:
    """An execution count: whole, or to 2 decimals (a mean over pipeline stages)."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.2f}"


def _bytes(x: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"


def _reference(plan: Plan) -> str | None:
    c, t = plan.step.model_cfg, plan.step.cfg.trainer
    ref = REFERENCE.get((c.d_model, c.n_layers, c.moe.num_experts, c.moe.top_k, t.seq_len))
    if ref is None:
        return None
    what, kind, tok_s, tflops = ref
    peak = hardware.DEVICES[kind].peak("bfloat16")
    fpt = metrics.flops_per_token(c, t.seq_len)
    if tok_s is None:
        tok_s = tflops / fpt
    achieved = tok_s * fpt
    line = (f"  reference   OLMo-core measured {what}: {tok_s / 1e3:,.1f}k tokens/s/GPU = "
            f"{achieved / 1e12:,.0f} TFLOP/s = {achieved / peak:.0%} MFU of a {kind.upper()}")
    if plan.spec.kind == kind:
        p = plan.projection
        line += (f"; this projection is {p.tokens_per_s() / tok_s:.2f}x that (no overlap), "
                 f"{p.tokens_per_s(overlap='scheduled') / tok_s:.2f}x (as scheduled), "
                 f"{p.tokens_per_s(True) / tok_s:.2f}x (fully overlapped)")
    return line


def _scores_note(plan: Plan, seq: int) -> str:
    """Why the compiled score FLOPs differ: the formula counts the causal triangle,
    s(s+1)/2 of the s^2 entries, and 6 score matmuls (2 forward, 4 backward)."""
    if plan.step.gpu_kind is not None and plan.attention_impl == "cudnn":
        return ("cuDNN fused attention (gpu_hlo.custom_call_dot_flops): the causal triangle, "
                "2 GEMMs forward, 5 in the flash backward (QK^T recomputed from the saved "
                "log-sum-exp): x1.17")
    if cpu_attention_kernel(plan.step):
        from olmo_jax.kernels import cpu_attention

        frac = cpu_attention.computed_fraction(seq)
        return (f"(entries computed / causal) x (matmuls / 6): the CPU kernel's "
                f"{cpu_attention.BLOCK}-row query blocks skip the blocks above the diagonal "
                f"(x{frac * 2 * seq / (seq + 1):.2f}); the backward recomputes QK^T from the saved "
                "log-sum-exp (7 matmuls: x1.17)")
    n = query_chunks(seq)  # chunk i computes keys up to its end: (n + 1) / 2n of s^2
    blocks = (f"{n} query chunks skip the blocks above the diagonal, the rest is computed"
              if n > 1 else "masked entries above the diagonal are computed")
    note = (f"(entries computed / causal) x (matmuls / 6): {blocks} "
            f"(x{(n + 1) * seq / (n * (seq + 1)):.2f}); the backward recomputes "
            "QK^T from the saved log-sum-exp (7 matmuls: x1.17)")
    if plan.step.cfg.model.remat != "none":
        note += (f"; model.remat={plan.step.cfg.model.remat} reruns the forward's where XLA:CPU's "
                 "rewrite dropped their op_names")
    return note


def _flops_section(plan: Plan) -> list[str]:
    ft, ht = sum(plan.formula.values()), sum(plan.hlo.values())
    rt = sum(plan.recomputed.values())
    unit, name = (1e9, "GFLOP") if ft >= 1e9 else (1e6, "MFLOP")
    lines = [f"FLOPs per token, training (forward + backward), {name}",
             f"  {'term':<20} {'formula':>9} {'compiled':>9} {'ratio':>7}  why they differ"]
    seq = plan.step.cfg.trainer.seq_len
    why = {
        "attention_scores": _scores_note(plan, seq),
        "routed_experts": f"expert buffers hold padding: {plan.buffer_note}"
                          + (f", {plan.buffer_factor:.3f}x the routed rows"
                             if plan.buffer_factor else ""),
    }
    if plan.layer_factor:
        ch = plan.step.plan.pipeline.chunks
        pad = (f"pipeline padding layers: {ch.chunks} chunks x {ch.slots} slots for "
               f"{ch.n_layers} MoE blocks")
        for term, f in plan.layer_factor.items():
            why[term] = "; ".join(w for w in (f"{pad}: x{f:.3f}", why.get(term)) if w)
    for term, label in TERMS.items():
        f, h = plan.formula[term], plan.hlo[term]
        ratio = f"{h / f:7.3f}" if f else f"{'-':>7}"
        lines.append(f"  {label:<20} {_g(f, unit):>9} {_g(h, unit):>9} {ratio}  "
                     f"{why.get(term, '')}".rstrip())
    other = plan.hlo[hlo_cost.OTHER]
    lines.append(f"  {'other dots':<20} {_g(0):>9} {_g(other, unit):>9}"
                 + (f" {'':>7}  outside the model's scopes" if other else ""))
    lines.append(f"  {'total':<20} {_g(ft, unit):>9} {_g(ht, unit):>9} {ht / ft:7.3f}")
    if rt:
        lines.append(f"  {'+ recomputed':<20} {'':>9} {_g(rt, unit):>9} {'':>7}  "
                     f"model.remat={plan.step.cfg.model.remat}: the backward pass reruns parts "
                     "of the forward (not model FLOPs; not in the rows above)")
    per_token = plan.step.n_devices / tokens_per_step(plan.step)
    ew = sum(plan.cost.other_flops.values()) * per_token
    xla_once = (f"XLA's cost analysis counts each loop body once: "
                f"{plan.xla_flops_once / 1e12:,.2f} TFLOP" if plan.xla_flops_once else
                "XLA:GPU gives no cost analysis without a device")
    lines += [
        f"  matmul part (parameter matmuls, expert buffer and pipeline layer padding taken "
        f"out): compiled / "
        f"formula = {plan.matmul_ratio:.4f}",
        f"  not in the formula: elementwise ops and reductions {_g(ew, unit)} {name}/token "
        f"({ew / ft:.1%} of the formula), transcendentals "
        f"{_g(plan.cost.transcendentals * per_token, unit)} {name[0]}/token",
        f"  per device per step: {plan.cost.flops / 1e12:,.2f} TFLOP from the HLO walk (loop "
        f"bodies x trip counts); {xla_once} (this walk, loops once: "
        f"{plan.walk_flops_once / 1e12:,.2f})",
    ]
    return lines


def _memory_section(plan: Plan) -> list[str]:
    mem = plan.step.compiled.memory_analysis()
    args = ", ".join(f"{k} {_bytes(v)}" for k, v in plan.args.items() if v)
    hbm = plan.spec.hbm_bytes
    lines = [f"Memory per device ({plan.compiler}'s buffer assignment: compiled memory analysis "
             "and live ranges)",
             f"  arguments    {_bytes(mem.argument_size_in_bytes)}: {args}",
             f"  temporaries  {_bytes(mem.temp_size_in_bytes)}; outputs "
             f"{_bytes(mem.output_size_in_bytes)} ({_bytes(mem.alias_size_in_bytes)} reuse the "
             "donated arguments)"]
    alloc = plan.allocated_bytes
    lines.append(f"  allocated    {_bytes(alloc)}: arguments + outputs - donated + temporaries + code, "
                 "what XLA allocates (its temporaries one block) and the trainer's preflight "
                 "compares with the device's memory"
                 + (f" ({1 - alloc / hbm:.0%} headroom of {_bytes(hbm)}; JAX preallocates 75% of "
                    "a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says more)"
                    if hbm and plan.step.gpu_kind is not None else ""))
    if plan.peak_bytes:
        counted = plan.counted_peak_bytes
        fit = (f" of {_bytes(hbm)} HBM on a {plan.spec.kind.upper()}: "
               f"{'fits' if counted <= hbm else 'does NOT fit'}"
               + (f", {1 - counted / hbm:.0%} headroom" if counted <= hbm else "")
               + (" without the score matrices (below)" if plan.fused_scores else "")
               ) if hbm else ""
        lines.append(f"  live at the peak (arguments included)  {_bytes(plan.peak_bytes)}{fit}; "
                     "the largest parts:")
        for g in plan.peak[:7]:
            lines.append(f"    {g.bytes / plan.peak_bytes:5.1%}  {_bytes(g.bytes):>10}  "
                         f"{g.label} ({g.values} buffer{'s' * (g.values > 1)}, e.g. {g.example})")
        scores = plan.scores_bytes
        if scores and plan.fused_scores:
            lines.append(f"  {_bytes(scores)} of the peak are attention score matrices XLA:CPU "
                         f"materializes; the GPU's cuDNN fused attention (model.attention_impl="
                         f"{plan.step.model_cfg.attention_impl}) keeps them on chip: "
                         f"{_bytes(plan.counted_peak_bytes)} without them")
        elif scores:
            lines.append(f"  {_bytes(scores)} of the peak are values of the xla attention core "
                         "(its float32 [T, S] score matrices among them; materialized, counted)")
    else:
        lines.append("  XLA wrote no live-range report: the peak's buffers are not known")
    return lines


def _collectives_section(plan: Plan) -> list[str]:
    mesh = dict(plan.step.plan.mesh.shape)
    rows = comms.summary(plan.colls)
    widened = any(c.widened for c in plan.colls)
    lines = ["Collectives per step, per device (loop bodies x trip counts; bytes at the JAX "
             "program's dtypes)",
             f"  {'collective':<18} {'purpose':<13} {'phase':<5} {'axes':<13} {'link':<7} "
             f"{'runs':>6} {'MB':>12}"]
    for r in rows:  # axes: "data,expert" or "group of N" (a group the compiler built)
        axes = tuple(a for a in r["axes"].split(",") if a in mesh)
        group = int(r["axes"].rsplit(" ", 1)[-1]) if not axes else 0
        link = "nvlink" if hardware.intra_node(mesh, axes, group, plan.spec) else "network"
        lines.append(f"  {r['kind']:<18} {r['purpose']:<13} {r['phase']:<5} {r['axes']:<13} "
                     f"{link:<7} {_runs(r['executions']):>6} "
                     f"{r['jax_bytes_per_device'] / 1e6:>12,.1f}")
    total = sum(c.jax_bytes_per_run for c in plan.colls)
    lines.append(f"  {'total':<66} {total / 1e6:>12,.1f}")
    if widened:
        lines.append(f"  (XLA:CPU sends bf16 collectives as f32: the compiled CPU program moves "
                     f"{comms.total_bytes(plan.colls) / 1e6:,.1f} MB)")
    return lines


def _overlap_section(plan: Plan) -> list[str]:
    sc = plan.scheduled
    if sc is None:
        return []
    lines = [f"Overlap as {plan.compiler} scheduled the step (planner/overlap.py: the program "
             "replayed in its instruction order, each asynchronous collective hidden by at most "
             "the compute issued between its start and done; ms per step"
             + (", pipeline bubble not included" if plan.pipeline is not None else "") + ")",
             f"  {'collective':<18} {'purpose':<13} {'phase':<5} {'runs':>7} {'async':>7} "
             f"{'on links':>10} {'between':>10} {'hidden':>10} {'exposed':>10}"]
    for r in sc.rows:
        lines.append(f"  {r.kind:<18} {r.purpose:<13} {r.phase:<5} {_runs(r.runs):>7} "
                     f"{_runs(r.async_runs):>7} {r.link_s * 1e3:10,.3f} "
                     f"{r.between_s * 1e3:10,.3f} {r.hidden_s * 1e3:10,.3f} "
                     f"{r.exposed_s * 1e3:10,.3f}")
    lines.append("  what runs between start and done (the largest parts):")
    for r in sc.rows:
        if r.between_s > 0:
            parts = ", ".join(f"{scope} {t / r.between_s:.0%}"
                              for scope, t in list(r.between_by_scope.items())[:4]
                              if t >= 0.005 * r.between_s)
            lines.append(f"    {r.kind} {r.purpose} {r.phase}: {parts}")
    lines.append(f"  replayed: {_secs(sc.step_s)} = roofline {_secs(sc.compute_s)} + "
                 f"{_secs(sc.exposed_s)} of the {_secs(sc.link_s)} on the links exposed "
                 f"({1 - sc.exposed_s / sc.link_s if sc.link_s else 1:.0%} hidden)"
                 + ("; XLA:CPU runs every collective synchronously (not a GPU's schedule)"
                    if plan.compiler == "XLA:CPU" else ""))
    return lines


def _bubble_lines(plan: Plan) -> list[str]:
    pc = plan.pipeline
    if pc is None:
        return []
    virtual = f" x {pc.virtual} virtual" if pc.virtual > 1 else ""
    order = list(pipeline_cost.ROLES.values())
    ops = "; ".join(f"{label} {_secs(pc.op_s[label])}"
                    for label in sorted(pc.op_s, key=order.index))
    return [
        f"  bubble       {pc.bubble_s:8.3f} s   {pc.kind}, {pc.stages} stages{virtual}, "
        f"{pc.microbatches} microbatches: {pc.ticks} ticks x {pc.passes} pass(es), "
        f"{pc.table_bubble:.1%} idle in op times; priced with each op's roofline (ticks "
        f"in lockstep, each as long as the slowest stage's F + B) a stage idles {pc.bubble:.1%} "
        f"of the {pc.schedule_s:,.3f} s schedule",
        f"               one op (roofline + its collectives): {ops}",
    ]


def _projection_section(plan: Plan) -> list[str]:
    p, spec = plan.projection, plan.spec
    dtype = plan.step.cfg.model.dtype
    src = "measured on this machine" if spec.measured else "datasheets, olmo_jax/planner/hardware.py"
    if plan.step.gpu_kind is not None:
        traffic = "XLA:GPU's operations and fusions, every one"
    else:
        traffic = ("XLA:CPU's operations, less its own converts and copies"
                   + (" and the attention core's score matrices, on chip in cuDNN's fused kernel"
                      if plan.fused_scores else ""))
    eff = spec.matmul_efficiency
    matmul = ("dot FLOPs at peak" if eff == 1 else
              f"dot FLOPs at {eff:.1%} of peak, {spec.matmul_flops(dtype) / 1e12:,.0f} TFLOP/s "
              "(measured on the lent H200: a bf16 8192^3 matmul at 769-798 of 989 TFLOP/s"
              + ("" if spec.kind == "h200" else f"; the same fraction assumed for a "
                 f"{spec.kind.upper()}") + ")")
    links = ("" if spec.link_efficiency == 1 else
             f" at {spec.link_efficiency:.0%} of the link bandwidth (assumed NCCL efficiency)")
    lines = [
        f"Projected step on {spec.kind.upper()} ({src}): peak {spec.peak(dtype) / 1e12:,.0f} "
        f"TFLOP/s {dtype}, HBM {spec.hbm_bw / 1e12:.2f} TB/s, NVLink {spec.intra_bw / 1e9:,.0f} "
        f"GB/s, network {spec.inter_bw / 1e9:,.0f} GB/s per direction",
        f"  compute      {p.compute_s:8.3f} s   {matmul}",
        f"  roofline     {p.roofline_s:8.3f} s   per operation max(FLOPs/matmul rate, "
        f"bytes/HBM); HBM traffic {_bytes(p.hbm_bytes)} ({traffic})",
        f"  collectives  {p.links_s:8.3f} s   NVLink {p.link_s['nvlink']:.3f} s, network "
        f"{p.link_s['network']:.3f} s (ring bus bytes{links}, one after another)",
        *_bubble_lines(plan),
        f"  step         {p.step_s:8.3f} s   nothing overlapped: {p.tokens_per_s():,.0f} "
        f"tokens/s/device, {p.model_flops_per_device / p.step_s / 1e12:,.0f} TFLOP/s, "
        f"MFU {p.mfu():.1%}",
        f"               {p.scheduled_s:8.3f} s   as {plan.compiler} scheduled it: "
        f"{p.tokens_per_s(overlap='scheduled'):,.0f} tokens/s/device, "
        f"MFU {p.mfu(overlap='scheduled'):.1%} (the overlap section)",
        f"               {p.overlapped_s:8.3f} s   collectives fully overlapped: "
        f"{p.tokens_per_s(True):,.0f} tokens/s/device, MFU {p.mfu(True):.1%}",
    ]
    if (ref := _reference(plan)) is not None:
        lines.append(ref)
    return lines


def format_plan(plan: Plan, config_path: str = "") -> str:
    s, c = plan.step, plan.step.model_cfg
    t, mesh = s.cfg.trainer, s.plan.mesh.shape
    total, active = metrics.param_counts(c)
    mesh_txt = " x ".join(f"{k}={v}" for k, v in mesh.items())
    zero1 = ", ZeRO-1" if s.plan.zero1 and s.plan.strategy == "ddp" else ""
    if s.gpu_kind is not None:
        where = (f"compiled by XLA:GPU for {s.n_devices} abstract {s.gpu_kind.upper()} GPUs "
                 "(olmo_jax.targets; deviceless, no autotuning)")
        caveat = (f"              XLA:GPU's fusions, buffers and collectives; attention: "
                  f"{plan.attention_impl}")
    else:
        where = f"compiled by XLA:CPU for {s.n_devices} fake CPU devices"
        caveat = ("              XLA:CPU's fusions, buffers and collective dtypes are not a GPU's; "
                  "parameters, FLOPs and bytes sent are the program's"
                  + (f"; attention on the {plan.spec.kind.upper()}: {plan.attention_impl}"
                     if plan.spec.kind in targets.KINDS else ""))
    head = [
        f"olmo_jax plan{': ' + config_path if config_path else ''}",
        f"  program     the real train step, {where} on abstract inputs (nothing allocated): "
        f"mesh {mesh_txt}, "
        f"{s.plan.strategy}, dispatch {s.plan.dispatch}{zero1}, {s.cfg.model.dtype} compute; "
        f"lowered in {s.lower_s:.1f} s, compiled in {s.compile_s:.1f} s",
        caveat,
        f"  model       {c.n_layers} blocks ({c.n_dense_layers} dense), d_model {c.d_model}, "
        f"{c.n_heads}/{c.kv_heads} heads of {c.head_size}, {c.moe.num_experts} experts top-"
        f"{c.moe.top_k} + {c.moe.n_shared_experts} shared; {t.global_batch_size} x {t.seq_len} "
        f"tokens per step in {t.grad_accum} microbatch(es)"
        + (f" x {s.plan.microbatches} pipeline microbatches" if s.plan.pipeline else ""),
        f"  parameters  {total / 1e9:,.3f} B total, {active / 1e9:,.3f} B active per token",
    ]
    if plan.pipeline is not None:
        head.append(f"  pipeline    the stages run different branches of the program: FLOPs, bytes "
                    f"and collective runs per device are the mean over the {mesh['pipe']} stages "
                    "(each branch counted as often as the schedule table runs it); memory is the "
                    "program's, the same on every device")
    head += [f"  note        {n}" for n in plan.notes]
    sections = [head, _flops_section(plan), _memory_section(plan),
                _collectives_section(plan), _overlap_section(plan), _projection_section(plan)]
    if plan.optimizer is not None:
        sections.insert(5, optimizer_lib.format_section(plan.optimizer))
    return "\n\n".join("\n".join(sec) for sec in sections)


def format_comparison(plans: list[Plan]) -> str:
    """Strategies side by side: bytes moved per step and projected tokens/s."""
    width = max(22, *(len(p.label) + 2 for p in plans))
    rows = [
        ("collective bytes / device / step", lambda p: _bytes(sum(c.jax_bytes_per_run
                                                                   for c in p.colls))),
        ("  of which all-to-all", lambda p: _bytes(sum(c.jax_bytes_per_run for c in p.colls
                                                       if "all-to-all" in c.kind))),
        ("  of which gathers + reductions", lambda p: _bytes(sum(
            c.jax_bytes_per_run for c in p.colls if c.kind in ("all-gather", "reduce-scatter",
                                                               "all-reduce")))),
        ("collective time (s)", lambda p: f"{p.projection.links_s:.3f}"),
        ("roofline time (s)", lambda p: f"{p.projection.roofline_s:.3f}"),
        ("tokens/s/device (no overlap)", lambda p: f"{p.projection.tokens_per_s():,.0f}"),
        ("MFU (no overlap)", lambda p: f"{p.projection.mfu():.1%}"),
        ("tokens/s/device (as scheduled)",
         lambda p: f"{p.projection.tokens_per_s(overlap='scheduled'):,.0f}"),
        ("tokens/s/device (overlap)", lambda p: f"{p.projection.tokens_per_s(True):,.0f}"),
        ("live at the peak", lambda p: _bytes(p.counted_peak_bytes)),
        ("compiled HLO GFLOP/token", lambda p: _g(sum(p.hlo.values())
                                                   + sum(p.recomputed.values()))),
    ]
    kind = plans[0].spec.kind.upper()
    lines = [f"Strategies side by side (projected on {kind})",
             f"  {'':<34}" + "".join(f"{p.label:>{width}}" for p in plans)]
    for name, fn in rows:
        lines.append(f"  {name:<34}" + "".join(f"{fn(p):>{width}}" for p in plans))
    return "\n".join(lines)
