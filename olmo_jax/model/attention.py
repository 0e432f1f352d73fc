"""Causal self-attention: grouped-query heads, QK RMSNorm, optional QKV clipping, RoPE.

The attention core (`model.attention_impl`, resolved by `resolve_attention_impl` for the
target platform: the mesh's devices while a step is traced):
  xla    a hand-written VJP (flash-attention's math without tiling): the backward pass
         recomputes the probabilities from q, k and the saved log-sum-exp instead of
         keeping [T, S] matrices alive between the passes; causal query chunks skip the
         upper triangle. XLA still materializes each chunk's float32 scores.
  cudnn  cuDNN's fused flash attention (`jax.nn.dot_product_attention(...,
         implementation="cudnn")`, causal, grouped-query heads): no [T, S] buffer.
  auto   cudnn on an NVIDIA GPU in bfloat16/float16, xla elsewhere.
QK-norm, clipping and RoPE are applied before either core.

Matches Hugging Face `OlmoeAttention` (QK-norm spans all heads of q and of k; clipping
is applied after the norm), so converted checkpoints give the same logits. With
`attention_precision="mxfp8"` the four projection GEMMs run in MXFP8
(olmo_jax/model/mxfp8.py); the softmax(q k^T) v core stays in the compute dtype.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax.kernels import platform
from olmo_jax.kernels.vma import cotangent_like
from olmo_jax.model import mxfp8
from olmo_jax.model.config import TransformerConfig
from olmo_jax.model.norm import RMSNorm
from olmo_jax.model.params import normal_param
from olmo_jax.model.rope import apply_rope


def resolve_attention_impl(impl: str, dtype) -> str:
    """`model.attention_impl` on the target platform: "cudnn" or "xla". An explicit cudnn
    where it cannot run is refused naming the field."""
    gpu = platform.current_target().is_gpu
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if impl == "auto":
        return "cudnn" if gpu and half else "xla"
    if impl == "cudnn" and not (gpu and half):
        why = f"the target is {platform.current_target().describe()}" if not gpu else \
            f"model.dtype is {jnp.dtype(dtype).name}"
        raise ValueError(
            f"model.attention_impl=cudnn runs cuDNN's fused attention on an NVIDIA GPU in "
            f"bfloat16/float16, but {why}; use model.attention_impl=auto or xla"
        )
    return impl


def cudnn_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array) -> jax.Array:
    """causal_attention on cuDNN's fused kernels (forward and backward), [B, T, N, H]."""
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True,
                                        implementation="cudnn")


def causal_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array) -> jax.Array:
    """Softmax(q k^T / sqrt(H)) v with a causal mask; N query heads share K kv heads.

    Scores and softmax in float32; returns [B, T, N, H] in q's dtype. The G = N / K query
    heads of one kv head are stacked as rows (M = G * T), so every product is one batched
    matmul over (B, K) with no repeated keys.
    """
    T = q_BTNH.shape[1]
    n_chunks = query_chunks(T)
    Tc = T // n_chunks
    # Causal blocks: query chunk i only looks at keys [0, (i + 1) * Tc), skipping the
    # upper triangle (2 chunks: 3/4 of the score work, 4 chunks: 5/8).
    outs = [
        _chunk_attention(q_BTNH[:, i * Tc : (i + 1) * Tc], k_BSKH[:, : (i + 1) * Tc],
                         v_BSKH[:, : (i + 1) * Tc], offset=i * Tc)
        for i in range(n_chunks)
    ]
    return outs[0] if n_chunks == 1 else jnp.concatenate(outs, axis=1)


def query_chunks(T: int) -> int:
    """How many query chunks a sequence of T is split into (few: each is one program)."""
    for n in (4, 2):
        if T % n == 0 and T // n >= 128:
            return n
    return 1


def _chunk_attention(q_BTNH, k_BSKH, v_BSKH, offset: int):
    """Queries at positions offset .. offset + T - 1 against keys 0 .. S - 1."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    G = N // K
    q_BKMH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    k_BKSH = k_BSKH.transpose(0, 2, 1, 3)
    v_BKSH = v_BSKH.transpose(0, 2, 1, 3)
    o_BKMH = _attention_core(q_BKMH, k_BKSH, v_BKSH, T, offset)
    return o_BKMH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _masked_scores(q_BKMH, k_BKSH, T, offset):
    """Scaled float32 scores with future positions set to -inf-ish; row m is the query at
    position offset + m % T."""
    H = q_BKMH.shape[-1]
    s_BKMS = jnp.einsum("bkmh,bksh->bkms", q_BKMH, k_BKSH, preferred_element_type=jnp.float32)
    M, S = s_BKMS.shape[-2:]
    causal_MS = (jnp.arange(M) % T + offset)[:, None] >= jnp.arange(S)[None, :]
    return jnp.where(causal_MS, s_BKMS * (H**-0.5), _MASKED), causal_MS


_MASKED = -1e30


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention_core(q_BKMH, k_BKSH, v_BKSH, T, offset):
    return _attention_fwd(q_BKMH, k_BKSH, v_BKSH, T, offset)[0]


def _attention_fwd(q_BKMH, k_BKSH, v_BKSH, T, offset):
    s_BKMS, _ = _masked_scores(q_BKMH, k_BKSH, T, offset)
    m_BKM1 = jnp.max(s_BKMS, axis=-1, keepdims=True)
    p_BKMS = jnp.exp(s_BKMS - m_BKM1)
    l_BKM1 = jnp.sum(p_BKMS, axis=-1, keepdims=True)
    o_BKMH = jnp.einsum("bkms,bksh->bkmh", p_BKMS.astype(v_BKSH.dtype), v_BKSH,
                        preferred_element_type=jnp.float32) / l_BKM1
    o_BKMH = o_BKMH.astype(q_BKMH.dtype)
    # Saved for the backward pass: inputs, output and the log-sum-exp (not the [M, S]
    # probabilities, which are recomputed from one matmul).
    return o_BKMH, (q_BKMH, k_BKSH, v_BKSH, o_BKMH, m_BKM1 + jnp.log(l_BKM1))


def _attention_bwd(T, offset, res, do_BKMH):
    q_BKMH, k_BKSH, v_BKSH, o_BKMH, lse_BKM1 = res
    H = q_BKMH.shape[-1]
    s_BKMS, causal_MS = _masked_scores(q_BKMH, k_BKSH, T, offset)
    p_BKMS = jnp.where(causal_MS, jnp.exp(s_BKMS - lse_BKM1), 0.0)
    dv_BKSH = jnp.einsum("bkms,bkmh->bksh", p_BKMS.astype(do_BKMH.dtype), do_BKMH)
    dp_BKMS = jnp.einsum("bkmh,bksh->bkms", do_BKMH, v_BKSH, preferred_element_type=jnp.float32)
    delta_BKM1 = jnp.sum(
        do_BKMH.astype(jnp.float32) * o_BKMH.astype(jnp.float32), axis=-1, keepdims=True
    )
    ds_BKMS = (p_BKMS * (dp_BKMS - delta_BKM1) * (H**-0.5)).astype(q_BKMH.dtype)
    dq_BKMH = jnp.einsum("bkms,bksh->bkmh", ds_BKMS, k_BKSH)
    dk_BKSH = jnp.einsum("bkms,bkmh->bksh", ds_BKMS, q_BKMH)
    return (cotangent_like(dq_BKMH, q_BKMH), cotangent_like(dk_BKSH, k_BKSH),
            cotangent_like(dv_BKSH, v_BKSH))


_attention_core.defvjp(_attention_fwd, _attention_bwd)


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
        std = cfg.init_std
        self.q_proj = normal_param(rngs.params(), (D, N, H), ("embed", "q_heads", "head_dim"), std)
        self.k_proj = normal_param(rngs.params(), (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.v_proj = normal_param(rngs.params(), (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.o_proj = normal_param(rngs.params(), (N, H, D), ("q_heads", "head_dim", "embed"), std)
        if cfg.qk_norm:
            self.q_norm = RMSNorm((N, H), ("q_heads", "head_dim"), cfg.norm_eps)
            self.k_norm = RMSNorm((K, H), ("kv_heads", "head_dim"), cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.clip_qkv = cfg.clip_qkv
        self.dtype = cfg.compute_dtype
        self.mxfp8_proj = cfg.attention_precision == "mxfp8"  # projection GEMMs in MXFP8
        self.impl = cfg.attention_impl  # resolved when traced (the target is known then)

    def _proj(self, spec: str, x, w):
        return mxfp8.einsum(spec, x, w) if self.mxfp8_proj else jnp.einsum(spec, x, w)

    def __call__(self, x_BTD: jax.Array, cos_TH: jax.Array, sin_TH: jax.Array) -> jax.Array:
        dt = self.dtype
        B, T, D = x_BTD.shape
        N, K, H = self.q_proj.shape[1], self.k_proj.shape[1], self.q_proj.shape[2]
        # q, k and v come from one matmul against the concatenated projections.
        w_qkv_DJ = jnp.concatenate(
            [self.q_proj[...].reshape(D, N * H), self.k_proj[...].reshape(D, K * H),
             self.v_proj[...].reshape(D, K * H)], axis=1,
        ).astype(dt)
        qkv_BTJ = self._proj("btd,dj->btj", x_BTD.astype(dt), w_qkv_DJ)
        q_BTNH = qkv_BTJ[..., : N * H].reshape(B, T, N, H)
        k_BTKH = qkv_BTJ[..., N * H : (N + K) * H].reshape(B, T, K, H)
        v_BTKH = qkv_BTJ[..., (N + K) * H :].reshape(B, T, K, H)
        if self.q_norm is not None:
            q_BTNH = self.q_norm(q_BTNH)
            k_BTKH = self.k_norm(k_BTKH)
        if self.clip_qkv:
            c = self.clip_qkv
            q_BTNH, k_BTKH, v_BTKH = (jnp.clip(a, -c, c) for a in (q_BTNH, k_BTKH, v_BTKH))
        q_BTNH = apply_rope(q_BTNH, cos_TH, sin_TH)
        k_BTKH = apply_rope(k_BTKH, cos_TH, sin_TH)
        core = cudnn_attention if resolve_attention_impl(self.impl, dt) == "cudnn" else causal_attention
        with jax.named_scope("attention_scores"):  # named for olmo_jax/planner
            o_BTNH = core(q_BTNH, k_BTKH, v_BTKH)
        return self._proj("btnh,nhd->btd", o_BTNH, self.o_proj[...].astype(dt))
