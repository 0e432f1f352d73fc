"""The GPU check (run by tools/gpu_check.sh; see its header for preparing a bare machine).

    python tools/gpu_check.py [OUT_DIR] [--dry-run] [--sections a,b,...]

Sections, in order (each runs even if an earlier one failed; its error is recorded):
  device        the accelerator, jax version, compute capability, SMs
  ceilings      bf16 dense matmul TFLOP/s and device-to-device copy GB/s (the ceilings
                every later number is read against)
  kernels       every GPU kernel against its reference on fresh random data: relative
                error ||out - ref|| / ||ref|| (ref in float32 on upcast inputs) below
                the bf16 tolerance 1e-2, NaN never passes; the MXFP8 kernel bit for bit
  gmm_timing    grouped matmul at 8 and 128 experts: Pallas vs jax.lax.ragged_dot vs a
                dense matmul of equal FLOPs
  mxfp8_timing  the fused MXFP8 row+column quantize kernel vs the copy bandwidth (and
                the XLA-fused jnp reference)
  train         20 training steps of a ~1B-active MoE (bf16): tokens/s and MFU
Writes OUT_DIR/gpu_check.json (when OUT_DIR is given; rewritten after every section) and
prints a table last. Exit status 1 when a kernel check fails or a section raised.

--dry-run runs every section on the CPU with tiny sizes (the Pallas kernels in GPU
interpret mode), so the script is exercised by the test suite; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform as host_platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from olmo_jax.kernels import platform  # noqa: E402

SECTIONS = ("device", "ceilings", "kernels", "gmm_timing", "mxfp8_timing", "train")
BF16_TOL = 1e-2


@dataclasses.dataclass(frozen=True)
class Sizes:
    matmul: int  # square bf16 matmul for the ceiling
    copy_mib: int  # buffer for the copy bandwidth
    check_rows: int  # kernel checks: rows, K, N, groups
    check_k: int
    check_n: int
    check_groups: int
    gmm_rows: int  # timing: rows (tokens x top-k), d_model, hidden
    gmm_k: int
    gmm_n: int
    gmm_experts: tuple[int, ...]
    quant_shape: tuple[int, int]
    iters: int
    train_steps: int


FULL = Sizes(8192, 2048, 1000, 256, 384, 7, 32768, 2048, 2048, (8, 128), (16384, 4096), 20, 20)
DRY = Sizes(128, 1, 64, 64, 32, 3, 64, 64, 32, (4,), (64, 128), 1, 1)


def _sync(x):
    return jax.block_until_ready(x)


def bench(f, *args, iters: int, warmup: int = 2) -> float:
    """Median seconds of f(*args) over `iters` runs after `warmup` (f is jitted)."""
    for _ in range(warmup):
        _sync(f(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        _sync(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _check(name, out, ref, tol=BF16_TOL) -> dict:
    err = rel_error(out, ref)
    ok = bool(np.isfinite(err) and err < tol and np.isfinite(np.asarray(out, np.float32)).all())
    return {"name": name, "rel_error": err, "tol": tol, "ok": ok}


def _random_group_sizes(key, n_rows, n_groups, tail=0):
    """Uneven sizes summing to n_rows - tail, one group empty (when there are several)."""
    w = jax.random.uniform(key, (n_groups,)) ** 2
    w = w.at[n_groups // 2].set(0.0) if n_groups > 1 else w
    sizes = np.floor(np.asarray(w) / float(w.sum()) * (n_rows - tail)).astype(np.int32)
    sizes[0] += n_rows - tail - sizes.sum()
    return jnp.asarray(sizes)


def _kernel_context(dry: bool):
    return platform.interpret() if dry else _null()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ----------------------------------------------------------------------------- sections


def section_device(sz: Sizes, dry: bool) -> dict:
    d = jax.devices()[0]
    return {
        "platform": d.platform,
        "device_kind": d.device_kind,
        "n_devices": len(jax.devices()),
        "compute_capability": platform.gpu_capability(),
        "num_sms": platform.num_sms() if platform.gpu_capability() else None,
        "jax": jax.__version__,
        "python": host_platform.python_version(),
        "pallas_gmm_supported": platform.pallas_gmm_supported(),
        "block_scaled_mma_supported": platform.block_scaled_mma_supported(),
    }


def section_ceilings(sz: Sizes, dry: bool) -> dict:
    n = sz.matmul
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t_mm = bench(mm, a, b, iters=sz.iters)
    elems = sz.copy_mib * 2**20 // 2
    bufs = [jax.random.normal(jax.random.key(i), (elems,), jnp.bfloat16) for i in range(2)]
    copy = jax.jit(lambda x: x + jnp.bfloat16(1))  # reads and writes every byte once
    t_copy = min(bench(copy, x, iters=sz.iters) for x in bufs)
    return {
        "matmul_n": n,
        "matmul_tflops": 2 * n**3 / t_mm / 1e12,
        "copy_bytes": 2 * elems * 2,
        "copy_gbps": 2 * elems * 2 / t_copy / 1e9,
    }


def section_kernels(sz: Sizes, dry: bool) -> dict:
    from olmo_jax.kernels import grouped_matmul as gm
    from olmo_jax.kernels import mxfp8 as mx

    M, K, N, G = sz.check_rows, sz.check_k, sz.check_n, sz.check_groups
    keys = jax.random.split(jax.random.key(int(time.time()) % 2**31), 5)
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    w = jax.random.normal(keys[1], (G, K, N), jnp.bfloat16)
    dy = jax.random.normal(keys[2], (M, N), jnp.bfloat16)
    gs = _random_group_sizes(keys[3], M, G, tail=M // 50 + 1)
    f32 = jnp.float32
    checks = []
    cfg = gm.TileConfig(block_m=64, block_n=32, block_k=32, max_concurrent_steps=2) if dry else None
    with _kernel_context(dry):
        y, vjp = jax.jit(jax.vjp, static_argnums=0)(
            lambda a, b: gm.grouped_matmul(a, b, gs, cfg), x, w
        )
        dx, dw = vjp(dy)
        q = jax.jit(mx.quantize_rowcol_pallas)(mx_input := jax.random.normal(
            keys[4], sz.quant_shape, f32).astype(jnp.bfloat16))
    y_ref, vjp_ref = jax.vjp(
        lambda a, b: jax.lax.ragged_dot(a, b, gs), x.astype(f32), w.astype(f32)
    )
    dx_ref, dw_ref = vjp_ref(dy.astype(f32))
    checks.append(_check("gmm forward vs ragged_dot", y, y_ref))
    checks.append(_check("gmm transposed (dgrad) vs ragged_dot vjp", dx, dx_ref))
    checks.append(_check("tgmm (wgrad) vs ragged_dot vjp", dw, dw_ref))
    dw_jnp = gm.tgmm_reference(x.astype(f32), dy.astype(f32), gs)
    checks.append(_check("tgmm vs jnp reference", dw, dw_jnp))
    q_ref = jax.jit(mx.quantize_rowcol_reference)(mx_input)
    mismatched = sum(
        int(np.sum(np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
                   != np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8))))
        for a, b in zip(q, q_ref, strict=True)
    )
    checks.append({"name": "mxfp8 row+col quantize vs reference (bytes differing)",
                   "rel_error": float(mismatched), "tol": 0.5, "ok": mismatched == 0})
    return {"shape": [M, K, N, G], "group_sizes": np.asarray(gs).tolist(), "checks": checks,
            "all_ok": all(c["ok"] for c in checks)}


def section_gmm_timing(sz: Sizes, dry: bool) -> dict:
    from olmo_jax.kernels import grouped_matmul as gm

    M, K, N = sz.gmm_rows, sz.gmm_k, sz.gmm_n
    x = jax.random.normal(jax.random.key(1), (M, K), jnp.bfloat16)
    flops = gm.flops(M, K, N)
    dense_w = jax.random.normal(jax.random.key(2), (K, N), jnp.bfloat16)
    t_dense = bench(jax.jit(lambda a, b: a @ b), x, dense_w, iters=sz.iters)
    rows = []
    for E in sz.gmm_experts:
        w = jax.random.normal(jax.random.key(3), (E, K, N), jnp.bfloat16)
        gs = _random_group_sizes(jax.random.key(E), M, E)
        with _kernel_context(dry):
            pallas = jax.jit(lambda a, b, g: gm.gmm(a, b, g))
            t_pallas = bench(pallas, x, w, gs, iters=sz.iters, warmup=1)
        t_ragged = bench(jax.jit(jax.lax.ragged_dot), x, w, gs, iters=sz.iters)
        rows.append({
            "experts": E,
            "pallas_ms": t_pallas * 1e3, "ragged_dot_ms": t_ragged * 1e3, "dense_ms": t_dense * 1e3,
            "pallas_tflops": flops / t_pallas / 1e12, "ragged_dot_tflops": flops / t_ragged / 1e12,
            "dense_tflops": flops / t_dense / 1e12,
        })
    return {"rows_k_n": [M, K, N], "flops": flops, "by_experts": rows}


def section_mxfp8_timing(sz: Sizes, dry: bool, copy_gbps: float | None) -> dict:
    from olmo_jax.kernels import mxfp8 as mx

    M, K = sz.quant_shape
    xs = [jax.random.normal(jax.random.key(i), (M, K), jnp.bfloat16) for i in range(2)]
    # Bytes that must move: read x (2 B/elem), write two e4m3 copies and two scale arrays.
    moved = M * K * 2 + 2 * M * K + 2 * (M * K // 32)
    with _kernel_context(dry):
        kern = jax.jit(mx.quantize_rowcol_pallas)
        t_kernel = min(bench(kern, x, iters=sz.iters, warmup=1) for x in xs)
    t_ref = min(bench(jax.jit(mx.quantize_rowcol_reference), x, iters=sz.iters) for x in xs)
    out = {
        "shape": [M, K], "bytes_moved": moved,
        "kernel_ms": t_kernel * 1e3, "kernel_gbps": moved / t_kernel / 1e9,
        "jnp_reference_ms": t_ref * 1e3, "jnp_reference_gbps": moved / t_ref / 1e9,
    }
    if copy_gbps:
        out["kernel_fraction_of_copy_bw"] = out["kernel_gbps"] / copy_gbps
    return out


def train_config(dry: bool):
    """~1B-active MoE (bf16): d_model 2048, 16 blocks (the first dense), 16 heads of 128,
    32 experts top-4 of hidden 1024 plus one shared expert, vocab 50,304: 1.00B active of
    3.64B; 8 x 1024 tokens per step (fp32 master weights + AdamW ~60 GB, activations
    with the f32 attention scores ~20 GB: fits one H200). --dry-run: configs/tiny.py
    shrunk to one MoE block of d_model 64, 2 x 32 tokens."""
    import runpy

    cfg = runpy.run_path(str(ROOT / "configs" / "tiny.py"))["get_config"]()
    m = cfg.model
    m.dtype = "bfloat16"
    if dry:
        m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_dense_layers = 384, 64, 1, 2, 0
        m.moe.num_experts, m.moe.expert_hidden = 4, 64
        cfg.trainer.global_batch_size, cfg.trainer.seq_len = 2, 32
        return cfg
    m.vocab_size = 50304
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim = 2048, 16, 16, 16, 128
    m.n_dense_layers, m.dense_hidden = 1, 8192
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 32, 4, 1024
    m.moe.n_shared_experts, m.moe.shared_hidden = 1, 1024
    cfg.trainer.global_batch_size, cfg.trainer.seq_len = 8, 1024
    return cfg


def _train_once(cfg, steps: int, dry: bool) -> dict:
    from olmo_jax import config as config_lib
    from olmo_jax import metrics
    from olmo_jax.model.abstract import abstract_model
    from olmo_jax.optim import build_optimizer
    from olmo_jax.trainer.state import init_state
    from olmo_jax.trainer.step import make_train_step

    model_cfg = config_lib.model_config(cfg)
    t = cfg.trainer
    tx, schedule = build_optimizer(cfg.optim, steps)
    graphdef = abstract_model(model_cfg)[0]
    state = jax.jit(lambda: init_state(model_cfg, tx, 0)[1])()  # one compiled init
    train_step = make_train_step(graphdef, model_cfg, tx, schedule, t.grad_accum)
    step = jax.jit(train_step, donate_argnums=0)
    batches = [jax.random.randint(jax.random.key(i), (t.global_batch_size, t.seq_len + 1), 0,
                                  model_cfg.vocab_size, jnp.int32) for i in range(2)]
    t0 = time.perf_counter()
    with _kernel_context(dry and model_cfg.moe.gmm_impl == "pallas"):
        compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    state, m = compiled(state, batches[0])  # warm-up step
    _sync(m)
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = compiled(state, batches[i % 2])
    m = jax.device_get(m)
    elapsed = time.perf_counter() - t0
    tokens = steps * t.global_batch_size * t.seq_len
    tok_s = tokens / elapsed
    total, active = metrics.param_counts(model_cfg)
    flops_tok = metrics.flops_per_token(model_cfg, t.seq_len)
    peak = metrics.peak_flops_per_device("bfloat16")
    return {
        "gmm_impl": model_cfg.moe.gmm_impl,
        "resolved_gmm_impl": _resolved(model_cfg),
        "params_total": total, "params_active": active,
        "tokens_per_step": t.global_batch_size * t.seq_len, "steps": steps,
        "compile_s": compile_s, "tokens_per_s": tok_s,
        "tflops_per_s": flops_tok * tok_s / 1e12, "mfu": flops_tok * tok_s / peak,
        "final_loss": float(m["loss"]),
    }


def _resolved(model_cfg):
    from olmo_jax.kernels import resolve_gmm_impl

    return resolve_gmm_impl(model_cfg.moe.gmm_impl, model_cfg.compute_dtype)


def section_train(sz: Sizes, dry: bool) -> dict:
    """bf16 with gmm_impl=auto (Pallas on Hopper); if that fails, again with ragged_dot
    (both recorded). On Blackwell also one MXFP8 run (cuDNN block-scaled GEMMs)."""
    out = {}
    cfg = train_config(dry)
    try:
        out["bf16_auto"] = _train_once(cfg, sz.train_steps, dry)
    except Exception as e:  # keep going: the fallback says whether the model itself runs
        out["bf16_auto"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        cfg.model.moe.gmm_impl = "ragged_dot"
        out["bf16_ragged_dot"] = _train_once(cfg, sz.train_steps, dry)
    if platform.block_scaled_mma_supported():
        cfg.model.moe.precision = "mxfp8"
        cfg.model.attention_precision = "mxfp8"
        out["mxfp8"] = _train_once(cfg, sz.train_steps, dry)
    return out


# ----------------------------------------------------------------------------- driver


def _write(results: dict, out_dir: str) -> None:
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))


def run(sections, sz: Sizes, dry: bool, out_dir: str = "") -> dict:
    """Runs the sections in order; the JSON is rewritten after each one, so a run stopped
    by the time limit still leaves what it measured."""
    results: dict = {"dry_run": dry, "sections": {}, "ok": False}
    for name in sections:
        t0 = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            if name == "mxfp8_timing":
                copy = results["sections"].get("ceilings", {}).get("copy_gbps")
                res = section_mxfp8_timing(sz, dry, copy)
            else:
                res = globals()[f"section_{name}"](sz, dry)
        except Exception as e:
            res = {"error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": traceback.format_exc()[-4000:]}
        res["seconds"] = time.perf_counter() - t0
        results["sections"][name] = res
        print(f"[gpu_check] {name} done in {res['seconds']:.1f}s"
              + (f": ERROR {res['error'][:200]}" if "error" in res else ""), flush=True)
        _write(results, out_dir)
    kernels = results["sections"].get("kernels", {})
    results["ok"] = (
        all("error" not in r for r in results["sections"].values())
        and kernels.get("all_ok", "kernels" not in sections)
    )
    return results


def table(results: dict) -> str:
    s = results["sections"]
    lines = ["", "=" * 78, "olmo_jax gpu_check" + (" (DRY RUN on CPU: numbers mean nothing)"
                                                  if results["dry_run"] else ""), "=" * 78]
    add = lines.append
    if "device" in s and "error" not in s["device"]:
        d = s["device"]
        add(f"device      {d['device_kind']} x{d['n_devices']} ({d['platform']}), cc "
            f"{d['compute_capability']}, SMs {d['num_sms']}, jax {d['jax']}")
    if "ceilings" in s and "error" not in s["ceilings"]:
        c = s["ceilings"]
        add(f"ceilings    bf16 matmul {c['matmul_tflops']:.1f} TFLOP/s (n={c['matmul_n']}); "
            f"copy {c['copy_gbps']:.0f} GB/s")
    if "kernels" in s and "error" not in s["kernels"]:
        for c in s["kernels"]["checks"]:
            verdict = "PASS" if c["ok"] else "FAIL"
            add(f"check       {verdict}  {c['name']:<52} {c['rel_error']:.2e}")
    if "gmm_timing" in s and "error" not in s["gmm_timing"]:
        g = s["gmm_timing"]
        add(f"gmm         rows x K x N = {g['rows_k_n']}  (TFLOP/s; ms)")
        for r in g["by_experts"]:
            add(f"  E={r['experts']:<4} pallas {r['pallas_tflops']:7.1f} ({r['pallas_ms']:.3f})  "
                f"ragged_dot {r['ragged_dot_tflops']:7.1f} ({r['ragged_dot_ms']:.3f})  dense "
                f"{r['dense_tflops']:7.1f} ({r['dense_ms']:.3f})")
    if "mxfp8_timing" in s and "error" not in s["mxfp8_timing"]:
        q = s["mxfp8_timing"]
        frac = q.get("kernel_fraction_of_copy_bw")
        add(f"mxfp8 quant {q['shape']}: kernel {q['kernel_gbps']:.0f} GB/s ({q['kernel_ms']:.3f} ms"
            + (f", {100 * frac:.0f}% of copy" if frac else "") + f"); jnp/XLA "
            f"{q['jnp_reference_gbps']:.0f} GB/s")
    if "train" in s and "error" not in s["train"]:
        for k, r in s["train"].items():
            if isinstance(r, dict) and "tokens_per_s" in r:
                add(f"train {k:<10} {r['params_active'] / 1e9:.2f}B active / "
                    f"{r['params_total'] / 1e9:.2f}B, gmm {r['resolved_gmm_impl']}: "
                    f"{r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.1f}%, loss "
                    f"{r['final_loss']:.3f}, compile {r['compile_s']:.0f}s")
            elif isinstance(r, dict) and "error" in r:
                add(f"train {k:<10} ERROR {r['error'][:150]}")
    for name, r in s.items():
        if "error" in r:
            add(f"ERROR       {name}: {r['error'][:160]}")
    add(f"overall     {'OK' if results['ok'] else 'FAILED'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out_dir", nargs="?", default="")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--sections", default=",".join(SECTIONS))
    a = p.parse_args(argv)
    sections = [s for s in a.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if not a.dry_run and platform.gpu_capability() is None:
        p.error(f"no CUDA GPU found (jax sees {jax.devices()[0].platform}); use --dry-run on a CPU")
    results = run(sections, DRY if a.dry_run else FULL, a.dry_run, a.out_dir)
    _write(results, a.out_dir)
    print(table(results), flush=True)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
