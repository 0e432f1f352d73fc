"""MXFP8 in the model: the expert SwiGLU unit (every layout) and the dense projections
against a straightforward float32 reference written row by row (round each GEMM
operand through MXFP8 along its contracting dim, then plain einsums over a one-hot
expert assignment), forward and all gradients; the Blackwell scaled_matmul call against
the emulation; MXFP8 against plain bf16 within an MXFP8 tolerance; and the MoE layer
on the Pallas layouts (interpret mode).

Float32 compute makes implementation and reference agree to accumulation order:
tolerance 1e-5 relative to each tensor's largest entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo_jax.kernels import mxfp8_quant as mx
from olmo_jax.kernels import platform
from olmo_jax.model import mxfp8_gemm
from olmo_jax.model.config import MoEConfig, TransformerConfig
from olmo_jax.model.moe import experts, mxfp8_experts
from olmo_jax.model.moe.layer import MoELayer

D, F, E = 64, 96, 4
f32 = jnp.float32


def rt(a, axis, rounding="rceil"):
    return mxfp8_gemm.round_trip(a.astype(f32), axis, rounding)


def _tight(got, want, tol=1e-5):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(1.0, np.abs(want).max()))


def reference_swiglu_grads(x_RD, expert_R, w_gate, w_up, w_down, dy_RD, quantize_wgrad=False):
    """Row-wise reference: row r uses expert expert_R[r] (-1: no expert, output 0).
    Returns y and the gradients (dx, dw_gate, dw_up, dw_down) for cotangent dy."""
    oh = jax.nn.one_hot(expert_R, E, dtype=f32)  # [R, E]; all-zero row for -1
    xq = rt(x_RD, -1)
    g = jnp.einsum("rd,edf,re->rf", xq, rt(w_gate, 1), oh)
    u = jnp.einsum("rd,edf,re->rf", xq, rt(w_up, 1), oh)
    h = jax.nn.silu(g) * u
    hq = rt(h, -1)
    y = jnp.einsum("rf,efd,re->rd", hq, rt(w_down, 1), oh)
    dh = jnp.einsum("rd,efd,re->rf", rt(dy_RD, -1), rt(w_down, 2), oh)
    sig = jax.nn.sigmoid(g)
    du, dg = dh * g * sig, dh * u * sig * (1 + g * (1 - sig))
    dx = jnp.einsum("rf,edf,re->rd", rt(dg, -1), rt(w_gate, 2), oh)
    dx += jnp.einsum("rf,edf,re->rd", rt(du, -1), rt(w_up, 2), oh)
    a_x, a_h, c_y, c_g, c_u = xq, hq, dy_RD, dg, du
    if quantize_wgrad:  # rows of the ragged layout, blocks of 32 rows
        a_x, a_h, c_y, c_g, c_u = (rt(a, 0) for a in (xq, hq, dy_RD, dg, du))
    dw_gate = jnp.einsum("rd,rf,re->edf", a_x, c_g, oh)
    dw_up = jnp.einsum("rd,rf,re->edf", a_x, c_u, oh)
    dw_down = jnp.einsum("rf,rd,re->efd", a_h, c_y, oh)
    return y, (dx, dw_gate, dw_up, dw_down)


_reference = jax.jit(reference_swiglu_grads, static_argnums=6)


@pytest.fixture(scope="module")
def weights():
    k = jax.random.split(jax.random.key(0), 3)
    s = 0.2
    return (s * jax.random.normal(k[0], (E, D, F)), s * jax.random.normal(k[1], (E, D, F)),
            s * jax.random.normal(k[2], (E, F, D)))


def _layout_case(layout):
    """(x in the layout's shape, the typed layout, per-row expert ids of the flattened rows)."""
    key = jax.random.key(1)
    if layout == "ragged":
        gs = np.array([20, 0, 15, 13])  # 48 rows, one empty expert
        x = jax.random.normal(key, (48, D))
        return x, mxfp8_gemm.Ragged(jnp.asarray(gs, jnp.int32)), np.repeat(np.arange(E), gs)
    if layout == "batched":
        x = jax.random.normal(key, (E, 12, D))
        return x, mxfp8_gemm.Batched(), np.repeat(np.arange(E), 12)
    block_expert = np.array([0, 0, 2, 3, 3, 3])  # blocked: 6 blocks of 8 rows
    x = jax.random.normal(key, (6, 8, D))
    return x, mxfp8_gemm.Blocked(jnp.asarray(block_expert, jnp.int32)), np.repeat(block_expert, 8)


@pytest.mark.parametrize("layout", ["ragged", "batched", "blocked"])
def test_swiglu_unit_matches_reference(layout, weights):
    x, typed, expert_R = _layout_case(layout)
    dy = jax.random.normal(jax.random.key(2), x.shape)
    qw = layout == "ragged"  # the ragged case also exercises quantize_wgrad

    def run(x, wg, wu, wd):
        def f(*a):
            return mxfp8_experts.swiglu(*a, typed, "rceil", qw)

        y, vjp = jax.vjp(f, x, wg, wu, wd)
        return y, vjp(dy)

    y, grads = jax.jit(run)(x, *weights)
    R = expert_R.shape[0]
    y_ref, grads_ref = _reference(
        x.reshape(R, D), jnp.asarray(expert_R), *weights, dy.reshape(R, D), qw
    )
    _tight(y.reshape(R, D), y_ref)
    _tight(y, jax.jit(mxfp8_experts.swiglu_reference)(x, *weights, typed))
    _tight(grads[0].reshape(R, D), grads_ref[0])
    for g, g_ref in zip(grads[1:], grads_ref[1:], strict=True):
        _tight(g, g_ref)


def test_dense_einsum_matches_reference():
    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], (2, 16, 64))
    w = 0.1 * jax.random.normal(k[1], (64, 2, 32))
    dy = jax.random.normal(k[2], (2, 16, 2, 32))
    @jax.jit
    def run(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: mxfp8_gemm.einsum("btd,dnh->btnh", x, w), x, w)
        return y, *vjp(dy)

    @jax.jit
    def reference(x2, w2, dy2):
        return rt(x2, -1) @ rt(w2, 0), rt(dy2, -1) @ rt(w2, 1).T, rt(x2, -1).T @ dy2

    y, dx, dw = run(x, w, dy)
    y_ref, dx_ref, dw_ref = reference(x.reshape(32, 64), w.reshape(64, 64), dy.reshape(32, 64))
    _tight(y.reshape(32, 64), y_ref)
    _tight(dx.reshape(32, 64), dx_ref)
    _tight(dw.reshape(64, 64), dw_ref)
    with pytest.raises(ValueError, match="batch"):
        mxfp8_gemm.einsum("btd,ndh->btnh", x, jnp.swapaxes(w, 0, 1))


@pytest.mark.jax011
def test_scaled_matmul_call_matches_emulation():
    """The Blackwell branch of mx_nt (model.mxfp8_gemm_impl=scaled_matmul:
    jax.nn.scaled_matmul, operands as [B, M, K] and [B, N, K], e8m0 scales) computed here
    by jax's own CPU fallback, against the emulation (dequantize), for the dense, batched
    and blocked layouts: checks the operand layout handed to cuDNN."""
    k = jax.random.split(jax.random.key(4), 6)
    cases = {
        "dense": (jax.random.normal(k[0], (24, 64)), jax.random.normal(k[1], (64, 32)),
                  mxfp8_gemm.Dense()),
        "batched": (jax.random.normal(k[2], (4, 8, 64)), jax.random.normal(k[3], (4, 64, 32)),
                    mxfp8_gemm.Batched()),
        "blocked": (jax.random.normal(k[4], (3, 8, 64)), jax.random.normal(k[5], (4, 64, 32)),
                    mxfp8_gemm.Blocked(jnp.array([1, 3, 1]))),
    }

    def all_layouts(cases, impl):
        out = {}
        for name, (a, w, layout) in cases.items():
            a_q, a_s = mx.quantize(a, -1)
            wq = mxfp8_gemm.quantize_weight(w, "rceil")
            out[name] = mxfp8_gemm.mx_nt(layout, a_q, a_s, wq.fwd_q, wq.fwd_s, f32, impl)
        return out

    emulated = jax.jit(lambda c: all_layouts(c, "dequantize"))(cases)
    assert not any(mxfp8_gemm.use_scaled_matmul(layout) for _, _, layout in cases.values())
    assert all(mxfp8_gemm.use_scaled_matmul(layout, "scaled_matmul")
               for _, _, layout in cases.values())
    scaled = jax.jit(lambda c: all_layouts(c, "scaled_matmul"))(cases)
    for layout in cases:
        _tight(scaled[layout], emulated[layout])


def test_mxfp8_close_to_bf16(weights):
    """The MXFP8 SwiGLU in bfloat16 against plain bf16 (no quantization): relative L2
    error below 10%, not zero. Expected about 6%: each quantized operand carries e4m3's
    rounding (3 mantissa bits: up to 2^-4 relative, about 2.5% rms), and y passes through
    two GEMM levels with two quantized operands each."""
    x, _, _ = _layout_case("batched")
    bf = jnp.bfloat16
    args = [a.astype(bf) for a in (x, *weights)]
    dy = jax.random.normal(jax.random.key(5), x.shape, bf)

    @jax.jit
    def both(args, dy):
        ref, vjp_ref = jax.vjp(lambda *a: experts.ffn_batched(*a), *args)
        got, vjp = jax.vjp(
            lambda *a: mxfp8_experts.swiglu(*a, mxfp8_gemm.Batched(), "rceil", False), *args
        )
        return (got, *vjp(dy)), (ref, *vjp_ref(dy))

    for a, b in zip(*both(args, dy), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert 1e-3 < rel < 0.1, rel  # measured 0.060-0.068 (y, dx, dw_gate, dw_up, dw_down)


def _moe_layer(gmm_impl, precision):
    moe = MoEConfig(
        num_experts=E, top_k=2, expert_hidden=64, gmm_impl=gmm_impl, precision=precision
    )
    cfg = TransformerConfig(d_model=D, n_heads=2, init_std=0.2, dtype="bfloat16", moe=moe)
    return MoELayer(cfg, rngs=nnx.Rngs(3))


def _layer_fn(layer, with_grads: bool):
    graphdef, params = nnx.split(layer, nnx.Param)

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params)(x)
        return jnp.sum(jnp.sin(y.astype(f32))), y

    if with_grads:
        f = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        return lambda x: (lambda r: (r[0][1], r[1]))(f(params, x))
    return lambda x: loss(params, x)[1]


@pytest.mark.parametrize("precision,with_grads", [("bf16", False),
                                                  pytest.param("mxfp8", True, marks=pytest.mark.jax011)])
def test_moe_layer_on_pallas_kernels(precision, with_grads):
    """gmm_impl=pallas (interpret mode) against gmm_impl=ragged_dot, same weights, same
    precision, within bf16 rounding. bf16: the forward (the kernels' VJP is tested in
    tests/kernels); mxfp8: forward and every gradient, i.e. the MXFP8 unit on the Pallas
    layout (gmm forward, gmm against transposed weights for dgrad, tgmm for wgrad)."""
    x = jax.random.normal(jax.random.key(6), (1, 32, D), jnp.bfloat16)
    want = jax.jit(_layer_fn(_moe_layer("ragged_dot", precision), with_grads))(x)
    with platform.interpret():
        got = jax.jit(_layer_fn(_moe_layer("pallas", precision), with_grads))(x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=2.0**-6 * max(np.abs(b).max(), 1e-3))


@pytest.mark.jax011
def test_swiglu_unit_inside_shard_map(weights):
    """As an expert-parallel dispatcher calls it: inside shard_map with the experts split
    over an 'expert' axis (gradients carry the manual axes); same values as unsharded."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((E,), ("expert",), devices=jax.devices()[:E])
    spec = PartitionSpec("expert")
    x, _, _ = _layout_case("batched")
    dy = jax.random.normal(jax.random.key(7), x.shape)

    def grads(x, wg, wu, wd, dy):
        def f(*a):
            return mxfp8_experts.swiglu(*a, mxfp8_gemm.Batched(), "rceil", False)

        y, vjp = jax.vjp(f, x, wg, wu, wd)
        return y, *vjp(dy)

    sharded = jax.shard_map(grads, mesh=mesh, in_specs=spec, out_specs=spec)
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, *weights, dy)]
    for a, b in zip(jax.jit(sharded)(*args), jax.jit(grads)(x, *weights, dy), strict=True):
        _tight(a, b)


def _mxfp8_model_jaxpr(mxfp8_gemm_impl: str) -> str:
    """The jaxpr of a one-layer MXFP8 model (attention projections and blocked experts in
    MXFP8) built from a config whose model.mxfp8_gemm_impl is `mxfp8_gemm_impl`, traced
    inside the context a parallel plan traces a B300's steps in."""
    from olmo_jax.model.transformer import Transformer

    moe = MoEConfig(num_experts=E, top_k=2, expert_hidden=64, gmm_impl="einsum", precision="mxfp8")
    cfg = TransformerConfig(vocab_size=64, d_model=D, n_heads=2, n_layers=1, dtype="bfloat16",
                            attention_precision="mxfp8", mxfp8_gemm_impl=mxfp8_gemm_impl, moe=moe)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((1, 32), jnp.int32)
    with platform.targeting(platform.Target("gpu", (10, 3), 148, abstract=True)):
        return str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens))(params))


def test_the_model_runs_the_mxfp8_gemm_its_config_names():
    """model.mxfp8_gemm_impl, as the plan writes it into the model config, picks the
    GEMM: scaled_matmul calls jax.nn.scaled_matmul for the projections and the blocked
    experts, dequantize does not; the platform context (a B300 here) does not choose, so
    auto in a model without a plan is this CPU's dequantize."""
    scaled = _mxfp8_model_jaxpr("scaled_matmul")
    assert "scaled_matmul" in scaled
    assert "scaled_matmul" not in _mxfp8_model_jaxpr("dequantize")
    assert "scaled_matmul" not in _mxfp8_model_jaxpr("auto")
