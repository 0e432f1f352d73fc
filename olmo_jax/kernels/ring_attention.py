"""Context parallelism's kernels: the zig-zag load balancer and causal attention over a
sequence split across the `context` mesh axis (inside `jax.shard_map`).

Zig-zag layout (OLMo-core's `RingAttentionZigZagLoadBalancer.batch_shard`): a sequence of
T tokens is cut into 2C chunks of L = T / (2C); context rank r holds chunks r and
2C - 1 - r, concatenated ([2L] local tokens). Every rank then has the same share of the
causal triangle's work. RoPE positions are the global token indices of the local tokens
(`zigzag_positions`), computed before any model code runs.

Two attention implementations over that layout (`CONTEXT_ATTENTIONS`), both exact
float32 softmax(q k^T / sqrt(H)) v with the causal mask taken from the global positions
and an optional segment mask (a query sees only keys with its segment id: packed
documents that do not see each other), grouped-query heads:

  ring       K and V (and the keys' segment ids) travel around the ring by
             `jax.lax.ppermute`, one hop per step, C - 1 hops; each step adds one block
             to an online softmax. Zig-zag makes every step after the first two [L, L]
             blocks on every rank (rank r, keys from rank j: j < r, both query chunks
             see key chunk j; j > r, query chunk 2C-1-r sees both key chunks), the
             first step (its own keys) three; nothing else is computed. The backward
             pass (custom VJP) recomputes each block's probabilities from the saved
             log-sum-exp; dK and dV travel with K and V and arrive home after C hops.
             No device ever holds the whole sequence's K, V or scores. Under a
             pipeline (hops="pairs", a power-of-two C) the K/V visit the ranks in
             Gray-code order instead, each hop a swap inside pairs of ranks by an
             all-gather over two-rank replica groups: a stage runs it in a branch the
             other stages skip, where a collective-permute (one collective over every
             device of the mesh) would meet the other stages' collectives.
  allgather  K and V all-gathered over `context` (MaxText's approach), then one masked
             block of the local queries against all T keys; its VJP reduce-scatters
             dK and dV (the transpose of the all-gather). Simple, but each device
             holds the whole sequence's K and V and a [2L, T] score block, half of it
             masked.

Under a sliding window neither computes what the window does not reach: the ring runs
each [L, L] block under a `lax.cond` on `block_in_window`, the all-gather meets each
chunk of L queries with only the L + W - 1 keys that reach it.

The ring's blocks (`blocks`, RING_BLOCKS; the model passes "cudnn" where its attention
core resolved to cuDNN, else "xla"): "xla", einsums of float32 scores folded into an
online softmax (any device, any window); "cudnn", cuDNN's fused flash attention per
block through the block-kernel interface of kernels/ring_blocks.py (each step's block is
diagonal or wholly before its queries; the blocks' (o, lse) merged by log-sum-exp
weights, each block's backward from the global output and log-sum-exp); "reference",
that interface's XLA implementation (the CPU tests). A sliding-window layer always runs
"xla" (cuDNN's window is not offset for the blocks off the diagonal), and so does the
all-gather.

The kernels run inside a shard_map whose mesh has `axis_name`; outside one, with
`context == 1`, the layout is the identity and the kernels are plain attention.
"""

from __future__ import annotations

from functools import partial
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from olmo_jax.kernels import ring_blocks
from olmo_jax.kernels.ring_blocks import RingBlocks
from olmo_jax.kernels.vma import cotangent_like, like

CONTEXT_AXIS = "context"  # the mesh axis name (olmo_jax/parallel/mesh.py uses this one)
ContextAttention = Literal["ring", "allgather"]  # model.context_attention
CONTEXT_ATTENTIONS = get_args(ContextAttention)
RingHops = Literal["permute", "pairs"]  # model.context_ring_hops (set by the plan)
RING_HOPS = get_args(RingHops)
_MASKED = ring_blocks.MASKED  # a score no query sees


# ---- the zig-zag load balancer ---------------------------------------------------------
def zigzag_indices(T: int, C: int, rank: int) -> np.ndarray:
    """The global token indices context rank `rank` of `C` holds, in local order."""
    if T % (2 * C):
        raise ValueError(f"sequence length {T} must be divisible by 2 x context = {2 * C}")
    L = T // (2 * C)
    return np.concatenate([np.arange(rank * L, (rank + 1) * L),
                           np.arange((2 * C - 1 - rank) * L, (2 * C - rank) * L)])


def zigzag_positions(T: int, C: int, rank) -> jax.Array:
    """zigzag_indices with a traced rank (jax.lax.axis_index), int32 [2L]."""
    L = T // (2 * C)
    ar = jnp.arange(L, dtype=jnp.int32)
    return jnp.concatenate([rank * L + ar, (2 * C - 1 - rank) * L + ar])


def zigzag_shard(x, C: int, rank, axis: int = 1):
    """The local zig-zag shard of `x` along `axis` (size T): chunks rank and 2C-1-rank of
    2C. `rank` may be traced (inside shard_map: jax.lax.axis_index(CONTEXT_AXIS))."""
    if C == 1:
        return x
    T = x.shape[axis]
    if T % (2 * C):
        raise ValueError(f"sequence length {T} must be divisible by 2 x context = {2 * C}")
    L = T // (2 * C)
    first = jax.lax.dynamic_slice_in_dim(x, rank * L, L, axis)
    second = jax.lax.dynamic_slice_in_dim(x, (2 * C - 1 - rank) * L, L, axis)
    return jnp.concatenate([first, second], axis=axis)


def zigzag_unshard(shards, axis: int = 1):
    """The inverse on the host: `shards[r]` rank r's local arrays -> the whole sequence."""
    C = len(shards)
    halves = [np.split(np.asarray(s), 2, axis=axis) for s in shards]
    chunks = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return np.concatenate(chunks, axis=axis) if C > 1 else np.asarray(shards[0])


# ---- one masked block --------------------------------------------------------------------
def _scores(qs_BKGQH, k_BKAH, qpos_Q, kpos_A, qseg_BQ, kseg_BA, window=0):
    """Float32 scores of pre-scaled queries, and the visibility mask [B, 1, 1, Q, A]
    (`window` > 0: also only the keys less than `window` positions back)."""
    s = jnp.einsum("bkgqh,bkah->bkgqa", qs_BKGQH, k_BKAH, preferred_element_type=jnp.float32)
    causal_QA = qpos_Q[:, None] >= kpos_A[None, :]
    if window > 0:
        causal_QA &= qpos_Q[:, None] - kpos_A[None, :] < window
    vis = causal_QA[None, None, None]
    if qseg_BQ is not None:
        vis = vis & (qseg_BQ[:, :, None] == kseg_BA[:, None, :])[:, None, None]
    return jnp.where(vis, s, _MASKED), vis


def _block_fwd(qs, k, v, qpos, kpos, qseg, kseg, state, window=0):
    """One online-softmax step: state (m, l, acc) of the queries, updated with a key block."""
    m, l, acc = state
    s, vis = _scores(qs, k, qpos, kpos, qseg, kseg, window)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1, keepdims=True)
    acc = acc * corr + jnp.einsum("bkgqa,bkah->bkgqh", p.astype(v.dtype), v,
                                  preferred_element_type=jnp.float32)
    return m_new, l, acc


def _block_bwd(qs, k, v, qpos, kpos, qseg, kseg, lse, do, delta, window=0):
    """dq (of the pre-scaled queries), dk, dv of one key block, in float32."""
    s, vis = _scores(qs, k, qpos, kpos, qseg, kseg, window)
    return ring_blocks.grads_from_probs(jnp.where(vis, jnp.exp(s - lse), 0.0), qs, k, v, do,
                                        delta)


def block_in_window(qpos_Q, kpos_A, window: int):
    """Whether some query of a block sees some key of it under the causal sliding window
    (0 <= q - k < `window`), for blocks of contiguous positions (each zig-zag chunk is):
    q - k then takes every integer between its extremes. A traced bool."""
    d_hi = jnp.max(qpos_Q) - jnp.min(kpos_A)
    d_lo = jnp.min(qpos_Q) - jnp.max(kpos_A)
    return (d_hi >= 0) & (d_lo < window)


def _in_window_only(block, empty):
    """`block(qs, k, v, qpos, kpos, qseg, kseg, *rest, window)` run only where the block
    has a key inside a query's window; elsewhere `empty(qs, k, *rest)` (what a fully masked block
    gives: the online-softmax state unchanged, zero gradients), so a sliding-window layer
    under the ring computes the blocks its window reaches and skips the rest (a
    `lax.cond` per block; the K/V still travel the whole ring). Both branches are typed
    varying over every input's mesh axes (`like`)."""
    def run(qs, k, v, qpos, kpos, qseg, kseg, *rest, window=0):
        if window <= 0:
            return block(qs, k, v, qpos, kpos, qseg, kseg, *rest, window=window)
        inputs = jax.tree.leaves((qs, k, v, qpos, kpos, qseg, kseg, rest))  # None: no leaf

        def typed(out):
            return jax.tree.map(lambda x: like(x, *inputs), out)

        return jax.lax.cond(
            block_in_window(qpos, kpos, window),
            lambda: typed(block(qs, k, v, qpos, kpos, qseg, kseg, *rest, window=window)),
            lambda: typed(empty(qs, k, *rest)))
    return run


def _keep_state(qs, k, state):
    return state


def _zero_grads(qs, k, lse, do, delta):
    zeros = jnp.zeros
    return (zeros(qs.shape, jnp.float32), zeros(k.shape, jnp.float32),
            zeros(k.shape, jnp.float32))


_ring_block_fwd = _in_window_only(_block_fwd, _keep_state)
_ring_block_bwd = _in_window_only(_block_bwd, _zero_grads)


def _init_state(q):
    shape = q.shape[:-1] + (1,)
    m = like(jnp.full(shape, _MASKED, jnp.float32), q)
    return m, like(jnp.zeros(shape, jnp.float32), q), like(jnp.zeros(q.shape, jnp.float32), q)


def _heads(q_BTNH, k_BTKH):
    """[B, T, N, H] -> [B, K, G, T, H] (query head n = kv * G + g) and k -> [B, K, T, H]."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    return q_BTNH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)


def _kv_heads(x_BTKH):
    return x_BTKH.transpose(0, 2, 1, 3)


def _scaled(q):
    return q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)


def _where(c, a, b):
    return jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)


# ---- ring attention ----------------------------------------------------------------------
def ring_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT=None, *, context: int,
                   axis_name: str = CONTEXT_AXIS, window: int = 0, hops: RingHops = "permute",
                   blocks: RingBlocks = "xla", max_docs: int = 16):
    """Causal attention of this rank's zig-zag shard ([B, 2L, ...], module docstring) with
    K / V passed around `axis_name` (size `context`); out [B, 2L, N, H] in q's dtype.
    `segment_ids_BT`: int32 [B, 2L] sharded like q, or None (no document masking);
    `window` > 0: a sliding window of that many keys (masked in each block; the blocks it
    does not reach are skipped); `hops` (RING_HOPS): how K/V travel, "permute" around
    the ring or "pairs" by pair exchanges (`_ring_loop`; a power-of-two `context`);
    `blocks` (RING_BLOCKS): the [L, L] blocks' kernels, XLA's einsums (an online softmax)
    or cuDNN's fused attention (kernels/ring_blocks.py; `max_docs` document slots of a
    diagonal block); a sliding window always runs XLA's blocks (module docstring)."""
    if hops not in RING_HOPS or (hops == "pairs" and not pairs_possible(context)):
        raise ValueError(f"hops={hops!r} over context={context}: choose one of {RING_HOPS} "
                         "(pairs: a power-of-two context)")
    seg = segment_ids_BT if segment_ids_BT is not None else jnp.zeros(q_BTNH.shape[:2], jnp.int32)
    kern = ring_blocks.kernels(blocks, max_docs)  # refuses an unknown name
    kern = kern if window <= 0 else None  # windows: XLA's blocks (module docstring)
    o = _ring(q_BTNH, k_BTKH, v_BTKH, seg, context, axis_name, segment_ids_BT is not None,
              window, hops == "pairs", kern)
    return o


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _ring(q, k, v, seg, C, axis, masked, window=0, pairs=False, kern=None):
    return _ring_fwd(q, k, v, seg, C, axis, masked, window, pairs, kern)[0]


def _fwd_blocks(kern, window: int, masked: bool):
    """(init(qs), block(diagonal, qs, k, v, qpos, kpos, qseg, kseg, state), finish(state)
    -> (o, lse)) of the ring's forward: XLA's online softmax over the blocks (`kern`
    None), or a block kernel's (o, lse) per block merged by log-sum-exp weights."""
    def msk(x):
        return x if masked else None

    if kern is None:
        fwd = partial(_ring_block_fwd, window=window)

        def finish(st):
            m, l, acc = st
            return acc / l, m + jnp.log(l)

        return (_init_state, lambda diag, qs, k, v, qp, kp, qs_, ks_, st: fwd(
            qs, k, v, qp, kp, msk(qs_), msk(ks_), st), finish)

    def init(qs):
        return tuple(like(x, qs) for x in ring_blocks.init_state(qs))

    def block(diag, qs, k, v, qp, kp, qseg, kseg, st):
        mask = ring_blocks.block_mask(diag, msk(qseg), msk(kseg))
        out = ring_blocks.block_fwd(kern, qs, k, v, mask)
        return ring_blocks.merge(st, tuple(like(x, qs, k) for x in out))

    return init, block, lambda st: st


def _bwd_block(kern, window: int, masked: bool):
    """block(diagonal, qs, k, v, qpos, kpos, qseg, kseg, o, lse, do, delta) -> (dqs, dk,
    dv) of one block with the global o / lse / delta (XLA's or the kernel's)."""
    def msk(x):
        return x if masked else None

    if kern is None:
        bwd = partial(_ring_block_bwd, window=window)
        return lambda diag, qs, k, v, qp, kp, qseg, kseg, o, lse, do, dl: bwd(
            qs, k, v, qp, kp, msk(qseg), msk(kseg), lse, do, dl)

    def block(diag, qs, k, v, qp, kp, qseg, kseg, o, lse, do, dl):
        mask = ring_blocks.block_mask(diag, msk(qseg), msk(kseg))
        out = ring_blocks.block_bwd(kern, qs, k, v, mask, o, lse, do, dl)
        return tuple(like(x, qs, k, do) for x in out)

    return block


def _halves(x, axis):
    n = x.shape[axis] // 2
    return (jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis))


def _perm(C):
    return [(i, (i + 1) % C) for i in range(C)]


def pairs_possible(C: int) -> bool:
    """Whether the ring can hop by pair exchanges (`hops="pairs"`): C a power of two."""
    return C >= 1 and C & (C - 1) == 0


def _exchange(tree, axis, C: int, bit: int):
    """Every leaf of `tree` from context rank r ^ `bit` (a swap inside each pair of ranks
    {i, i ^ bit}): an all-gather over the pair's replica group, the partner's half kept.
    The groups stay inside the rest of the mesh's coordinates (a pipeline stage), so a
    stage may run it in a branch the other stages skip; the bytes each rank receives are
    the permute's."""
    groups = [[i, i ^ bit] for i in range(C) if not i & bit]
    mine = (jax.lax.axis_index(axis) // bit) % 2  # this rank's place in its pair's group

    def one(x):
        both = jax.lax.all_gather(x, axis, axis_index_groups=groups)
        return like(jax.lax.dynamic_index_in_dim(both, 1 - mine, 0, keepdims=False), x)
    return jax.tree.map(one, tree)


def _gray(s: int) -> int:
    return s ^ (s >> 1)


def _hop(C, axis, pairs: bool, s: int = 1):
    """The hop that moves a rank's K/V (and the backward's dK / dV) from where step s - 1
    of `_ring_loop` read them to where step s reads them; s = C: home, to the rank they
    came from. The ring (`pairs` False): one collective-permute to rank r + 1, whatever s.
    Pairs: step s reads rank r ^ gray(s)'s keys (the Gray code visits every rank once),
    so the hop into step s swaps pairs of ranks differing in gray(s - 1) ^ gray(s) (the
    lowest set bit of s), and home swaps by gray(C - 1) = C / 2."""
    if not pairs:
        return lambda x: jax.lax.ppermute(x, axis, _perm(C))
    bit = _gray(C - 1) if s == C else _gray(s - 1) ^ _gray(s)
    return partial(_exchange, axis=axis, C=C, bit=bit)


def _ring_setup(q, seg, C, axis):
    r = jax.lax.axis_index(axis)
    T = 2 * C * (q.shape[1] // 2)
    pos = zigzag_positions(T, C, r)
    return r, pos


def _ring_loop(C, axis, src, state, step0, step, pairs: bool = False):
    """step0(src, state) -> (rest, state) on this rank's own K/V `src`, then
    step(src, rest, j, state, hop) for the K/V of the other C - 1 ranks j, `src` passed
    one hop before each (`hop`, which the step applies to what travels with the K/V:
    `rest`, e.g. the backward pass's dK / dV). The ring: j = r-1, ..., r-C+1, hops by
    collective-permute, steps 1..C-2 a `lax.scan` (one step's blocks alive at a time).
    `pairs`: j = r ^ gray(s), hops by pair exchanges (`_hop`), the steps unrolled (each
    hop has its own replica groups). Each hop is issued before the step it does not
    feed, so XLA may overlap it with that step's matmuls."""
    r = jax.lax.axis_index(axis)
    if pairs:
        nxt = _hop(C, axis, True, 1)(src) if C > 1 else None
        rest, state = step0(src, state)
        for s in range(1, C):
            src = nxt
            if s < C - 1:
                nxt = _hop(C, axis, True, s + 1)(src)  # the next step's K/V (prefetch)
            rest, state = step(src, rest, r ^ _gray(s), state, _hop(C, axis, True, s))
        return rest, state
    hop = _hop(C, axis, False)
    nxt = hop(src) if C > 1 else None
    rest, state = step0(src, state)
    if C == 1:
        return rest, state

    def body(carry, s):
        src, rest, state = carry
        nxt = hop(src)  # the next step's K/V (prefetch)
        rest, state = step(src, rest, (r - s) % C, state, hop)
        return (nxt, rest, state), None

    carry = (nxt, rest, state)
    if C > 2:
        carry, _ = jax.lax.scan(body, carry, jnp.arange(1, C - 1))
    src, rest, state = carry
    return step(src, rest, (r - (C - 1)) % C, state, hop)


def _key_parts(kv_src, j, Lk, C):
    ks, vs, kseg = kv_src
    kpos = zigzag_positions(2 * C * Lk, C, j)
    return _halves(ks, 2), _halves(vs, 2), _halves(kpos, 0), _halves(kseg, 1)


def _ring_fwd(q, k, v, seg, C, axis, masked, window=0, pairs=False, kern=None):
    init, block, finish = _fwd_blocks(kern, window, masked)
    r, pos = _ring_setup(q, seg, C, axis)
    qs = _scaled(_heads(q, k))  # [B, K, G, 2L, H]
    kh, vh = _kv_heads(k), _kv_heads(v)
    Lk = kh.shape[2] // 2
    qh0, qh1 = _halves(qs, 3)
    p0, p1 = _halves(pos, 0)
    s0, s1 = _halves(seg, 1)

    def step0(kv, state):  # own keys: both diagonal blocks (causal) and chunk 2C-1-r x r
        st0, st1 = state
        (k0, k1), (v0, v1), (kp0, kp1), (ks0, ks1) = _key_parts(kv, r, Lk, C)
        st1 = block(False, qh1, k0, v0, p1, kp0, s1, ks0, st1)
        st0 = block(True, qh0, k0, v0, p0, kp0, s0, ks0, st0)
        st1 = block(True, qh1, k1, v1, p1, kp1, s1, ks1, st1)
        return (), (st0, st1)

    def step(kv, rest, j, state, hop):
        # Keys of rank j != r: query chunk 2C-1-r sees key chunk j; and j < r: query chunk
        # r sees key chunk j too; j > r: chunk 2C-1-r sees 2C-1-j too. All keys before
        # all queries (no diagonal block).
        st0, st1 = state
        (k0, k1), (v0, v1), (kp0, kp1), (ks0, ks1) = _key_parts(kv, j, Lk, C)
        st1 = block(False, qh1, k0, v0, p1, kp0, s1, ks0, st1)
        lo = j < r
        qx, px, sx = _where(lo, (qh0, p0, s0), (qh1, p1, s1))
        kx, vx, kpx, ksx = _where(lo, (k0, v0, kp0, ks0), (k1, v1, kp1, ks1))
        stx = block(False, qx, kx, vx, px, kpx, sx, ksx, _where(lo, st0, st1))
        return rest, (_where(lo, stx, st0), _where(lo, st1, stx))

    _, (st0, st1) = _ring_loop(C, axis, (kh, vh, seg), (init(qh0), init(qh1)),
                               step0, step, pairs)
    (o0, lse0), (o1, lse1) = finish(st0), finish(st1)
    o_h = jnp.concatenate([o0, o1], axis=3).astype(q.dtype)  # [B, K, G, 2L, H]
    lse = jnp.concatenate([lse0, lse1], axis=3)
    B, T2, N, H = q.shape
    o = o_h.transpose(0, 3, 1, 2, 4).reshape(B, T2, N, H)
    return o, (q, k, v, seg, o_h, lse)


def _ring_bwd(C, axis, masked, window, pairs, kern, res, do):
    block = _bwd_block(kern, window, masked)
    q, k, v, seg, o_h, lse = res
    r, pos = _ring_setup(q, seg, C, axis)
    qs = _scaled(_heads(q, k))
    do_h = _heads(do, k)
    delta = jnp.sum(do_h.astype(jnp.float32) * o_h.astype(jnp.float32), axis=-1, keepdims=True)
    qh0, qh1 = _halves(qs, 3)
    o0, o1 = _halves(o_h, 3)
    do0, do1 = _halves(do_h, 3)
    dl0, dl1 = _halves(delta, 3)
    ls0, ls1 = _halves(lse, 3)
    p0, p1 = _halves(pos, 0)
    s0, s1 = _halves(seg, 1)
    kh, vh = _kv_heads(k), _kv_heads(v)
    Lk = kh.shape[2] // 2
    dq0 = like(jnp.zeros(qh0.shape, jnp.float32), q, k)
    dq1 = like(jnp.zeros(qh1.shape, jnp.float32), q, k)
    zero_kv = like(jnp.zeros(kh.shape, jnp.float32), k, q)

    def add(dkv, d0, d1):
        """dK or dV [B, K, 2L, H] plus the two halves' contributions."""
        a, b = _halves(dkv, 2)
        return jnp.concatenate([a + d0, b + d1], axis=2)

    def step0(kv, state):
        dq0, dq1 = state
        (k0, k1), (v0, v1), (kp0, kp1), (ks0, ks1) = _key_parts(kv, r, Lk, C)
        a1, b1, c1 = block(False, qh1, k0, v0, p1, kp0, s1, ks0, o1, ls1, do1, dl1)
        a0, b0, c0 = block(True, qh0, k0, v0, p0, kp0, s0, ks0, o0, ls0, do0, dl0)
        a2, b2, c2 = block(True, qh1, k1, v1, p1, kp1, s1, ks1, o1, ls1, do1, dl1)
        dk = add(zero_kv, b1 + b0, b2)
        dv = add(zero_kv, c1 + c0, c2)
        return (dk, dv), (dq0 + a0, dq1 + a1 + a2)

    def step(src, rest, j, state, hop):
        dq0, dq1 = state
        dk, dv = rest
        # the K/V gradients of the last step's keys travel the hop that brought rank j's
        dk, dv = hop((dk, dv))
        (k0, k1), (v0, v1), (kp0, kp1), (ks0, ks1) = _key_parts(src, j, Lk, C)
        a1, b1, c1 = block(False, qh1, k0, v0, p1, kp0, s1, ks0, o1, ls1, do1, dl1)
        lo = j < r
        qx, px, sx, ox, lx, dox, dlx = _where(lo, (qh0, p0, s0, o0, ls0, do0, dl0),
                                              (qh1, p1, s1, o1, ls1, do1, dl1))
        kx, vx, kpx, ksx = _where(lo, (k0, v0, kp0, ks0), (k1, v1, kp1, ks1))
        a, b, c_ = block(False, qx, kx, vx, px, kpx, sx, ksx, ox, lx, dox, dlx)
        zero = jnp.zeros_like(b)
        dk = add(dk, b1 + jnp.where(lo, b, zero), jnp.where(lo, zero, b))
        dv = add(dv, c1 + jnp.where(lo, c_, zero), jnp.where(lo, zero, c_))
        dq0 = jnp.where(lo, dq0 + a, dq0)
        dq1 = dq1 + a1 + jnp.where(lo, jnp.zeros_like(a), a)
        return (dk, dv), (dq0, dq1)

    (dk, dv), (dq0, dq1) = _ring_loop(C, axis, (kh, vh, seg), (dq0, dq1), step0, step, pairs)
    if C > 1:  # home: the gradients of this rank's keys, from where the last step read them
        dk, dv = _hop(C, axis, pairs, C)((dk, dv))
    B, T2, N, H = q.shape
    dqs = jnp.concatenate([dq0, dq1], axis=3)
    dq = _scaled(dqs).transpose(0, 3, 1, 2, 4).reshape(B, T2, N, H)
    dk, dv = (x.transpose(0, 2, 1, 3) for x in (dk, dv))
    return (cotangent_like(dq.astype(q.dtype), q), cotangent_like(dk.astype(k.dtype), k),
            cotangent_like(dv.astype(v.dtype), v), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---- all-gather attention ------------------------------------------------------------------
def allgather_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT=None, *, context: int,
                        axis_name: str = CONTEXT_AXIS, window: int = 0):
    """The same result as ring_attention: K, V (and the keys' segment ids) all-gathered over
    `axis_name`, one masked block against the whole sequence (a sliding window: against
    the keys it reaches, `_window_slices`); autodiff turns the gather into dK / dV
    reduce-scatters."""
    r = jax.lax.axis_index(axis_name)
    T = q_BTNH.shape[1] * context
    qpos = zigzag_positions(T, context, r)
    kpos = jnp.concatenate([zigzag_positions(T, context, j) for j in range(context)])
    k_all = jax.lax.all_gather(k_BTKH, axis_name, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v_BTKH, axis_name, axis=1, tiled=True)
    masked = segment_ids_BT is not None
    seg = segment_ids_BT if masked else jnp.zeros(q_BTNH.shape[:2], jnp.int32)
    kseg = jax.lax.all_gather(seg, axis_name, axis=1, tiled=True)
    L = q_BTNH.shape[1] // 2
    if window <= 0 or L + window - 1 >= T:
        return _masked_attention(q_BTNH, k_all, v_all, qpos, kpos, seg, kseg, masked, window)
    return _window_slices(q_BTNH, (k_all, v_all, kseg), qpos, seg, T, context, masked, window)


def _window_slices(q_BTNH, gathered, qpos, seg, T: int, C: int, masked: bool, window: int):
    """All-gather attention under a sliding window that reaches less than the sequence:
    the gathered K, V and key segments put back in sequence order, and each local chunk
    of L queries (positions a .. a + L - 1) attends to the L + window - 1 keys that can
    reach it (a - window + 1 .. a + L - 1, clamped at the start), not to all T: two
    [L, L + window - 1] blocks instead of one [2L, T]. Autodiff scatters each slice's dK /
    dV back into the sequence and the gather's transpose reduce-scatters them."""
    S = q_BTNH.shape[1] // 2 + window - 1  # the keys that reach a chunk of L queries
    in_sequence = np.argsort(np.concatenate([zigzag_indices(T, C, j) for j in range(C)]))
    k_seq, v_seq, kseg_seq = (x[:, in_sequence] for x in gathered)
    outs = []
    for q_half, qpos_half, seg_half in zip(_halves(q_BTNH, 1), _halves(qpos, 0), _halves(seg, 1),
                                           strict=True):
        start = jnp.maximum(qpos_half[0] - (window - 1), 0)
        k, v, kseg = (jax.lax.dynamic_slice_in_dim(x, start, S, axis=1)
                      for x in (k_seq, v_seq, kseg_seq))
        kpos = start + jnp.arange(S, dtype=jnp.int32)
        outs.append(_masked_attention(q_half, k, v, qpos_half, kpos, seg_half, kseg, masked, window))
    return jnp.concatenate(outs, axis=1)


@partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _masked_attention(q, k, v, qpos, kpos, qseg, kseg, masked, window=0):
    return _masked_fwd(q, k, v, qpos, kpos, qseg, kseg, masked, window)[0]


def _masked_fwd(q, k, v, qpos, kpos, qseg, kseg, masked, window=0):
    qs = _scaled(_heads(q, k))
    kh, vh = _kv_heads(k), _kv_heads(v)
    sq, sk = (qseg, kseg) if masked else (None, None)
    m, l, acc = _block_fwd(qs, kh, vh, qpos, kpos, sq, sk, _init_state(qs), window)
    o_h = (acc / l).astype(q.dtype)
    B, T, N, H = q.shape
    o = o_h.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
    return o, (q, k, v, qpos, kpos, qseg, kseg, o_h, m + jnp.log(l))


def _masked_bwd(masked, window, res, do):
    q, k, v, qpos, kpos, qseg, kseg, o_h, lse = res
    qs = _scaled(_heads(q, k))
    do_h = _heads(do, k)
    delta = jnp.sum(do_h.astype(jnp.float32) * o_h.astype(jnp.float32), axis=-1, keepdims=True)
    sq, sk = (qseg, kseg) if masked else (None, None)
    dqs, dk, dv = _block_bwd(qs, _kv_heads(k), _kv_heads(v), qpos, kpos, sq, sk, lse, do_h,
                             delta, window)
    B, T, N, H = q.shape
    dq = _scaled(dqs).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
    dk, dv = (x.transpose(0, 2, 1, 3) for x in (dk, dv))
    return (cotangent_like(dq.astype(q.dtype), q), cotangent_like(dk.astype(k.dtype), k),
            cotangent_like(dv.astype(v.dtype), v), None, None, None, None)


_masked_attention.defvjp(_masked_fwd, _masked_bwd)


def context_attention(impl: str, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT=None, *,
                      context: int, axis_name: str = CONTEXT_AXIS, window: int = 0,
                      hops: RingHops = "permute", blocks: RingBlocks = "xla",
                      max_docs: int = 16):
    """`impl` (CONTEXT_ATTENTIONS) of this rank's zig-zag shard (`window` > 0: sliding;
    `hops`, `blocks`, `max_docs`: the ring's, ring_attention; the all-gather runs XLA's
    blocks)."""
    if impl == "ring":
        return ring_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, context=context,
                              axis_name=axis_name, window=window, hops=hops, blocks=blocks,
                              max_docs=max_docs)
    return allgather_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, context=context,
                               axis_name=axis_name, window=window)
