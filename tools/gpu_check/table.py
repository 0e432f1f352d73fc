"""The GPU check's verdicts and its final table, from the sections' results (pure: no jax,
no torch). Losses of the three olmo_jax training runs (same weights, same batches) agree
when the first step's loss is within 1e-2 relative of the reference run's (forward on
identical weights: bf16 rounding only) and every later step's within 3e-2 (the rounding
differences then also pass through the updates). Goals (issue 15): MFU >= 45%, >= 1.2x
transformers' tokens/s, >= 1.0x OLMo-core's."""

from __future__ import annotations

TRAIN = ("train_pallas", "train_ragged_dot", "train_einsum")
KERNELS = ("ceilings", "gmm", "attention", "mxfp8")
FIRST_RTOL, CURVE_RTOL = 1e-2, 3e-2
GOALS = {"mfu": 0.45, "vs_hf": 1.2, "vs_olmo_core": 1.0}


def _ok(res: dict | None) -> dict | None:
    return res["result"] if res and "error" not in res and "result" in res else None


def loss_agreement(sections: dict) -> dict:
    runs = {n: _ok(sections.get(n)) for n in TRAIN if _ok(sections.get(n))}
    if len(runs) < 2:
        return {"ok": False, "why": f"only {len(runs)} of the 3 training runs finished"}
    ref_name, ref = next(iter(runs.items()))
    out = {"reference": ref_name, "max_rel_diff": {}, "ok": len(runs) == len(TRAIN)}
    for name, r in list(runs.items())[1:]:
        a, b = ref["losses"], r["losses"]
        rel = [abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a, b, strict=True)]
        out["max_rel_diff"][name] = max(rel)
        out["ok"] &= rel[0] <= FIRST_RTOL and max(rel) <= CURVE_RTOL
    if len(runs) < len(TRAIN):
        out["why"] = f"{len(TRAIN) - len(runs)} training run(s) did not finish"
    return out


def summarize(sections: dict) -> dict:
    ran = all(n in sections and "error" not in sections[n] for n in (*KERNELS, *TRAIN) if n in sections)
    checks_ok = all((_ok(sections.get(n)) or {}).get("all_ok", True) for n in KERNELS if n in sections)
    losses = loss_agreement(sections) if any(n in sections for n in TRAIN) else {"ok": True}
    best = max((_ok(sections.get(n)) for n in TRAIN if _ok(sections.get(n))),
               key=lambda r: r["tokens_per_s"], default=None)
    ratios = {}
    for ref in ("hf", "olmo_core"):
        r = _ok(sections.get(ref))
        if best and r and "tokens_per_s" in r:
            ratios[f"vs_{ref}"] = best["tokens_per_s"] / r["tokens_per_s"]
    goals = {}
    if best:
        goals["mfu"] = best["mfu"] >= GOALS["mfu"]
    for k, v in ratios.items():
        goals[k] = v >= GOALS[k]
    return {"ok": bool(ran and checks_ok and losses["ok"]), "sections_ran": ran, "checks_ok": checks_ok,
            "losses": losses, "best_train": best and best["gmm_impl"], "ratios": ratios, "goals_met": goals}


def render(results: dict) -> str:
    s, summ = results["sections"], results["summary"]
    lines = ["", "=" * 88, "olmo_jax gpu_check" + (" (DRY RUN on CPU, tiny shapes: numbers mean nothing)"
                                                   if results["dry_run"] else ""), "=" * 88]
    add = lines.append
    ceil = _ok(s.get("ceilings"))
    peak_tf = ceil["matmul_tflops"] if ceil else None
    if ceil:
        add(f"ceilings     bf16 matmul {ceil['matmul_tflops']:.1f} TFLOP/s (n={ceil['matmul_n']}); "
            f"HBM copy {ceil['copy_gbps']:.0f} GB/s")
    g = _ok(s.get("gmm"))
    if g:
        add(f"gmm          rows x K x N, experts = {g['shape_rows_k_n_experts']}  TFLOP/s (ms)"
            + ("; % of the matmul ceiling" if peak_tf else ""))
        for r in g["timing"]:
            frac = (f"  {100 * r['pallas_tflops'] / peak_tf:4.0f}% / {100 * r['ragged_dot_tflops'] / peak_tf:4.0f}%"
                    if peak_tf else "")
            add(f"  {r['product']:<8}   pallas {r['pallas_tflops']:8.1f} ({r['pallas_ms']:.3f})   "
                f"ragged_dot {r['ragged_dot_tflops']:8.1f} ({r['ragged_dot_ms']:.3f}){frac}")
    at = _ok(s.get("attention"))
    if at:
        for impl in ("xla", "cudnn"):
            r = at.get(impl, {})
            add(f"attention    {impl:<6} " + (f"fwd+bwd {r['fwd_bwd_ms']:.3f} ms, core {r['core_tflops']:.1f} TFLOP/s"
                                             if "fwd_bwd_ms" in r else f"not run: {r.get('not_run', '?')[:240]}"))
        if "cudnn_speedup_over_xla" in at:
            add(f"attention    cudnn {at['cudnn_speedup_over_xla']:.2f}x the xla path")
    mx = _ok(s.get("mxfp8"))
    if mx:
        add(f"mxfp8        quantize kernel {mx['kernel_gbps']:.0f} GB/s ({mx['kernel_ms']:.3f} ms); GEMM "
            f"{mx['gemm_tflops']:.1f} TFLOP/s (block-scaled MMA: {mx['block_scaled_mma']})")
    for n in KERNELS:
        for c in (_ok(s.get(n)) or {}).get("checks", []):
            verdict = "PASS" if c["ok"] else "FAIL"
            add(f"check        {verdict}  {c['name']:<58} {c['rel_error']:.2e} (tol {c['tol']:g})")
    for n in (*TRAIN, "hf", "olmo_core"):
        if n not in s:
            continue
        r = s[n]
        label = {"hf": "transformers", "olmo_core": "OLMo-core"}.get(n, n.replace("train_", "olmo_jax "))
        if "error" in r:
            add(f"train        {label:<20} DID NOT RUN: {r['error'][:900]}")
            continue
        r = r["result"]
        mfu = (f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else "")
        extra = (f", gmm {r['resolved_gmm_impl']}, compile {r['compile_s']:.0f} s" if "resolved_gmm_impl" in r
                 else f", attn {r.get('attn', '-')}, experts {r.get('experts', '-')}")
        add(f"train        {label:<20} {r['tokens_per_s']:>12,.0f} tok/s, {r['step_ms']:.0f} ms/step{mfu}, "
            f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}{extra}")
    la = summ["losses"]
    if "reference" in la:
        diffs = ", ".join(f"{k.replace('train_', '')} {v:.1e}" for k, v in la["max_rel_diff"].items())
        add(f"losses       {'AGREE' if la['ok'] else 'DISAGREE'} with {la['reference'].replace('train_', '')}: "
            f"max relative difference {diffs} (first step <= {FIRST_RTOL:g}, curve <= {CURVE_RTOL:g})")
    elif la.get("why"):
        add(f"losses       NOT COMPARED: {la['why']}")
    for k, v in summ["ratios"].items():
        add(f"ratio        olmo_jax ({summ['best_train']}) / {k[3:]}: {v:.2f}x tokens/s (goal >= {GOALS[k]:g}x)")
    if summ["goals_met"]:
        add("goals        " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in summ["goals_met"].items()))
    for n, r in s.items():
        if "error" in r and n not in (*TRAIN, "hf", "olmo_core"):
            add(f"ERROR        {n}: {r['error'][:300]}")
    add(f"overall      {'OK' if summ['ok'] else 'FAILED'} in {results.get('total_s', 0):.0f} s")
    return "\n".join(lines)
