"""Context parallelism's kernels (olmo_jax/kernels/ring_attention.py): the zig-zag load
balancer against OLMo-core's `RingAttentionZigZagLoadBalancer.batch_shard` (by subprocess
in .venv-oracle), and ring / all-gather attention over a `context` mesh axis of 2 and 4
fake devices against a naive float32 reference, with and without segment ids (packed
documents, some crossing the shards' boundaries): outputs and the gradients of q, k, v
within 1e-5."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from olmo_jax.kernels import ring_blocks
from olmo_jax.kernels.ring_attention import (
    CONTEXT_ATTENTIONS,
    context_attention,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)
from tests.parallel.harness import FAST_COMPILE, rel_err

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
B, T, N, K, H = 2, 32, 4, 2, 8


def test_zigzag_matches_olmo_core(tmp_path):
    if not ORACLE_PY.exists():
        pytest.skip("no .venv-oracle (make oracle)")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, 3)).astype(np.float32)
    ids = rng.integers(0, 1000, (B, T)).astype(np.int64)
    sizes = (2, 4)
    np.savez(tmp_path / "in.npz", x=x, ids=ids, cp=np.array(sizes))
    subprocess.run([str(ORACLE_PY), str(ROOT / "tests" / "olmo_core" / "zigzag_oracle.py"),
                    str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], check=True, timeout=300)
    want = np.load(tmp_path / "out.npz")
    for C in sizes:
        shards = []
        for r in range(C):
            got_x = np.asarray(zigzag_shard(jnp.asarray(x), C, r))
            np.testing.assert_array_equal(got_x, want[f"x_{C}_{r}"])
            np.testing.assert_array_equal(np.asarray(zigzag_shard(jnp.asarray(ids), C, r)),
                                          want[f"ids_{C}_{r}"])
            np.testing.assert_array_equal(ids[:, zigzag_indices(T, C, r)], want[f"ids_{C}_{r}"])
            shards.append(got_x)
        np.testing.assert_array_equal(zigzag_unshard(shards), x)


def naive_segment_attention(q, k, v, seg, window=0):
    """Causal attention with a segment mask, one head at a time (kv heads repeated);
    `window` > 0: only the keys less than `window` positions back."""
    G, T, H = q.shape[2] // k.shape[2], q.shape[1], q.shape[3]
    d = np.arange(T)[:, None] - np.arange(T)[None, :]
    causal = (d >= 0) & (d < window) if window > 0 else d >= 0
    vis = jnp.asarray(causal)[None] & (seg[:, :, None] == seg[:, None, :])
    outs = []
    for n in range(q.shape[2]):
        s = jnp.einsum("bth,bsh->bts", q[:, :, n], k[:, :, n // G]) / np.sqrt(H)
        p = jax.nn.softmax(jnp.where(vis, s, -jnp.inf), axis=-1)
        outs.append(jnp.einsum("bts,bsh->bth", p, v[:, :, n // G]))
    return jnp.stack(outs, axis=2)


def _inputs():
    rng = np.random.default_rng(1)
    q, k, v, w = (rng.normal(size=s).astype(np.float32)
                  for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)))
    # Row 0: documents of 5, 11, 3 and 13 tokens (boundaries inside the zig-zag chunks of
    # C = 2 and 4); row 1: one document.
    seg = np.zeros((B, T), np.int32)
    seg[0] = np.repeat(np.arange(4), [5, 11, 3, 13])
    return q, k, v, w, seg


def _loss(attend, q, k, v, w, seg):
    return jnp.sum(attend(q, k, v, seg) * w)


@pytest.fixture(scope="module")
def reference():
    q, k, v, w, seg = _inputs()
    out = {}
    for masked in (False, True):
        s = jnp.asarray(seg if masked else np.zeros_like(seg))
        grads = jax.grad(lambda q, k, v, s=s: _loss(naive_segment_attention, q, k, v, w, s),
                         argnums=(0, 1, 2))(q, k, v)
        out[masked] = (naive_segment_attention(q, k, v, s), grads)
    return out


# (model.context_attention, the ring's hops, its blocks): the ring by collective-permutes,
# the ring by pair exchanges (all-gathers over pairs of ranks: under a pipeline), each with
# its own online softmax ("xla") and with the block-kernel interface that cuDNN's blocks
# implement, run by its XLA reference ("reference": per-block (o, lse) merged by
# log-sum-exp, the backward from the global O / LSE, a `before` block's one document),
# and the all-gather
IMPLS = [pytest.param(("ring", "permute", "xla"), marks=pytest.mark.jax011, id="ring"),
         pytest.param(("ring", "pairs", "xla"), marks=pytest.mark.jax011, id="ring-pairs"),
         pytest.param(("ring", "permute", "reference"), marks=pytest.mark.jax011,
                      id="ring-blocks"),
         pytest.param(("ring", "pairs", "reference"), id="ring-pairs-blocks"),
         *(pytest.param((i, "permute", "xla"), id=i) for i in CONTEXT_ATTENTIONS if i != "ring")]


@pytest.mark.parametrize("C", [2, 4])
@pytest.mark.parametrize("impl_hops", IMPLS)
def test_context_attention_matches_naive(impl_hops, C, reference):
    impl, hops, blocks = impl_hops
    q, k, v, w, seg = _inputs()
    mesh = Mesh(np.asarray(jax.devices()[:C]), ("context",))
    order = np.concatenate([zigzag_indices(T, C, r) for r in range(C)])  # rank-major layout
    spec = PartitionSpec(None, "context")

    def local(q, k, v, w, seg):
        out = {}
        for masked in (False, True):  # one program for both
            def attend(q, k, v, masked=masked):
                return context_attention(impl, q, k, v, seg if masked else None, context=C,
                                         hops=hops, blocks=blocks)
            grads = jax.grad(lambda q, k, v, a=attend: jnp.sum(a(q, k, v) * w),
                             argnums=(0, 1, 2))(q, k, v)
            out[masked] = (attend(q, k, v), grads)
        return out

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5,
                                out_specs={m: (spec, (spec,) * 3) for m in (False, True)}))
    args = [x[:, order] for x in (q, k, v, w, seg)]
    got = run.lower(*args).compile(FAST_COMPILE)(*args)
    inverse = np.argsort(order)
    for masked in (False, True):
        o, grads = got[masked]
        want_o, want_grads = reference[masked]
        errs = [rel_err(np.asarray(o)[:, inverse], want_o)]
        errs += [rel_err(np.asarray(g)[:, inverse], x)
                 for g, x in zip(grads, want_grads, strict=True)]
        print(impl, hops, blocks, C, masked, errs)
        assert all(e <= 1e-5 for e in errs), (masked, errs)  # a NaN fails too


def _poisoned(kern):
    """`kern`'s blocks with NaN wherever the block's mask leaves a row without keys (the
    forward's o and lse, the backward's dq) or a key without queries (dk, dv): what a
    kernel may return there (cuDNN leaves them unspecified)."""
    def rows(x, mask, Q, A):
        r, _, _ = ring_blocks.visible(mask, Q, A)
        return jnp.where(r[:, None, None, :, None], x, jnp.nan)

    def cols(x, mask, Q, A):
        _, c, _ = ring_blocks.visible(mask, Q, A)
        return jnp.where(c[:, None, :, None], x, jnp.nan)

    def fwd(qs, k, v, mask):
        o, lse = kern.fwd(qs, k, v, mask)
        Q, A = qs.shape[3], k.shape[2]
        return rows(o, mask, Q, A), rows(lse, mask, Q, A)

    def bwd(qs, k, v, mask, o, lse, do, delta):
        dq, dk, dv = kern.bwd(qs, k, v, mask, o, lse, do, delta)
        Q, A = qs.shape[3], k.shape[2]
        return rows(dq, mask, Q, A), cols(dk, mask, Q, A), cols(dv, mask, Q, A)

    return ring_blocks.Kernels("poisoned", fwd, bwd)


def _ring_errors(C: int, blocks, masked: bool, reference, label: str) -> list[float]:
    """Relative errors of the ring with `blocks` (output, then dq, dk, dv) on context C
    against one device's (`reference[masked]`), document-masked when `masked`."""
    q, k, v, w, seg = _inputs()
    mesh = Mesh(np.asarray(jax.devices()[:C]), ("context",))
    order = np.concatenate([zigzag_indices(T, C, r) for r in range(C)])
    spec = PartitionSpec(None, "context")

    def local(q, k, v, w, seg):
        def attend(q, k, v):
            return context_attention("ring", q, k, v, seg if masked else None, context=C,
                                     blocks=blocks)
        grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * w), argnums=(0, 1, 2))(
            q, k, v)
        return attend(q, k, v), grads

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5,
                                out_specs=(spec, (spec,) * 3)))
    args = [x[:, order] for x in (q, k, v, w, seg)]
    o, grads = run.lower(*args).compile(FAST_COMPILE)(*args)
    inverse = np.argsort(order)
    want_o, want_grads = reference[masked]
    errs = [rel_err(np.asarray(o)[:, inverse], want_o)]
    errs += [rel_err(np.asarray(g)[:, inverse], x) for g, x in zip(grads, want_grads, strict=True)]
    print(label, C, masked, errs)
    return errs


@pytest.mark.parametrize("C", [2, 4])
def test_ring_blocks_ignore_rows_and_keys_outside_the_mask(C, reference):
    # Document-masked blocks before the queries show one document; its rows and keys are
    # all the kernel's answer is taken from (ring_blocks.block_fwd / block_bwd): a kernel
    # answering NaN elsewhere gives the reference's output and gradients.
    errs = _ring_errors(C, _poisoned(ring_blocks.REFERENCE), True, reference, "poisoned")
    assert all(e <= 1e-5 for e in errs), errs  # a NaN fails too


def _cudnn_masks(B, T, S, q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type):
    """cuDNN's visibility [B, T, S] for jax's arguments (NO_MASK, CAUSAL, PADDING,
    PADDING_CAUSAL; dense rows with per-row lengths, or packed segments: offsets [B, M+1]
    and lengths [B, M], -1 unused), and each query's packed statistics row and column
    (segment s counted over the batch's non-empty slots, position in its segment)."""
    name = mask_type.name
    t_T, a_S = jnp.arange(T), jnp.arange(S)
    causal = "CAUSAL" in name
    if q_offsets is None:  # dense rows
        vis = jnp.ones((B, T, S), bool)
        if "PADDING" in name:
            vis &= (t_T[None, :, None] < q_seqlen[:, None, None])
            vis &= (a_S[None, None, :] < kv_seqlen[:, None, None])
        if causal:
            vis &= (t_T[:, None] >= a_S[None, :])[None]
        return vis, jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)), jnp.broadcast_to(t_T, (B, T))
    M = q_seqlen.shape[1]

    def slots(offsets, lengths, x):  # each position's segment slot and its start
        off = offsets[:, :M, None]
        member = (lengths[..., None] >= 0) & (x >= off) & (x < off + lengths[..., None])
        slot = jnp.argmax(member, axis=1)
        return member.any(1), slot, jnp.take_along_axis(offsets[:, :M], slot, axis=1)

    in_q, mq, start_q = slots(q_offsets, q_seqlen, t_T)
    in_k, mk, start_k = slots(kv_offsets, kv_seqlen, a_S)
    vis = in_q[:, :, None] & in_k[:, None, :] & (mq[:, :, None] == mk[:, None, :])
    if causal:
        vis &= (t_T - start_q)[:, :, None] >= (a_S - start_k)[:, None, :]
    ordinal_BM = (jnp.cumsum((q_seqlen >= 0).reshape(-1)) - 1).reshape(B, M)
    return vis, jnp.take_along_axis(ordinal_BM, mq, axis=1), t_T - start_q


def emulated_cudnn():
    """(forward, backward) with jax's cuDNN call signatures, in float32 XLA on the host:
    cuDNN's masks and statistics layout as olmo_jax/kernels/ring_blocks.py reads them, so
    the cuDNN block kernels' layout code (offsets, lengths, rotated keys, statistics
    gathered and scattered) runs on a CPU."""
    def scores(q, k, scale, **kw):
        B, T, N, H = q.shape
        S, K = k.shape[1], k.shape[2]
        vis, s_BT, t_BT = _cudnn_masks(B, T, S, **kw)
        kr = jnp.repeat(k, N // K, axis=2)
        s = jnp.einsum("btnh,bsnh->bnts", q, kr, preferred_element_type=jnp.float32) * scale
        return jnp.where(jnp.asarray(vis)[:, None], s, -1e30), vis, s_BT, t_BT

    def stats_shape(q, kw):
        B, T, N, _ = q.shape
        M = 1 if kw["q_offsets"] is None else kw["q_seqlen"].shape[1]
        return (B * M, N, T)

    def fwd(q, k, v, **kw):
        s, vis, s_BT, t_BT = scores(q, k, **kw)
        lse = jax.nn.logsumexp(s, axis=-1)  # [B, N, T]
        p = jnp.where(jnp.asarray(vis)[:, None], jnp.exp(s - lse[..., None]), 0.0)
        vr = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
        o = jnp.einsum("bnts,bsnh->btnh", p, vr.astype(jnp.float32))
        stats = jnp.zeros(stats_shape(q, kw), jnp.float32).at[s_BT, :, t_BT].set(
            lse.transpose(0, 2, 1))
        return o.astype(q.dtype), stats

    def bwd(q, k, v, o, stats, do, **kw):
        B, T, N, H = q.shape
        K = k.shape[2]
        s, vis, s_BT, t_BT = scores(q, k, **kw)
        lse = stats[s_BT, :, t_BT].transpose(0, 2, 1)  # [B, N, T]
        p = jnp.where(jnp.asarray(vis)[:, None], jnp.exp(s - lse[..., None]), 0.0)
        vr = jnp.repeat(v, N // K, axis=2).astype(jnp.float32)
        do32, o32 = do.astype(jnp.float32), o.astype(jnp.float32)
        dp = jnp.einsum("btnh,bsnh->bnts", do32, vr)
        ds = p * (dp - jnp.einsum("btnh,btnh->bnt", do32, o32)[..., None]) * kw["scale"]
        kr = jnp.repeat(k, N // K, axis=2).astype(jnp.float32)
        dq = jnp.einsum("bnts,bsnh->btnh", ds, kr)
        dk = jnp.einsum("bnts,btnh->bsnh", ds, q.astype(jnp.float32))
        dv = jnp.einsum("bnts,btnh->bsnh", p, do32)
        fold = lambda x: x.reshape(B, x.shape[1], K, N // K, H).sum(3)  # noqa: E731
        return dq, fold(dk), fold(dv)

    return fwd, bwd


@pytest.mark.parametrize("C", [2, 4])
@pytest.mark.parametrize("masked,packed", [(False, False), (True, True), (True, False)],
                         ids=["causal", "docs", "docs-xla-diagonal"])
def test_ring_on_cudnn_layout_matches_naive(C, masked, packed, reference):
    # The cuDNN block kernels (ring_blocks.cudnn_kernels: the packed segments of a diagonal
    # block, a block before its queries as a padding mask over rotated keys, the
    # statistics gathered for the merge and scattered back for the backward) with an
    # emulation of cuDNN's masks in cuDNN's place, and as a GPU plan runs them (diagonal
    # blocks with documents on XLA's block): the ring's output and gradients match one
    # device.
    blocks = ring_blocks.cudnn_kernels(max_docs=4, sdpa=emulated_cudnn(), packed_diagonal=packed)
    errs = _ring_errors(C, blocks, masked, reference, "emulated cudnn")
    assert all(e <= 1e-5 for e in errs), errs
