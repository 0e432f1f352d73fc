"""Causal self-attention: grouped-query heads, QK RMSNorm, optional QKV clipping, RoPE.

The attention core (`model.attention_impl`; which one runs where: the table of
olmo_jax/kernels/select.py). A model built from a parallel plan's `plan.model_cfg` has it
resolved for the mesh's target; a model used without a plan may leave it "auto", resolved
by the same table for the default device, where such a model's arrays live:
  xla    a hand-written VJP (flash-attention's math without tiling) in the head-major
         layout ([B, heads, T, H]: one 4-D transpose per tensor, fused with RoPE; no 5-D
         transposes): the backward pass recomputes the probabilities from q, k and the
         saved log-sum-exp instead of keeping [T, A] matrices alive between the passes;
         causal query chunks skip the upper triangle; the softmax scale is applied to the
         queries, not the scores. XLA still materializes each chunk's float32 scores.
  cudnn  cuDNN's fused flash attention (`jax.nn.dot_product_attention(...,
         implementation="cudnn")`, causal, grouped-query heads): no [T, A] buffer.
  blas   a CPU FFI kernel (olmo_jax/kernels/cpu_attention.py): flash attention's math in
         64-row query blocks, each block's scores one OpenBLAS SGEMM into a per-thread
         buffer, reading q, k and v in the projections' [B, T, heads, H] layout (no
         transposes); float32 on a CPU, built on first use.
QK-norm, clipping and RoPE are applied before either core.

Matches Hugging Face `OlmoeAttention` (QK-norm spans all heads of q and of k; clipping
is applied after the norm), so converted checkpoints give the same logits. With
`head_qk_norm` the QK-norm is OLMo-core's `use_head_qk_norm`: each head normalized over
head_dim, one [head_dim] weight shared by the heads (of q, and of k). With
`attention_precision="mxfp8"` the four projection GEMMs run in MXFP8
(olmo_jax/model/mxfp8_gemm.py); the softmax(q k^T) v core stays in the compute dtype.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax import shapes
from olmo_jax.kernels import ring_attention, select
from olmo_jax.kernels.vma import cotangent_like
from olmo_jax.model import mxfp8_gemm
from olmo_jax.model.config import TransformerConfig
from olmo_jax.model.norm import RMSNorm
from olmo_jax.model.params import normal_param
from olmo_jax.model.rope import apply_rope


def attention_impl(impl: str, dtype) -> str:
    """The attention core the layer runs: `impl`, or for "auto" (no plan resolved it) the
    table's choice for the default device (module docstring)."""
    if impl != "auto":
        return impl
    return select.resolve_attention_impl("auto", select.local_target(), dtype)


@shapes.check("-> B T N H")
def cudnn_attention(q_BTNH: jax.Array, k_BAKH: jax.Array, v_BAKH: jax.Array) -> jax.Array:
    """causal_attention on cuDNN's fused kernels (forward and backward), [B, T, N, H]."""
    return jax.nn.dot_product_attention(q_BTNH, k_BAKH, v_BAKH, is_causal=True,
                                        implementation="cudnn")


@shapes.check("-> B T N H")
def causal_attention(q_BTNH: jax.Array, k_BAKH: jax.Array, v_BAKH: jax.Array) -> jax.Array:
    """Softmax(q k^T / sqrt(H)) v with a causal mask; N query heads share K kv heads.
    [B, T, N, H] in and out: `causal_attention_heads` between two 4-D transposes."""
    B, T, N, H = q_BTNH.shape
    o_BNTH = causal_attention_heads(q_BTNH.transpose(0, 2, 1, 3), k_BAKH.transpose(0, 2, 1, 3),
                                    v_BAKH.transpose(0, 2, 1, 3))
    return o_BNTH.transpose(0, 2, 1, 3)


@shapes.check("-> B N T H")
def causal_attention_heads(q_BNTH: jax.Array, k_BKAH: jax.Array, v_BKAH: jax.Array) -> jax.Array:
    """causal_attention in the head-major layout: q [B, N, T, H], k and v [B, K, A, H],
    out [B, N, T, H]. Scores and softmax in float32; out in q's dtype.

    Query head n = kv * G + g (G = N / K) is a free view [B, K, G, T, H] of q, so the G
    query heads of one kv head are stacked as rows of one batched matmul over (B, K): no
    repeated keys and no 5-D transpose. Causal blocks: query chunk i looks only at keys
    [0, (i + 1) * Tc), skipping the upper triangle (2 chunks: 3/4 of the score work, 4
    chunks: 5/8)."""
    B, N, T, H = q_BNTH.shape
    K = k_BKAH.shape[1]
    G = N // K
    n_chunks = query_chunks(T)
    Tc = T // n_chunks
    q_BKGTH = q_BNTH.reshape(B, K, G, T, H)
    outs = []
    for i in range(n_chunks):
        q_BKMH = q_BKGTH[:, :, :, i * Tc:(i + 1) * Tc].reshape(B, K, G * Tc, H)
        end = (i + 1) * Tc
        o_BKMH = _attention_core(q_BKMH, k_BKAH[:, :, :end], v_BKAH[:, :, :end], Tc, i * Tc)
        outs.append(o_BKMH.reshape(B, K, G, Tc, H))
    o_BKGTH = outs[0] if n_chunks == 1 else jnp.concatenate(outs, axis=3)
    return o_BKGTH.reshape(B, N, T, H)


def query_chunks(T: int) -> int:
    """How many query chunks a sequence of T is split into (few: each is one program)."""
    for n in (4, 2):
        if T % n == 0 and T // n >= 128:
            return n
    return 1


def _masked_scores(qs_BKMH, k_BKAH, T, offset):
    """Float32 scores of the pre-scaled queries with future positions set to -inf-ish;
    row m is the query at position offset + m % T."""
    s_BKMA = jnp.einsum("bkmh,bkah->bkma", qs_BKMH, k_BKAH, preferred_element_type=jnp.float32)
    M, A = s_BKMA.shape[-2:]
    causal_MA = (jnp.arange(M) % T + offset)[:, None] >= jnp.arange(A)[None, :]
    return jnp.where(causal_MA, s_BKMA, _MASKED)


_MASKED = -1e30


def _scaled(q_BKMH):
    """q / sqrt(H): the softmax scale applied to the [M, H] queries, not the [M, A] scores."""
    return q_BKMH * jnp.asarray(q_BKMH.shape[-1] ** -0.5, q_BKMH.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention_core(q_BKMH, k_BKAH, v_BKAH, T, offset):
    return _attention_fwd(q_BKMH, k_BKAH, v_BKAH, T, offset)[0]


def _attention_fwd(q_BKMH, k_BKAH, v_BKAH, T, offset):
    s_BKMA = _masked_scores(_scaled(q_BKMH), k_BKAH, T, offset)
    m_BKM1 = jnp.max(s_BKMA, axis=-1, keepdims=True)
    p_BKMA = jnp.exp(s_BKMA - m_BKM1)
    l_BKM1 = jnp.sum(p_BKMA, axis=-1, keepdims=True)
    o_BKMH = jnp.einsum("bkma,bkah->bkmh", p_BKMA.astype(v_BKAH.dtype), v_BKAH,
                        preferred_element_type=jnp.float32) / l_BKM1
    o_BKMH = o_BKMH.astype(q_BKMH.dtype)
    # Saved for the backward pass: inputs, output and the log-sum-exp (not the [M, A]
    # probabilities, which are recomputed from one matmul).
    return o_BKMH, (q_BKMH, k_BKAH, v_BKAH, o_BKMH, m_BKM1 + jnp.log(l_BKM1))


def _attention_bwd(T, offset, res, do_BKMH):
    q_BKMH, k_BKAH, v_BKAH, o_BKMH, lse_BKM1 = res
    qs_BKMH = _scaled(q_BKMH)
    # Masked scores are -1e30: exp(s - lse) is exactly 0 there, no second mask needed.
    p_BKMA = jnp.exp(_masked_scores(qs_BKMH, k_BKAH, T, offset) - lse_BKM1)
    dv_BKAH = jnp.einsum("bkma,bkmh->bkah", p_BKMA.astype(do_BKMH.dtype), do_BKMH)
    dp_BKMA = jnp.einsum("bkmh,bkah->bkma", do_BKMH, v_BKAH, preferred_element_type=jnp.float32)
    delta_BKM1 = jnp.sum(
        do_BKMH.astype(jnp.float32) * o_BKMH.astype(jnp.float32), axis=-1, keepdims=True
    )
    ds_BKMA = (p_BKMA * (dp_BKMA - delta_BKM1)).astype(q_BKMH.dtype)  # d scores of qs k^T
    dq_BKMH = _scaled(jnp.einsum("bkma,bkah->bkmh", ds_BKMA, k_BKAH))
    dk_BKAH = jnp.einsum("bkma,bkmh->bkah", ds_BKMA, qs_BKMH)
    return (cotangent_like(dq_BKMH, q_BKMH), cotangent_like(dk_BKAH, k_BKAH),
            cotangent_like(dv_BKAH, v_BKAH))


_attention_core.defvjp(_attention_fwd, _attention_bwd)


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
        std = cfg.init_std
        self.q_proj = normal_param(rngs.params(), (D, N, H), ("embed", "q_heads", "head_dim"), std)
        self.k_proj = normal_param(rngs.params(), (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.v_proj = normal_param(rngs.params(), (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.o_proj = normal_param(rngs.params(), (N, H, D), ("q_heads", "head_dim", "embed"), std)
        self.qk_norm_span = ("head" if cfg.head_qk_norm else "all") if cfg.qk_norm else None
        if cfg.qk_norm and cfg.head_qk_norm:  # OLMo-core's use_head_qk_norm: per head
            self.q_norm = RMSNorm((H,), ("head_dim",), cfg.norm_eps, cfg.norm_impl)
            self.k_norm = RMSNorm((H,), ("head_dim",), cfg.norm_eps, cfg.norm_impl)
        elif cfg.qk_norm:
            self.q_norm = RMSNorm((N, H), ("q_heads", "head_dim"), cfg.norm_eps, cfg.norm_impl)
            self.k_norm = RMSNorm((K, H), ("kv_heads", "head_dim"), cfg.norm_eps, cfg.norm_impl)
        else:
            self.q_norm = self.k_norm = None
        self.clip_qkv = cfg.clip_qkv
        self.dtype = cfg.compute_dtype
        self.mxfp8_proj = cfg.attention_precision == "mxfp8"  # projection GEMMs in MXFP8
        self.impl = cfg.attention_impl  # resolved by the plan (module docstring)
        self.mxfp8_impl = cfg.mxfp8_gemm_impl  # likewise (model/mxfp8_gemm.py)
        # Context parallelism: the sequence's zig-zag shard, attended over the plan's
        # `context` axis (olmo_jax/kernels/ring_attention.py; set by the plan).
        self.context = (cfg.context_parallel, cfg.context_attention)

    def _proj(self, spec: str, x, w):
        if self.mxfp8_proj:
            return mxfp8_gemm.einsum(spec, x, w, impl=self.mxfp8_impl)
        return jnp.einsum(spec, x, w)

    @shapes.check("-> B T D")
    def __call__(self, x_BTD: jax.Array, cos_TH: jax.Array, sin_TH: jax.Array) -> jax.Array:
        dt = self.dtype
        B, T, D = x_BTD.shape
        N, K, H = self.q_proj.shape[1], self.k_proj.shape[1], self.q_proj.shape[2]
        # q, k and v come from one matmul against the concatenated projections, over the
        # B * T rows as one 2-D GEMM (so the weight gradient is one GEMM too, not a batched
        # product over B and a sum).
        w_qkv_DJ = jnp.concatenate(
            [self.q_proj[...].reshape(D, N * H), self.k_proj[...].reshape(D, K * H),
             self.v_proj[...].reshape(D, K * H)], axis=1,
        ).astype(dt)
        qkv_SJ = self._proj("rd,dj->rj", x_BTD.astype(dt).reshape(B * T, D), w_qkv_DJ)
        impl = "context" if self.context[0] > 1 else attention_impl(self.impl, dt)
        if impl == "blas":  # QK-norm, clipping, RoPE and the core: CPU FFI calls
            from olmo_jax.kernels import cpu_attention

            norms = {} if self.q_norm is None else {
                "q_norm": self.q_norm.weight[...], "k_norm": self.k_norm.weight[...],
                "eps": self.q_norm.eps}
            q_BTNH, k_BTKH, v_BTKH = cpu_attention.qk_prep(
                qkv_SJ.reshape(B, T, -1), N, K, cos_TH, sin_TH, norm=self.qk_norm_span,
                clip=self.clip_qkv, **norms)
            with jax.named_scope("attention_scores"):  # named for olmo_jax/planner
                o_BTNH = cpu_attention.causal_attention(q_BTNH, k_BTKH, v_BTKH)
        else:
            o_BTNH = self._xla_or_cudnn(impl, qkv_SJ, B, T, N, K, H, cos_TH, sin_TH)
        o_SJ = o_BTNH.reshape(B * T, N * H)
        y_SD = self._proj("rj,jd->rd", o_SJ, self.o_proj[...].reshape(N * H, D).astype(dt))
        return y_SD.reshape(B, T, D)

    def _xla_or_cudnn(self, impl, qkv_SJ, B, T, N, K, H, cos_TH, sin_TH):
        # sliced as [B * T, J] rows (2-D slices, then free reshapes)
        q_BTNH = qkv_SJ[:, : N * H].reshape(B, T, N, H)
        k_BTKH = qkv_SJ[:, N * H : (N + K) * H].reshape(B, T, K, H)
        v_BTKH = qkv_SJ[:, (N + K) * H :].reshape(B, T, K, H)
        if self.q_norm is not None:
            q_BTNH = self.q_norm(q_BTNH)
            k_BTKH = self.k_norm(k_BTKH)
        if self.clip_qkv:
            c = self.clip_qkv
            q_BTNH, k_BTKH, v_BTKH = (jnp.clip(a, -c, c) for a in (q_BTNH, k_BTKH, v_BTKH))
        q_BTNH = apply_rope(q_BTNH, cos_TH, sin_TH)
        k_BTKH = apply_rope(k_BTKH, cos_TH, sin_TH)
        with jax.named_scope("attention_scores"):  # named for olmo_jax/planner
            if impl == "context":
                C, how = self.context
                return ring_attention.context_attention(how, q_BTNH, k_BTKH, v_BTKH, context=C)
            if impl == "cudnn":
                return cudnn_attention(q_BTNH, k_BTKH, v_BTKH)
            # Head-major for the core: one 4-D transpose each (XLA fuses it into the
            # norm / RoPE element-wise work that produces q and k), none per chunk.
            q_BNTH, k_BKAH, v_BKAH = (a.transpose(0, 2, 1, 3) for a in (q_BTNH, k_BTKH, v_BTKH))
            o_BNTH = causal_attention_heads(q_BNTH, k_BKAH, v_BKAH)
            return o_BNTH.transpose(0, 2, 1, 3)  # fused with the chunks' concatenation
