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

Document masking (`segment_ids_BT`, int32 [B, T], from `data.doc_mask`): a query attends
only to earlier keys of its own segment, in every core (xla: the chunk's mask; blas: each
query row's keys start at its document's start; cudnn: the packed-segment form of cuDNN's
padding-causal mask, at most model.cudnn_max_docs documents a row), and the RoPE tables
are per row ([B, T, H], positions restarting at each document: olmo_jax/model/rope.py).
Without segment ids every program is the plain causal one.

Sliding windows (`window` W > 0, the cores' argument): query t attends keys
[t - W + 1, t] (OLMo-core's `window_size`, flash-attention's (W - 1, 0)), with document
masking too. Keys left of a query chunk's window are skipped, not masked: the xla core
slices each chunk's keys from its first query's window start, the blas kernel starts each
query block at its first query's first key, cuDNN takes the window as its own
`sliding_window_length`.

A model's layers take their windows from `model.window_pattern` (OLMo-core's
SlidingWindowAttentionConfig; model/config.TransformerConfig.layer_windows). The layers
of a stack are one scanned program, so a layer holds a core per distinct window of the
model (`window_choices`, usually two: full and W) and runs the one its scanned
`window_index` picks (`lax.switch`: the other is not executed). A model whose layers share
one window (the default: all full) has a static core and no switch. Under context
parallelism the ring and all-gather kernels mask keys outside the window and skip the
blocks (ring) or keys (all-gather) it does not reach (kernels/ring_attention.py).

Under context parallelism the core is the ring or the all-gather
(kernels/ring_attention.py); where the core resolved to cudnn the ring's [L, L] blocks
run on cuDNN's fused attention (kernels/ring_blocks.py), except in sliding-window layers.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from olmo_jax import shapes
from olmo_jax.kernels import ring_attention, select
from olmo_jax.kernels.ring_blocks import packed_segments  # cuDNN's packed layout
from olmo_jax.kernels.vma import cotangent_like
from olmo_jax.model import mxfp8_gemm, rope
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
def cudnn_attention(q_BTNH: jax.Array, k_BAKH: jax.Array, v_BAKH: jax.Array,
                    segment_ids_BT: jax.Array | None = None, max_docs: int = 16,
                    window: int = 0) -> jax.Array:
    """causal_attention on cuDNN's fused kernels (forward and backward), [B, T, N, H].
    With `segment_ids_BT` each document is its own causal sequence: cuDNN's packed layout
    (per-row segment offsets and lengths, padding-causal mask), which jax.nn's public
    `dot_product_attention` does not expose; no [T, T] mask or bias is made. The layout
    holds `max_docs` documents a row (model.cudnn_max_docs; `packed_segments`). `window`
    > 0: a sliding window of that many keys (cuDNN's sliding_window_length)."""
    if segment_ids_BT is None:
        return jax.nn.dot_product_attention(
            q_BTNH, k_BAKH, v_BAKH, is_causal=True, implementation="cudnn",
            local_window_size=(window - 1, 0) if window > 0 else None)
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_sdpa

    offsets_BM1, lengths_BM = packed_segments(segment_ids_BT, max_docs)
    return cudnn_sdpa(q_BTNH, k_BAKH, v_BAKH, q_seqlen=lengths_BM, kv_seqlen=lengths_BM,
                      q_offsets=offsets_BM1, kv_offsets=offsets_BM1,
                      scale=q_BTNH.shape[-1] ** -0.5, mask_type=MaskType.PADDING_CAUSAL,
                      sliding_window_length=window if window > 0 else None)


@shapes.check("-> B T N H")
def causal_attention(q_BTNH: jax.Array, k_BAKH: jax.Array, v_BAKH: jax.Array,
                     segment_ids_BT: jax.Array | None = None, window: int = 0) -> jax.Array:
    """Softmax(q k^T / sqrt(H)) v with a causal mask; N query heads share K kv heads.
    [B, T, N, H] in and out: `causal_attention_heads` between two 4-D transposes.
    `segment_ids_BT`: also masked across documents (None = causal only); `window` > 0: a
    sliding window of that many keys (module docstring)."""
    B, T, N, H = q_BTNH.shape
    o_BNTH = causal_attention_heads(q_BTNH.transpose(0, 2, 1, 3), k_BAKH.transpose(0, 2, 1, 3),
                                    v_BAKH.transpose(0, 2, 1, 3), segment_ids_BT, window)
    return o_BNTH.transpose(0, 2, 1, 3)


@shapes.check("-> B N T H")
def causal_attention_heads(q_BNTH: jax.Array, k_BKAH: jax.Array, v_BKAH: jax.Array,
                           segment_ids_BT: jax.Array | None = None, window: int = 0) -> jax.Array:
    """causal_attention in the head-major layout: q [B, N, T, H], k and v [B, K, A, H],
    out [B, N, T, H]. Scores and softmax in float32; out in q's dtype. `segment_ids_BT`
    (int32, None = causal only): a query sees only keys of its own segment.

    Query head n = kv * G + g (G = N / K) is a free view [B, K, G, T, H] of q, so the G
    query heads of one kv head are stacked as rows of one batched matmul over (B, K): no
    repeated keys and no 5-D transpose. Causal blocks: query chunk i looks only at keys
    [0, (i + 1) * Tc), skipping the upper triangle (2 chunks: 3/4 of the score work, 4
    chunks: 5/8); with a `window` W only at keys [max(0, i * Tc - W + 1), (i + 1) * Tc)."""
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
        lo = max(0, i * Tc - window + 1) if window > 0 else 0  # the chunk's first key
        seg_q_BM = seg_k_BA = None
        if segment_ids_BT is not None:  # row m of the chunk is query i * Tc + m % Tc
            seg_q_BM = jnp.tile(segment_ids_BT[:, i * Tc:end], (1, G))
            seg_k_BA = segment_ids_BT[:, lo:end]
        o_BKMH = _attention_core(q_BKMH, k_BKAH[:, :, lo:end], v_BKAH[:, :, lo:end], seg_q_BM,
                                 seg_k_BA, Tc, i * Tc, lo, window)
        outs.append(o_BKMH.reshape(B, K, G, Tc, H))
    o_BKGTH = outs[0] if n_chunks == 1 else jnp.concatenate(outs, axis=3)
    return o_BKGTH.reshape(B, N, T, H)


def query_chunks(T: int) -> int:
    """How many query chunks a sequence of T is split into (few: each is one program)."""
    for n in (4, 2):
        if T % n == 0 and T // n >= 128:
            return n
    return 1


def _masked_scores(qs_BKMH, k_BKAH, seg_q_BM, seg_k_BA, T, offset, k_offset=0, window=0):
    """Float32 scores of the pre-scaled queries with future positions (and, given segment
    ids, other documents' keys; given a window, keys `window` or more positions back) set
    to -inf-ish; row m is the query at position offset + m % T, key a the one at
    k_offset + a."""
    s_BKMA = jnp.einsum("bkmh,bkah->bkma", qs_BKMH, k_BKAH, preferred_element_type=jnp.float32)
    M, A = s_BKMA.shape[-2:]
    q_M1 = (jnp.arange(M) % T + offset)[:, None]
    k_1A = (jnp.arange(A) + k_offset if k_offset else jnp.arange(A))[None, :]
    causal_MA = q_M1 >= k_1A
    if window > 0:
        causal_MA &= q_M1 - k_1A < window
    if seg_q_BM is None:
        return jnp.where(causal_MA, s_BKMA, _MASKED)
    keep_B1MA = causal_MA & (seg_q_BM[:, None, :, None] == seg_k_BA[:, None, None, :])
    return jnp.where(keep_B1MA, s_BKMA, _MASKED)


_MASKED = -1e30


def _scaled(q_BKMH):
    """q / sqrt(H): the softmax scale applied to the [M, H] queries, not the [M, A] scores."""
    return q_BKMH * jnp.asarray(q_BKMH.shape[-1] ** -0.5, q_BKMH.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention_core(q_BKMH, k_BKAH, v_BKAH, seg_q_BM, seg_k_BA, T, offset, k_offset=0, window=0):
    return _attention_fwd(q_BKMH, k_BKAH, v_BKAH, seg_q_BM, seg_k_BA, T, offset, k_offset,
                          window)[0]


def _attention_fwd(q_BKMH, k_BKAH, v_BKAH, seg_q_BM, seg_k_BA, T, offset, k_offset=0, window=0):
    s_BKMA = _masked_scores(_scaled(q_BKMH), k_BKAH, seg_q_BM, seg_k_BA, T, offset, k_offset,
                            window)
    m_BKM1 = jnp.max(s_BKMA, axis=-1, keepdims=True)
    p_BKMA = jnp.exp(s_BKMA - m_BKM1)
    l_BKM1 = jnp.sum(p_BKMA, axis=-1, keepdims=True)
    o_BKMH = jnp.einsum("bkma,bkah->bkmh", p_BKMA.astype(v_BKAH.dtype), v_BKAH,
                        preferred_element_type=jnp.float32) / l_BKM1
    o_BKMH = o_BKMH.astype(q_BKMH.dtype)
    # Saved for the backward pass: inputs, output and the log-sum-exp (not the [M, A]
    # probabilities, which are recomputed from one matmul).
    return o_BKMH, (q_BKMH, k_BKAH, v_BKAH, seg_q_BM, seg_k_BA, o_BKMH,
                    m_BKM1 + jnp.log(l_BKM1))


def _attention_bwd(T, offset, k_offset, window, res, do_BKMH):
    q_BKMH, k_BKAH, v_BKAH, seg_q_BM, seg_k_BA, o_BKMH, lse_BKM1 = res
    qs_BKMH = _scaled(q_BKMH)
    # Masked scores are -1e30: exp(s - lse) is exactly 0 there, no second mask needed.
    p_BKMA = jnp.exp(_masked_scores(qs_BKMH, k_BKAH, seg_q_BM, seg_k_BA, T, offset, k_offset,
                                    window) - lse_BKM1)
    dv_BKAH = jnp.einsum("bkma,bkmh->bkah", p_BKMA.astype(do_BKMH.dtype), do_BKMH)
    dp_BKMA = jnp.einsum("bkmh,bkah->bkma", do_BKMH, v_BKAH, preferred_element_type=jnp.float32)
    delta_BKM1 = jnp.sum(
        do_BKMH.astype(jnp.float32) * o_BKMH.astype(jnp.float32), axis=-1, keepdims=True
    )
    ds_BKMA = (p_BKMA * (dp_BKMA - delta_BKM1)).astype(q_BKMH.dtype)  # d scores of qs k^T
    dq_BKMH = _scaled(jnp.einsum("bkma,bkah->bkmh", ds_BKMA, k_BKAH))
    dk_BKAH = jnp.einsum("bkma,bkmh->bkah", ds_BKMA, qs_BKMH)
    return (cotangent_like(dq_BKMH, q_BKMH), cotangent_like(dk_BKAH, k_BKAH),
            cotangent_like(dv_BKAH, v_BKAH), None, None)


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
        self.cudnn_max_docs = cfg.cudnn_max_docs  # document masking on cuDNN
        self.mxfp8_impl = cfg.mxfp8_gemm_impl  # likewise (model/mxfp8_gemm.py)
        # Context parallelism: the sequence's zig-zag shard, attended over the plan's
        # `context` axis (olmo_jax/kernels/ring_attention.py; set by the plan).
        self.context = (cfg.context_parallel, cfg.context_attention, cfg.context_ring_hops)
        self.windows = cfg.window_choices  # the cores compiled (module docstring)
        self.rope_by_window = rope.by_window(cfg)  # a RoPE table per window choice

    def _proj(self, spec: str, x, w):
        if self.mxfp8_proj:
            return mxfp8_gemm.einsum(spec, x, w, impl=self.mxfp8_impl)
        return jnp.einsum(spec, x, w)

    def _by_window(self, core, window_index):
        """core(window) for this layer's window: static when the model has one window,
        else the `lax.switch` branch of `window_index` (module docstring)."""
        if len(self.windows) == 1:
            return core(self.windows[0])
        if window_index is None:
            raise ValueError(
                f"this model's layers have windows {self.windows} (model.window_pattern): "
                "an attention layer needs its window_index (transformer.run_blocks passes it)")
        return jax.lax.switch(window_index, [partial(core, w) for w in self.windows])

    @shapes.check("cos_TH: ... T H", "sin_TH: ... T H", "-> B T D")
    def __call__(self, x_BTD: jax.Array, cos_TH: jax.Array, sin_TH: jax.Array,
                 segment_ids_BT: jax.Array | None = None, window_index=None) -> jax.Array:
        """`cos_TH` / `sin_TH`: the RoPE tables, [T, H] or per row [B, T, H];
        `segment_ids_BT`: document masking (module docstring), None = causal only;
        `window_index`: int32 scalar, this layer's entry of `model.window_choices`
        (needed when the model has more than one window; it also picks this layer's
        tables where they are given per window, rope.by_window)."""
        if self.rope_by_window:
            cos_TH, sin_TH = (rope.for_window(t, window_index) for t in (cos_TH, sin_TH))
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
        core = attention_impl(self.impl, dt)
        impl = "context" if self.context[0] > 1 else core
        if impl == "blas":  # QK-norm, clipping, RoPE and the core: CPU FFI calls
            from olmo_jax.kernels import cpu_attention

            norms = {} if self.q_norm is None else {
                "q_norm": self.q_norm.weight[...], "k_norm": self.k_norm.weight[...],
                "eps": self.q_norm.eps}
            q_BTNH, k_BTKH, v_BTKH = cpu_attention.qk_prep(
                qkv_SJ.reshape(B, T, -1), N, K, cos_TH, sin_TH, norm=self.qk_norm_span,
                clip=self.clip_qkv, **norms)
            with jax.named_scope("attention_scores"):  # named for olmo_jax/planner
                o_BTNH = self._by_window(lambda w: cpu_attention.causal_attention(
                    q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, w), window_index)
        else:
            o_BTNH = self._xla_or_cudnn(impl, qkv_SJ, B, T, N, K, H, cos_TH, sin_TH,
                                        segment_ids_BT, window_index, core)
        o_SJ = o_BTNH.reshape(B * T, N * H)
        y_SD = self._proj("rj,jd->rd", o_SJ, self.o_proj[...].reshape(N * H, D).astype(dt))
        return y_SD.reshape(B, T, D)

    def _xla_or_cudnn(self, impl, qkv_SJ, B, T, N, K, H, cos_TH, sin_TH, segment_ids_BT,
                      window_index, core="xla"):
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
            if impl == "context":  # the ring's blocks on cuDNN where the core is cuDNN
                C, how, hops = self.context
                blocks = "cudnn" if core == "cudnn" else "xla"
                return self._by_window(lambda w: ring_attention.context_attention(
                    how, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, context=C, window=w,
                    hops=hops, blocks=blocks, max_docs=self.cudnn_max_docs), window_index)
            if impl == "cudnn":
                return self._by_window(lambda w: cudnn_attention(
                    q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, self.cudnn_max_docs, w),
                    window_index)
            # Head-major for the core: one 4-D transpose each (XLA fuses it into the
            # norm / RoPE element-wise work that produces q and k), none per chunk.
            q_BNTH, k_BKAH, v_BKAH = (a.transpose(0, 2, 1, 3) for a in (q_BTNH, k_BTKH, v_BTKH))
            o_BNTH = self._by_window(lambda w: causal_attention_heads(
                q_BNTH, k_BKAH, v_BKAH, segment_ids_BT, w), window_index)
            return o_BNTH.transpose(0, 2, 1, 3)  # fused with the chunks' concatenation
