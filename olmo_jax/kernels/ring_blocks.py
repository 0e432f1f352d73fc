"""The [L, L] block kernels of ring attention (kernels/ring_attention.py) as one small
interface, with two implementations: cuDNN's fused flash-attention kernels ("cudnn", an
NVIDIA GPU) and XLA einsums of exactly the same contract ("reference", any device: the
CPU tests run the ring with it, the lent-GPU check compares cuDNN's blocks against it).
The ring's default blocks ("xla") are not this interface but its own online softmax of
XLA einsums (kernels/ring_attention.py), which also takes sliding windows.

With zig-zag shards every block the ring computes is one of two kinds (`BlockMask`):
  diagonal  the query chunk and the key chunk are the same positions: top-left causal,
            and with segment ids each document its own causal sequence (cuDNN: the
            packed-segment layout, padding-causal mask, at most `max_docs` documents a
            chunk; `packed_segments`).
  before    every key precedes every query: no causal mask. With segment ids (documents
            are contiguous runs) at most one document is visible in the block, the one
            that runs from the key chunk into the query chunk: the key chunk's last
            document. Its queries are the query chunk's first `q_len` tokens, its keys the
            key chunk's tokens from `k_start` on (cuDNN: a padding mask over dense rows,
            q_seqlen = q_len, the keys rotated so that k_start comes first and kv_seqlen =
            A - k_start; dK / dV rotated back). Other rows see no key of the block, other
            keys are seen by no query.
Blocks that no query sees are never computed (the ring skips them).

The interface, in the ring's head-major layout (pre-scaled queries qs [B, K, G, Q, H], keys
and values [B, K, A, H]):
  fwd(qs, k, v, mask) -> (o [B, K, G, Q, H] float32, lse [B, K, G, Q, 1] float32): the
      block's own softmax output and natural-log log-sum-exp of its scores. Rows that see
      no key are zeroed / set to -1e30 here (`block_fwd`), whatever the kernel returns.
  bwd(qs, k, v, mask, o, lse, do, delta) -> (dqs, dk, dv) float32: one block's exact
      gradients from the GLOBAL output o, log-sum-exp lse and delta = rowsum(do * o)
      (flash attention's dS = P * (dP - delta), P = exp(S - lse)); rows and columns
      outside the block's visible set are zeroed here (`block_bwd`).
The ring merges the blocks' (o, lse) by their log-sum-exp weights (`merge`).

cuDNN's backward is jax's private backward primitive called with the global O and LSE
(compat.cudnn_sdpa_bwd): jax's own VJP of `dot_product_attention(return_residual=True)`
drops the residual's cotangent, so differentiating through the merge would be wrong.
cuDNN's softmax statistics are [B * M, N, Q] float32 (M = the packed layout's segment
slots, 1 without one), the natural-log log-sum-exp of the scaled scores. Dense rows (every
block but a diagonal one with documents) hold [B, N, Q]. In the packed layout this
module reads the statistics of the s-th non-empty segment (counted over the whole batch)
at row s, position = the token's place in its segment (`packed_rows`): an assumption
about XLA's cuDNN graph that no CPU can check. Until the lent-GPU check has compared
these blocks' statistics and gradients with the reference (tools/gpu_check.sh, attention
section, which runs the packed path), a diagonal block with documents runs XLA's block
(`cudnn_kernels(packed_diagonal=False)`, the default): every other block reads dense
statistics.

Sliding windows are not expressed on cuDNN here: the blocks off the diagonal would need a
window offset, so windowed layers stay on the XLA blocks.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp

# which block kernels the ring runs: the plan picks xla or cudnn (model.attention_impl)
RingBlocks = Literal["xla", "cudnn", "reference"]
RING_BLOCKS = get_args(RingBlocks)
MASKED = -1e30


class BlockMask(NamedTuple):
    """Which keys of a block each query sees (module docstring). `diagonal` is static;
    qseg_BQ / kseg_BA: int32 segment ids (None: no document masking); q_len_B / k_start_B:
    int32, a `before` block's one visible document (None without segment ids)."""
    diagonal: bool
    qseg_BQ: jax.Array | None = None
    kseg_BA: jax.Array | None = None
    q_len_B: jax.Array | None = None
    k_start_B: jax.Array | None = None


def block_mask(diagonal: bool, qseg_BQ=None, kseg_BA=None) -> BlockMask:
    """The BlockMask of a diagonal or `before` block; for the latter with segment ids, the
    one document the block can show (the key chunk's last) and its query / key spans."""
    if qseg_BQ is None or diagonal:
        return BlockMask(diagonal, qseg_BQ, kseg_BA)
    last_B1 = kseg_BA[:, -1:]
    # documents are contiguous runs: its queries lead the query chunk, its keys end the keys
    q_len_B = jnp.sum(jnp.cumprod(qseg_BQ == last_B1, axis=1), axis=1, dtype=jnp.int32)
    k_run_B = jnp.sum(jnp.cumprod((kseg_BA == last_B1)[:, ::-1], axis=1), axis=1,
                      dtype=jnp.int32)
    return BlockMask(False, qseg_BQ, kseg_BA, q_len_B, kseg_BA.shape[1] - k_run_B)


def visible(mask: BlockMask, Q: int, A: int):
    """(rows [B or 1, Q], columns [B or 1, A], the [B or 1, Q, A] mask) of a block: which
    queries see some key, which keys some query sees, and which key each query sees."""
    q_Q, k_A = jnp.arange(Q), jnp.arange(A)
    if mask.diagonal:
        vis_QA = (q_Q[:, None] >= k_A[None, :])[None]
        if mask.qseg_BQ is not None:
            vis_QA = vis_QA & (mask.qseg_BQ[:, :, None] == mask.kseg_BA[:, None, :])
        return jnp.ones((1, Q), bool), jnp.ones((1, A), bool), vis_QA
    if mask.qseg_BQ is None:
        return jnp.ones((1, Q), bool), jnp.ones((1, A), bool), jnp.ones((1, Q, A), bool)
    rows_BQ = q_Q[None, :] < mask.q_len_B[:, None]
    cols_BA = k_A[None, :] >= mask.k_start_B[:, None]
    return rows_BQ, cols_BA, rows_BQ[:, :, None] & cols_BA[:, None, :]


def _rows(x_BQ):  # [B, Q] -> [B, 1, 1, Q, 1], broadcasting over the head-major q layout
    return x_BQ[:, None, None, :, None]


def _cols(x_BA):  # [B, A] -> [B, 1, A, 1], over k / v [B, K, A, H]
    return x_BA[:, None, :, None]


def block_fwd(kernel, qs, k, v, mask: BlockMask):
    """`kernel`'s forward of one block, rows that see no key set to o = 0, lse = -1e30."""
    o, lse = kernel.fwd(qs, k, v, mask)
    rows_BQ, _, _ = visible(mask, qs.shape[3], k.shape[2])
    return (jnp.where(_rows(rows_BQ), o, 0.0), jnp.where(_rows(rows_BQ), lse, MASKED))


def block_bwd(kernel, qs, k, v, mask: BlockMask, o, lse, do, delta):
    """`kernel`'s backward of one block with the global o / lse / delta, gradients of
    rows and columns outside the block's visible set zeroed."""
    rows_BQ, cols_BA, _ = visible(mask, qs.shape[3], k.shape[2])
    dqs, dk, dv = kernel.bwd(qs, k, v, mask, o, lse, do, delta)
    return (jnp.where(_rows(rows_BQ), dqs, 0.0), jnp.where(_cols(cols_BA), dk, 0.0),
            jnp.where(_cols(cols_BA), dv, 0.0))


def merge(state, block):
    """(o, lse) of the blocks so far and one more block's -> their union's (the softmax
    over all their keys): o = sum_b exp(lse_b - LSE) o_b, LSE = logaddexp over blocks."""
    o, lse = state
    o_b, lse_b = block
    new = jnp.logaddexp(lse, lse_b)
    return o * jnp.exp(lse - new) + o_b * jnp.exp(lse_b - new), new


def init_state(qs):
    shape = qs.shape[:-1] + (1,)
    return jnp.zeros(qs.shape, jnp.float32), jnp.full(shape, MASKED, jnp.float32)


# ---- XLA's blocks ------------------------------------------------------------------------
def _xla_scores(qs, k, mask):
    s = jnp.einsum("bkgqh,bkah->bkgqa", qs, k, preferred_element_type=jnp.float32)
    _, _, vis_BQA = visible(mask, qs.shape[3], k.shape[2])
    vis = vis_BQA[:, None, None]
    return jnp.where(vis, s, MASKED), vis


def _xla_fwd(qs, k, v, mask):
    s, vis = _xla_scores(qs, k, mask)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkgqa,bkah->bkgqh", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32) / jnp.maximum(l, 1e-30)
    return o, m + jnp.log(jnp.maximum(l, 1e-30))


def grads_from_probs(p, qs, k, v, do, delta):
    """(dqs, dk, dv) float32 of one block from its probabilities p = exp(s - lse) under the
    global lse, and delta = rowsum(do * o) (flash attention's dS = P * (dP - delta))."""
    dv = jnp.einsum("bkgqa,bkgqh->bkah", p.astype(do.dtype), do,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgqh,bkah->bkgqa", do, v, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta)).astype(qs.dtype)
    dqs = jnp.einsum("bkgqa,bkah->bkgqh", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqa,bkgqh->bkah", ds, qs, preferred_element_type=jnp.float32)
    return dqs, dk, dv


def _xla_bwd(qs, k, v, mask, o, lse, do, delta):
    s, vis = _xla_scores(qs, k, mask)
    return grads_from_probs(jnp.where(vis, jnp.exp(s - lse), 0.0), qs, k, v, do, delta)


class Kernels(NamedTuple):
    name: str
    fwd: object
    bwd: object


REFERENCE = Kernels("reference", _xla_fwd, _xla_bwd)


# ---- cuDNN's blocks ----------------------------------------------------------------------
def packed_segments(segment_ids_BT: jax.Array, max_docs: int) -> tuple[jax.Array, jax.Array]:
    """(offsets [B, M + 1], lengths [B, M]), int32, M = min(max_docs, T): row b's
    documents' starts and lengths in order, then -1s (cuDNN's packed layout). A row with
    more than M documents has its documents from the M-th on merged into the last slot."""
    B, T = segment_ids_BT.shape
    M = min(max_docs, T)
    doc_BT = _doc_slots(segment_ids_BT, M)
    n_docs_B1 = doc_BT[:, -1:] + 1
    rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    lengths_BM = jnp.zeros((B, M), jnp.int32).at[rows_BT, doc_BT].add(1)
    offsets_BM = jnp.cumsum(lengths_BM, axis=1, dtype=jnp.int32) - lengths_BM
    used_BM = jnp.arange(M)[None, :] < n_docs_B1
    offsets_BM = jnp.where(used_BM, offsets_BM, -1)
    lengths_BM = jnp.where(used_BM, lengths_BM, -1)
    return jnp.concatenate([offsets_BM, jnp.full((B, 1), -1, jnp.int32)], axis=1), lengths_BM


def _doc_slots(segment_ids_BT, M: int):
    """Each token's packed slot: its document's ordinal in the row, capped at M - 1."""
    starts_BT = jnp.concatenate(
        [jnp.ones_like(segment_ids_BT[:, :1], bool),
         segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    return jnp.minimum(jnp.cumsum(starts_BT, axis=1, dtype=jnp.int32) - 1, M - 1)


def packed_rows(segment_ids_BT, offsets_BM1, M: int):
    """(s_BT, t_BT): where token (b, t)'s softmax statistic sits in cuDNN's packed
    statistics [B * M, N, T]: s = the number of non-empty segments of rows before b plus
    its segment's slot, t = its place in its segment (module docstring)."""
    slot_BT = _doc_slots(segment_ids_BT, M)
    n_docs_B = slot_BT[:, -1] + 1
    before_B = jnp.cumsum(n_docs_B) - n_docs_B
    start_BT = jnp.take_along_axis(offsets_BM1, slot_BT, axis=1)
    return before_B[:, None] + slot_BT, jnp.arange(segment_ids_BT.shape[1])[None, :] - start_BT


def _btnh(qs):  # [B, K, G, Q, H] -> [B, Q, K * G, H]
    B, K, G, Q, H = qs.shape
    return qs.transpose(0, 3, 1, 2, 4).reshape(B, Q, K * G, H)


def _heads(x_BQNH, K: int):  # [B, Q, N, H] -> [B, K, G, Q, H]
    B, Q, N, H = x_BQNH.shape
    return x_BQNH.reshape(B, Q, K, N // K, H).transpose(0, 2, 3, 1, 4)


def _kv(k):  # [B, K, A, H] <-> [B, A, K, H]
    return k.transpose(0, 2, 1, 3)


class CudnnLayout(NamedTuple):
    """What cuDNN is given for a block: its mask type, sequence lengths and packed offsets
    (None where not used), where its statistics sit (`stats_at`: None, dense [B, N, Q];
    else (s_BQ, t_BQ, M) of `packed_rows`) and how far the keys are rotated (`k_shift_B`:
    a `before` block's visible keys moved to the front; None: not rotated)."""
    mask_type: object
    q_seqlen: jax.Array | None = None
    kv_seqlen: jax.Array | None = None
    q_offsets: jax.Array | None = None
    kv_offsets: jax.Array | None = None
    stats_at: tuple | None = None
    k_shift_B: jax.Array | None = None


def cudnn_layout(mask: BlockMask, max_docs: int) -> CudnnLayout:
    """cuDNN's arguments for a block (module docstring). A `before` block's one document
    is a padding mask over dense rows: queries [0, q_len), and the keys rotated so that
    [k_start, A) come first (kv_seqlen A - k_start); only a diagonal block with documents
    uses the packed layout."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    if mask.qseg_BQ is None:
        return CudnnLayout(MaskType.CAUSAL if mask.diagonal else MaskType.NO_MASK)
    if not mask.diagonal:
        A = mask.kseg_BA.shape[1]
        return CudnnLayout(MaskType.PADDING, mask.q_len_B, A - mask.k_start_B,
                           k_shift_B=mask.k_start_B)
    Q = mask.qseg_BQ.shape[1]
    offsets, lengths = packed_segments(mask.qseg_BQ, max_docs)
    M = lengths.shape[1]
    if M == 1:  # one slot: the whole chunk one sequence (not the packed layout)
        full_B = jnp.full(lengths.shape[:1], Q, jnp.int32)
        return CudnnLayout(MaskType.PADDING_CAUSAL, full_B, full_B)
    return CudnnLayout(MaskType.PADDING_CAUSAL, lengths, lengths, offsets, offsets,
                       (*packed_rows(mask.qseg_BQ, offsets, M), M))


def _rotate(k_BKAH, shift_B, sign: int = 1):
    """Keys rotated left by `shift_B` per row (sign -1: back), [B, K, A, H]."""
    A = k_BKAH.shape[2]
    idx_BA = (jnp.arange(A)[None, :] + sign * shift_B[:, None]) % A
    return jnp.take_along_axis(k_BKAH, idx_BA[:, None, :, None], axis=2)


def _stats_to_lse(stats, where, K: int):
    """cuDNN's statistics -> lse [B, K, G, Q, 1] (module docstring)."""
    if where is None:
        B, N, Q = stats.shape
        return stats.reshape(B, K, N // K, Q, 1)
    s_BQ, t_BQ, _ = where
    lse_BQN = stats[s_BQ, :, t_BQ]
    B, Q, N = lse_BQN.shape
    return lse_BQN.reshape(B, Q, K, N // K).transpose(0, 2, 3, 1)[..., None]


def _lse_to_stats(lse, where):
    """lse [B, K, G, Q, 1] -> cuDNN's statistics layout (the inverse of _stats_to_lse)."""
    B, K, G, Q, _ = lse.shape
    lse_BNQ = lse.reshape(B, K * G, Q)
    if where is None:
        return lse_BNQ
    s_BQ, t_BQ, M = where
    stats = jnp.zeros((B * M, K * G, Q), jnp.float32)
    return stats.at[s_BQ, :, t_BQ].set(lse_BNQ.transpose(0, 2, 1), mode="drop")


def _jax_sdpa():
    """(forward, backward) of cuDNN's fused attention as jax binds them: forward
    (q, k, v, **layout) -> (o, stats); backward (q, k, v, o, stats, do, **layout) ->
    (dq, dk, dv), BTNH, no bias or dropout."""
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention

    from olmo_jax import compat

    def fwd(q, k, v, **kw):
        return dot_product_attention(q, k, v, return_residual=True, **kw)

    return fwd, compat.cudnn_sdpa_bwd


@functools.cache
def cudnn_kernels(max_docs: int = 16, sdpa=None, packed_diagonal: bool = False) -> Kernels:
    """cuDNN's fused attention as the ring's block kernels (module docstring); `max_docs`:
    the packed layout's document slots of a diagonal block (model.cudnn_max_docs; more
    documents share the last slot, as in model/attention.cudnn_attention). `sdpa`: the
    (forward, backward) pair called (default `_jax_sdpa`: cuDNN; the tests pass an XLA
    emulation of cuDNN's masks to run this layout code on a CPU). `packed_diagonal`:
    diagonal blocks with documents on cuDNN's packed layout too (else XLA's block: the
    packed statistics' layout is unverified on a GPU, module docstring)."""
    sdpa_fwd, sdpa_bwd = sdpa or _jax_sdpa()

    def on_xla(mask):
        return mask.diagonal and mask.qseg_BQ is not None and not packed_diagonal

    def args(lay: CudnnLayout):
        return dict(q_seqlen=lay.q_seqlen, kv_seqlen=lay.kv_seqlen, q_offsets=lay.q_offsets,
                    kv_offsets=lay.kv_offsets, scale=1.0, mask_type=lay.mask_type)

    def keys(x, lay, sign=1):
        return x if lay.k_shift_B is None else _rotate(x, lay.k_shift_B, sign)

    def fwd(qs, k, v, mask):
        if on_xla(mask):
            return _xla_fwd(qs, k, v, mask)
        lay = cudnn_layout(mask, max_docs)
        o_BQNH, stats = sdpa_fwd(_btnh(qs), _kv(keys(k, lay)), _kv(keys(v, lay)), **args(lay))
        K = k.shape[1]
        return _heads(o_BQNH, K).astype(jnp.float32), _stats_to_lse(stats, lay.stats_at, K)

    def bwd(qs, k, v, mask, o, lse, do, delta):
        if on_xla(mask):
            return _xla_bwd(qs, k, v, mask, o, lse, do, delta)
        del delta  # cuDNN computes rowsum(do * o) from the global o itself
        lay = cudnn_layout(mask, max_docs)
        dq, dk, dv = sdpa_bwd(
            _btnh(qs), _kv(keys(k, lay)), _kv(keys(v, lay)), _btnh(o.astype(qs.dtype)),
            _lse_to_stats(lse, lay.stats_at), _btnh(do.astype(qs.dtype)), **args(lay))
        K = k.shape[1]
        return (_heads(dq, K).astype(jnp.float32),
                keys(_kv(dk), lay, -1).astype(jnp.float32),
                keys(_kv(dv), lay, -1).astype(jnp.float32))

    return Kernels("cudnn", fwd, bwd)



def kernels(blocks, max_docs: int = 16) -> Kernels | None:
    """The block kernels named `blocks` (RING_BLOCKS; a Kernels is kept); None for "xla"
    (the ring's own online softmax, module docstring)."""
    if isinstance(blocks, Kernels):
        return blocks
    if blocks == "cudnn":
        return cudnn_kernels(max_docs)
    if blocks == "reference":
        return REFERENCE
    if blocks == "xla":
        return None
    raise ValueError(f"ring blocks {blocks!r}: choose one of {RING_BLOCKS}")
