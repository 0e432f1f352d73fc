"""A plan as text (`python -m olmo_jax.plan`): `format_plan` renders one
planner/plan_build.py `Plan` section by section (FLOPs per token, formula vs compiled and
why they differ; memory per device; collectives per step; the overlap as the compiler
scheduled the step; the optimizer's share; the projected step, next to what OLMo-core
measured for the same model shape), `format_run` the run's steps by batch size (each size
of trainer.batch_size_schedule planned on its own program) and its projected duration, and
`format_comparison` several plans side by side.
The numbers are the plan's (and REFERENCE's, what OLMo-core measured); this module adds
only their ratios and units, and the notes on why compiled and formula FLOPs differ.
"""

from __future__ import annotations

from olmo_jax import metrics, targets
from olmo_jax.model.attention import query_chunks
from olmo_jax.planner import comms, hardware, hlo_cost, pipeline_cost
from olmo_jax.planner.batch_sizes import RunPlan
from olmo_jax.planner.optimizer_cost import OptimizerCost
from olmo_jax.planner.plan_build import TERMS, Plan, cpu_attention_kernel

# What the reference measured (OLMo-core 3, docs/reference.md), keyed by the model's shape
# (d_model, n_layers, num_experts, top_k, seq_len).
REFERENCE = {
    (4096, 8, 128, 4, 8192): ("47B on 8 B300 with EP8", "b300", 52e3, None),
    (6144, 63, 128, 4, 8192): ("1.2T on 512 GPUs with EP8 x PP8", "b300", None, 858e12),
}


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
    per_token = plan.step.n_devices / plan.step.tokens_per_step
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
    limit, source = plan.memory_limit
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
        where = (f"HBM on a {plan.spec.kind.upper()}" if source.endswith(" HBM")
                 else f"memory per device ({source})")
        fit = (f" of {_bytes(limit)} {where}: "
               f"{'fits' if plan.fits else 'does NOT fit'}"
               + (f", {1 - counted / limit:.0%} headroom" if plan.fits else "")
               + (" without the score matrices (below)" if plan.fused_scores else "")
               ) if limit else ""
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


def _optimizer_section(oc: OptimizerCost) -> list[str]:
    lines = [f"Optimizer per device ({oc.name}; the train step's update, per step)",
             f"  state        {oc.state_bytes / 2**20:,.2f} MiB stored",
             f"  update       {oc.dot_flops / 1e9:,.3f} GFLOP in matmuls, "
             f"{oc.other_flops / 1e9:,.3f} GFLOP elementwise; {oc.hbm_bytes / 2**20:,.1f} MiB "
             f"HBM traffic; {oc.compute_s * 1e3:,.3f} ms roofline (float32)",
             f"  collectives  {oc.collective_bytes / 2**20:,.3f} MiB, "
             f"{oc.link_s * 1e3:,.3f} ms on the links; total {oc.step_s * 1e3:,.3f} ms"]
    if oc.name == "muon":
        lines.append(f"  Newton-Schulz  {oc.ns_flops_planned / 1e9:,.3f} GFLOP per device by the "
                     "ownership plan (parallel/muon_owners.py)")
        for axes, counts in oc.matrices_per_rank.items():
            lines.append(f"  owners over {' x '.join(axes)}: matrices per rank {counts}")
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
        f"{c.moe.top_k} + {c.moe.n_shared_experts} shared; {s.batch_size} x {t.seq_len} "
        f"tokens per step in {s.grad_accum} microbatch(es)"
        + (f" x {s.plan.microbatches} pipeline microbatches" if s.plan.pipeline else "")
        + ("; the largest batch of trainer.batch_size_schedule (each size: the Batch sizes "
           "section)" if t.batch_schedule is not None else ""),
        f"  parameters  {total / 1e9:,.3f} B total, {active / 1e9:,.3f} B active per token",
    ]
    if plan.pipeline is not None:
        head.append(f"  pipeline    the stages run different branches of the program: FLOPs, bytes "
                    f"and collective runs per device are the mean over the {mesh['pipe']} stages "
                    "(each branch counted as often as the schedule table runs it); memory is the "
                    "program's, the same on every device")
    head += [f"  ERROR       {e}" for e in plan.errors]
    head += [f"  note        {n}" for n in plan.notes]
    sections = [head, _flops_section(plan), _memory_section(plan),
                _collectives_section(plan), _overlap_section(plan), _projection_section(plan)]
    if plan.optimizer is not None:
        sections.insert(5, _optimizer_section(plan.optimizer))
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


def _duration(x: float) -> str:
    if x < 1:
        return _secs(x)
    if x >= 86400:
        return f"{x / 86400:,.2f} days"
    return f"{x / 3600:,.2f} h" if x >= 3600 else f"{x:,.1f} s"


def format_run(run: RunPlan) -> str:
    """The run's steps by batch size (a table with trainer.batch_size_schedule) and the
    run's projected time, each size's step time x its steps."""
    t, lines = run.trainer, []
    if run.scheduled:
        limit = (f"; live at the peak against {_bytes(run.limit_bytes)} ({run.limit_source})"
                 if run.limit_bytes else "")
        lines += [f"Batch sizes (trainer.batch_size_schedule={t.batch_schedule.spec}): the step "
                  "compiled at each size the run's steps take (the microbatch kept, more "
                  f"accumulated); the sections above plan the largest{limit}",
                  f"  {'batch':>12} {'tokens/step':>13} {'microbatches':>12} {'steps':>9} "
                  f"{'from step':>10} {'step, no overlap':>17} {'as scheduled':>13} "
                  f"{'tok/s/device':>13} {'MFU':>6} {'live at peak':>13}  fits"]
        for s in run.sizes:
            p = s.plan.projection
            fits = {True: "yes", False: "NO", None: "-"}[s.plan.fits]
            lines.append(
                f"  {s.run.size:>12,} {s.tokens_per_step:>13,} {s.grad_accum:>12} "
                f"{s.run.steps:>9,} {s.run.first_step + 1:>10,} {_secs(p.step_s):>17} "
                f"{_secs(p.scheduled_s):>13} {p.tokens_per_s(overlap='scheduled'):>13,.0f} "
                f"{p.mfu(overlap='scheduled'):>6.1%} {_bytes(s.plan.counted_peak_bytes):>13}  {fits}")
        lines.append("  (tokens/s/device and MFU as scheduled; each size's program compiled in "
                     + ", ".join(f"{s.plan.step.compile_s:.1f}" for s in run.sizes) + " s)")
    else:
        lines.append("Run")
    tokens_text = (f"{run.steps:,} steps, {run.tokens:,} tokens" if run.scheduled else
                   f"{run.steps:,} steps x {run.sizes[0].tokens_per_step:,} tokens = "
                   f"{run.tokens:,} tokens")
    lines.append(f"  run          {tokens_text} ({t.binds} binds): projected "
                 f"{_duration(run.time_s())} nothing overlapped, "
                 f"{_duration(run.time_s('scheduled'))} as scheduled, "
                 f"{_duration(run.time_s('full'))} fully overlapped")
    return "\n".join(lines)
