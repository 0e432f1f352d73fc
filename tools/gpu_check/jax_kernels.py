"""The GPU check's kernel sections, each run as its own process by tools/gpu_check/driver.py:

    python tools/gpu_check/jax_kernels.py SECTION OUT.json [--dry-run]

  ceilings   a bf16 matmul (8192^3) in TFLOP/s and the HBM copy bandwidth in GB/s
             (bytes read + written): the ceilings every later number is read against
  gmm        the Pallas grouped matmul at the training shape (rows = tokens x top-k,
             d_model, expert hidden, experts of configs/gpu_check_1b.py): forward, dgrad
             (transposed weights) and wgrad (tgmm), each against jax.lax.ragged_dot in
             bf16 and a float32 reference: relative error and TFLOP/s
  attention  the model's attention layer with model.attention_impl=cudnn against
             attention_impl=xla (same weights): forward output and input gradient
             against a float32 run of the xla path, and forward+backward time; and
             context parallelism's ring blocks on cuDNN (olmo_jax/kernels/ring_blocks.py)
             against the blocks' float32 XLA reference, bf16 [L = 128] blocks: a
             diagonal block (causal; packed documents) and a block before its queries
             (all visible; one document crossing into the queries, a row with none),
             forward (o, lse) and backward (dq, dk, dv) from given global O and LSE
  mxfp8      the MXFP8 path: the fused row+column quantize kernel bit for bit against
             its jnp reference, the quantize-dequantize error within e4m3's bound, and
             the model's MXFP8 GEMM (olmo_jax/model/mxfp8_gemm.py: cuDNN block-scaled MMA on
             Blackwell, dequantized bf16 elsewhere) against a float32 GEMM

Relative error = ||out - ref|| / ||ref|| with ref in float32 on the same (bf16) inputs;
bf16 results pass below 1e-2, NaN never passes. --dry-run runs every section on the CPU
at tiny sizes (Pallas in GPU interpret mode; no cuDNN there: that half is reported as not
run, with the reason), so `make test` exercises the code; its numbers mean nothing."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (tools/gpu_check/common.py)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from olmo_jax.kernels import platform  # noqa: E402

BF16_TOL = 1e-2


@dataclasses.dataclass(frozen=True)
class Sizes:
    matmul: int  # square bf16 matmul for the ceiling
    copy_mib: int  # buffer for the copy bandwidth
    attn_batch: int  # attention: batch, sequence (heads and head size from the config)
    attn_seq: int
    quant_shape: tuple[int, int]
    iters: int


FULL = Sizes(8192, 2048, 1, 4096, (16384, 4096), 10)
DRY = Sizes(128, 1, 1, 64, (64, 128), 1)


def rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def check(name, out, ref, tol=BF16_TOL) -> dict:
    err = rel_error(out, ref)
    finite = bool(np.isfinite(np.asarray(out, np.float32)).all())
    return {"name": name, "rel_error": err, "tol": tol, "ok": bool(finite and err < tol)}


def bench(f, *args, iters: int, warmup: int = 2) -> float:
    """Median seconds of the jitted f(*args) over `iters` runs after `warmup`."""
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _kernel_context(dry: bool):
    return platform.interpret() if dry else common.nullcontext()


def _random_group_sizes(key, n_rows, n_groups, tail=0):
    """Uneven sizes summing to n_rows - tail, one group empty (when there are several)."""
    w = jax.random.uniform(key, (n_groups,)) ** 2
    w = w.at[n_groups // 2].set(0.0) if n_groups > 1 else w
    sizes = np.floor(np.asarray(w) / float(w.sum()) * (n_rows - tail)).astype(np.int32)
    sizes[0] += n_rows - tail - sizes.sum()
    return jnp.asarray(sizes)


def section_ceilings(model_cfg, t_cfg, sz: Sizes, dry: bool) -> dict:
    n = sz.matmul
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    t_mm = bench(jax.jit(lambda a, b: a @ b), a, b, iters=sz.iters)
    elems = sz.copy_mib * 2**20 // 2
    x = jax.random.normal(jax.random.key(1), (elems,), jnp.bfloat16)
    t_copy = bench(jax.jit(lambda x: x + jnp.bfloat16(1)), x, iters=sz.iters)  # reads, writes once
    return {"matmul_n": n, "matmul_tflops": 2 * n**3 / t_mm / 1e12,
            "copy_bytes": 2 * x.nbytes, "copy_gbps": 2 * x.nbytes / t_copy / 1e9}


def gmm_shape(model_cfg, t_cfg, dry: bool) -> tuple[int, int, int, int]:
    """(rows, K, N, experts): the training step's gate/up grouped matmul."""
    if dry:
        return 64, 64, 32, 3
    tokens = t_cfg.global_batch_size * t_cfg.seq_len
    return (tokens * model_cfg.moe.top_k, model_cfg.d_model, model_cfg.moe.expert_hidden,
            model_cfg.moe.num_experts)


def section_gmm(model_cfg, t_cfg, sz: Sizes, dry: bool) -> dict:
    from olmo_jax.kernels import grouped_matmul as gm

    M, K, N, G = gmm_shape(model_cfg, t_cfg, dry)
    keys = jax.random.split(jax.random.key(int(time.time()) % 2**31), 4)
    x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (G, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (M, N), jnp.bfloat16)
    gs = _random_group_sizes(keys[3], M, G, tail=M // 50 + 1)
    cfg = gm.TileConfig(block_m=64, block_n=32, block_k=32, max_concurrent_steps=2) if dry else None
    f32 = jnp.float32
    t = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731  [G, K, N] -> [G, N, K]

    def ragged_dw(x, dy, w, gs):  # ragged_dot's weight gradient, as autodiff transposes it
        return jax.vjp(lambda w: jax.lax.ragged_dot(x, w, gs), w)[1](dy)[0]

    # name: (pallas, ragged_dot, float32 reference), each f(a, b, w, gs); w passed, not closed over
    products = {
        "forward": (lambda x, _, w, gs: gm.gmm(x, w, gs, config=cfg),
                    lambda x, _, w, gs: jax.lax.ragged_dot(x, w, gs),
                    lambda x, _, w, gs: gm.gmm_reference(x.astype(f32), w.astype(f32), gs)),
        "dgrad": (lambda _, dy, w, gs: gm.gmm(dy, w, gs, transpose_rhs=True, config=cfg),
                  lambda _, dy, w, gs: jax.lax.ragged_dot(dy, t(w), gs),
                  lambda _, dy, w, gs: gm.gmm_reference(dy.astype(f32), t(w).astype(f32), gs)),
        "wgrad": (lambda x, dy, _, gs: gm.tgmm(x, dy, gs, config=cfg),
                  ragged_dw,
                  lambda x, dy, _, gs: gm.tgmm_reference(x.astype(f32), dy.astype(f32), gs)),
    }
    args = (x, dy, w, gs)
    flops = gm.flops(M, K, N)
    rows, checks = [], []
    for name, (pallas, ragged, reference) in products.items():
        ref = jax.jit(reference)(*args)
        with _kernel_context(dry):
            f = jax.jit(pallas)
            out = f(*args)
            t_pallas = bench(f, *args, iters=sz.iters, warmup=0 if dry else 1)
        g = jax.jit(ragged)
        out_ragged = g(*args)
        t_ragged = bench(g, *args, iters=sz.iters)
        checks.append(check(f"gmm {name}: pallas vs float32", out, ref))
        checks.append(check(f"gmm {name}: ragged_dot vs float32", out_ragged, ref))
        rows.append({"product": name, "pallas_ms": 1e3 * t_pallas, "ragged_dot_ms": 1e3 * t_ragged,
                     "pallas_tflops": flops / t_pallas / 1e12, "ragged_dot_tflops": flops / t_ragged / 1e12})
    checks += _slot_checks(gm, K, N, G, w, cfg, dry)
    return {"shape_rows_k_n_experts": [M, K, N, G], "flops": flops, "timing": rows,
            "checks": checks, "all_ok": all(c["ok"] for c in checks)}


def _slot_checks(gm, K, N, G, w, cfg, dry: bool) -> list[dict]:
    """The kernels on rowwise dispatch's sender-major receive slots (`senders`): 4 senders x
    G experts x one row block each, forward and weight gradient against the float32
    references in group-major order."""
    S, c = 4, 64 if dry else 128
    keys = jax.random.split(jax.random.key(int(time.time()) % 2**31 + 1), 2)
    x = jax.random.normal(keys[0], (S * G * c, K), jnp.bfloat16)
    dy = jax.random.normal(keys[1], (S * G * c, N), jnp.bfloat16)
    full = jnp.full((G,), S * c, jnp.int32)
    f32 = jnp.float32
    with _kernel_context(dry):
        y = jax.jit(lambda x, w: gm.gmm(x, w, full, config=cfg, senders=S))(x, w)
        dw = jax.jit(lambda x, dy: gm.tgmm(x, dy, full, config=cfg, senders=S))(x, dy)
    return [check("gmm forward, sender-major slots: pallas vs float32", y,
                  gm.gmm_reference(x.astype(f32), w.astype(f32), full, senders=S)),
            check("gmm wgrad, sender-major slots: pallas vs float32", dw,
                  gm.tgmm_reference(x.astype(f32), dy.astype(f32), full, senders=S))]


def section_attention(model_cfg, t_cfg, sz: Sizes, dry: bool) -> dict:
    from flax import nnx

    from olmo_jax.kernels import select
    from olmo_jax.model.attention import Attention
    from olmo_jax.model.rope import rope_tables

    B, T, D = sz.attn_batch, sz.attn_seq, model_cfg.d_model
    cos_TH, sin_TH = rope_tables(jnp.arange(T), model_cfg.head_size, model_cfg.rope_theta)
    x_BTD = jax.random.normal(jax.random.key(3), (B, T, D), jnp.float32)
    dy_BTD = jax.random.normal(jax.random.key(4), (B, T, D), jnp.float32)

    def layer(impl: str, dtype: str):
        attn = Attention(model_cfg.replace(attention_impl=impl, dtype=dtype), rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(attn)

        def fwd_bwd(x):  # output and input gradient: the fused backward runs for dx
            y, vjp = jax.vjp(lambda x: nnx.merge(graphdef, params)(x, cos_TH, sin_TH), x)
            return y, vjp(dy_BTD.astype(y.dtype))[0]
        return jax.jit(fwd_bwd)

    ref_y, ref_dx = layer("xla", "float32")(x_BTD)
    out = {"shape_b_t_heads_head_dim": [B, T, model_cfg.n_heads, model_cfg.head_size], "checks": []}
    bf16_x = x_BTD.astype(jnp.bfloat16)
    for impl in ("xla", "cudnn"):
        try:
            select.resolve_attention_impl(impl, select.local_target(), jnp.bfloat16)
        except ValueError as e:  # cudnn on a CPU: say why it did not run
            out[impl] = {"not_run": str(e)}
            continue
        f = layer(impl, "bfloat16")
        y, dx = f(bf16_x)
        t = bench(f, bf16_x, iters=sz.iters)
        causal_flops = 3 * 4 * B * T * (T + 1) / 2 * model_cfg.n_heads * model_cfg.head_size  # fwd+bwd
        out[impl] = {"fwd_bwd_ms": 1e3 * t, "core_tflops": causal_flops / t / 1e12}
        out["checks"].append(check(f"attention {impl} output vs float32", y, ref_y))
        out["checks"].append(check(f"attention {impl} input grad vs float32", dx, ref_dx))
    if "fwd_bwd_ms" in out.get("cudnn", {}):
        out["cudnn_speedup_over_xla"] = out["xla"]["fwd_bwd_ms"] / out["cudnn"]["fwd_bwd_ms"]
    if "not_run" in out.get("cudnn", {}):  # the dry run: the reference against itself
        out["ring_blocks"] = {"not_run": out["cudnn"]["not_run"]}
        out["checks"] += ring_block_checks(L=16, cudnn=False)
    else:
        out["checks"] += ring_block_checks()
    out["all_ok"] = all(c["ok"] for c in out["checks"])
    return out


def ring_block_cases(L: int = 128):
    """(name, diagonal, q segment ids [2, L], key segment ids [2, L] or None) of the ring's
    block kinds (olmo_jax/kernels/ring_blocks.py)."""
    def runs(*lengths):
        return np.repeat(np.arange(len(lengths)), lengths)

    a, b, c = (L * f // 128 for f in (30, 40, 70))
    diag = np.stack([runs(b, c - b, L - c), runs(L)]).astype(np.int32)
    k_before = np.stack([runs(c, L - c), runs(L)]).astype(np.int32)
    q_before = np.stack([runs(a, L - a) + 1, runs(L) + 1]).astype(np.int32)  # row 1: none
    return [("diagonal causal", True, None, None), ("diagonal docs", True, diag, diag),
            ("before", False, None, None), ("before one doc", False, q_before, k_before)]


def ring_block_inputs(L: int = 128):
    """bf16 (qs [B, K, G, L, H], k, v [B, K, L, H], do [B, K, G, L, H], a global output
    o [B, K, G, L, H] float32 as if other blocks had contributed) of the block checks."""
    B, K, G, H = 2, 2, 2, 64
    keys = jax.random.split(jax.random.key(7), 5)
    bf = jnp.bfloat16
    qs = (jax.random.normal(keys[0], (B, K, G, L, H)) / 8).astype(bf)
    k, v = (jax.random.normal(x, (B, K, L, H)).astype(bf) for x in keys[1:3])
    do = jax.random.normal(keys[3], (B, K, G, L, H)).astype(bf)
    o_global = jax.random.normal(keys[4], (B, K, G, L, H)).astype(bf).astype(jnp.float32)
    return qs, k, v, do, o_global


def ring_block_program(kern, cases):
    """f(qs, k, v, do, o_global) -> per case (o, lse, dq, dk, dv) of `kern`'s blocks
    (ring_blocks.block_fwd / block_bwd: the ring's masking), the backward from the global
    o and the block's lse + 0.5 (the other blocks' keys: a larger normalizer)."""
    from olmo_jax.kernels import ring_blocks as rb

    def run(qs, k, v, do, o_global):
        out = []
        for _, diagonal, qseg, kseg in cases:
            mask = rb.block_mask(diagonal, None if qseg is None else jnp.asarray(qseg),
                                 None if kseg is None else jnp.asarray(kseg))
            o, lse = rb.block_fwd(kern, qs, k, v, mask)
            delta = jnp.sum(do.astype(jnp.float32) * o_global, axis=-1, keepdims=True)
            out.append((o, lse) + rb.block_bwd(kern, qs, k, v, mask, o_global, lse + 0.5,
                                               do, delta))
        return out
    return run


def ring_block_checks(L: int = 128, cudnn: bool = True) -> list[dict]:
    """cuDNN's ring blocks (forward, and backward from a given global O / LSE) against the
    float32 reference kernels on the same bf16 inputs, all cases in one program each
    (`cudnn` False: the bf16 reference in cuDNN's place, for the dry run)."""
    from olmo_jax.kernels import ring_blocks as rb

    cases = ring_block_cases(L)
    args = ring_block_inputs(L)
    kern = rb.cudnn_kernels(4, packed_diagonal=True) if cudnn else rb.REFERENCE
    got = jax.jit(ring_block_program(kern, cases))(*args)
    want = jax.jit(ring_block_program(rb.REFERENCE, cases))(
        *(x.astype(jnp.float32) for x in args))
    checks = []
    for (name, *_), g, w in zip(cases, got, want, strict=True):
        for part, a, b in zip(("o", "lse", "dq", "dk", "dv"), g, w, strict=True):
            if part == "lse":  # rows without keys hold -1e30 in both: compared as 0
                a, b = (jnp.where(x < -1e29, 0.0, x) for x in (a, b))
            checks.append(check(f"ring block {name} {part}: {kern.name} vs float32", a, b))
    return checks


def section_mxfp8(model_cfg, t_cfg, sz: Sizes, dry: bool) -> dict:
    from olmo_jax.kernels import mxfp8_quant as mx

    M, K = sz.quant_shape
    x = jax.random.normal(jax.random.key(5), (M, K), jnp.float32).astype(jnp.bfloat16)
    with _kernel_context(dry):
        kern = jax.jit(mx.quantize_rowcol_pallas)
        q = kern(x)
        t_kernel = bench(kern, x, iters=sz.iters, warmup=0 if dry else 1)
    q_ref = jax.jit(mx.quantize_rowcol_reference)(x)
    differing = sum(int(np.sum(np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
                               != np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8))))
                    for a, b in zip(q, q_ref, strict=True))
    checks = [{"name": "mxfp8 row+col quantize kernel vs reference (bytes differing)",
               "rel_error": float(differing), "tol": 0.5, "ok": differing == 0}]
    # e4m3 keeps 3 mantissa bits: a quantize-dequantize round trip is within 2^-4 relative
    # per element of its block's scale; over a block of normal values ~3% in the norm.
    qd = jax.jit(lambda x: mx.quantize_dequantize(x.astype(jnp.float32), axis=-1))(x)
    checks.append(check("mxfp8 quantize-dequantize vs input", qd, x.astype(jnp.float32), tol=0.05))
    from olmo_jax.model.mxfp8_gemm import DENSE, mx_nt

    w = jax.random.normal(jax.random.key(6), (K // 4, K), jnp.float32).astype(jnp.bfloat16)
    gemm = jax.jit(lambda x, w: mx_nt(DENSE, *mx.quantize(x, -1), *mx.quantize(w, -1), jnp.bfloat16))
    ref = x.astype(jnp.float32) @ w.astype(jnp.float32).T
    # Two operands each within ~3% per block: the product within ~5% in the norm.
    checks.append(check("mxfp8 GEMM (x [M,K] @ w [N,K]^T) vs float32", gemm(x, w), ref, tol=0.08))
    t_gemm = bench(gemm, x, w, iters=sz.iters)
    moved = M * K * 2 + 2 * M * K + 2 * (M * K // 32)  # read bf16 x; write two e4m3 copies + scales
    return {"quant_shape": [M, K], "bytes_moved": moved, "kernel_ms": 1e3 * t_kernel,
            "kernel_gbps": moved / t_kernel / 1e9, "gemm_ms": 1e3 * t_gemm,
            "gemm_tflops": 2 * M * K * (K // 4) / t_gemm / 1e12,
            "block_scaled_mma": platform.block_scaled_mma_supported(), "checks": checks,
            "all_ok": all(c["ok"] for c in checks)}


SECTIONS = {"ceilings": section_ceilings, "gmm": section_gmm, "attention": section_attention,
            "mxfp8": section_mxfp8}


if __name__ == "__main__":
    args = common.section_args(SECTIONS)
    model_cfg, t_cfg = common.model_and_trainer(args.dry_run)
    common.run_section(args, lambda: SECTIONS[args.section](
        model_cfg, t_cfg, DRY if args.dry_run else FULL, args.dry_run))
