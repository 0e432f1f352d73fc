"""The LM head's cross-entropy and z-loss sums, chunked over tokens with their own VJP, so
no float32 [tokens, vocab] logits are ever held (model.lm_loss_chunk > 0).

    ce_sum, z_sum = chunked_lm_losses(h_SD, w_DV, targets_S, loss_S, chunk)

The forward computes each chunk's logits (h @ w, float32 accumulation), keeps only their
logsumexp per token, and sums lse - logit[target] and lse^2 over the tokens `loss_S`
marks. The backward recomputes each chunk's logits from h and w and forms the logits'
cotangent, g_ce * (softmax - onehot) + g_z * 2 lse * softmax, in float32, and its two
float32 GEMMs (as the whole-logits head's autodiff has them): dh per chunk, dw accumulated
over the chunks. The peak is one chunk's [chunk, vocab]
logits (and their cotangent) instead of the whole batch's; the head's FLOPs grow by one
recomputed forward GEMM (3 of the head's GEMMs become 4).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from olmo_jax.kernels.vma import cotangent_like


def _chunks(a, chunk: int, fill=0):
    """[S, ...] -> [n, chunk, ...], padded at the end with `fill`."""
    n = -(-a.shape[0] // chunk)
    pad = n * chunk - a.shape[0]
    if pad:
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
    return a.reshape(n, chunk, *a.shape[1:])


def _logits(h_CD, w_DV):
    return jnp.einsum("cd,dv->cv", h_CD, w_DV, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def chunked_lm_losses(h_SD: jax.Array, w_DV: jax.Array, targets_S: jax.Array,
                      loss_S: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """(sum of cross-entropy, sum of logsumexp^2) over the tokens `loss_S` marks. h_SD and
    w_DV in the compute dtype; targets_S int (any value where loss_S is False)."""
    return _forward(h_SD, w_DV, targets_S, loss_S, chunk)[0]


def _forward(h_SD, w_DV, targets_S, loss_S, chunk):
    tgt_nC = _chunks(jnp.maximum(targets_S, 0), chunk)
    mask_nC = _chunks(loss_S, chunk, fill=False)

    def body(_, xs):  # per-chunk sums as outputs, not a carry: inside shard_map a carry's
        h_CD, tgt_C, mask_C = xs  # initial value would need the inputs' varying axes
        logits_CV = _logits(h_CD, w_DV)
        lse_C = jax.nn.logsumexp(logits_CV, axis=-1)
        tgt_logit_C = jnp.take_along_axis(logits_CV, tgt_C[:, None], axis=-1)[:, 0]
        ce = jnp.sum(jnp.where(mask_C, lse_C - tgt_logit_C, 0.0))
        z = jnp.sum(jnp.where(mask_C, jnp.square(lse_C), 0.0))
        return None, (ce, z, lse_C)

    _, (ce_n, z_n, lse_nC) = jax.lax.scan(body, None, (_chunks(h_SD, chunk), tgt_nC, mask_nC))
    return (jnp.sum(ce_n), jnp.sum(z_n)), (h_SD, w_DV, targets_S, loss_S, lse_nC)


def _fwd(h_SD, w_DV, targets_S, loss_S, chunk):
    return _forward(h_SD, w_DV, targets_S, loss_S, chunk)


def _bwd(chunk, res, g):
    h_SD, w_DV, targets_S, loss_S, lse_nC = res
    g_ce, g_z = (x.astype(jnp.float32) for x in g)
    xs = (_chunks(h_SD, chunk), _chunks(jnp.maximum(targets_S, 0), chunk),
          _chunks(loss_S, chunk, fill=False), lse_nC)
    V = w_DV.shape[1]

    def grads(h_CD, tgt_C, mask_C, lse_C):
        """(this chunk's dw [D, V] float32, its dh [C, D])."""
        p_CV = jnp.exp(_logits(h_CD, w_DV) - lse_C[:, None])
        onehot_CV = jax.nn.one_hot(tgt_C, V, dtype=jnp.float32)
        coef_C = jnp.where(mask_C, 1.0, 0.0)
        dlogits_CV = coef_C[:, None] * (g_ce * (p_CV - onehot_CV)
                                        + (g_z * 2.0 * lse_C)[:, None] * p_CV)
        # float32 GEMMs, as the whole-logits head's autodiff runs them (its float32 logits'
        # cotangent against the upcast weights): bfloat16 gradients then agree to ~1e-4
        dh_CD = jnp.einsum("cv,dv->cd", dlogits_CV, w_DV.astype(jnp.float32))
        dw_DV = jnp.einsum("cd,cv->dv", h_CD.astype(jnp.float32), dlogits_CV)
        return dw_DV, dh_CD.astype(h_SD.dtype)

    # The first chunk's dw starts the sum: the accumulator then has the type (inside
    # shard_map: the varying axes) of what it accumulates.
    dw_DV, dh_CD = grads(*(x[0] for x in xs))
    dh_nCD = dh_CD[None]
    if lse_nC.shape[0] > 1:
        def body(dw_DV, xs):
            dw, dh_CD = grads(*xs)
            return dw_DV + dw, dh_CD

        dw_DV, dh_rest = jax.lax.scan(body, dw_DV, tuple(x[1:] for x in xs))
        dh_nCD = jnp.concatenate([dh_nCD, dh_rest])
    dh_SD = dh_nCD.reshape(-1, h_SD.shape[1])[: h_SD.shape[0]]
    # typed like their primals inside shard_map: the weight's cotangent summed over the axes
    # the activations vary over and it does not (kernels/vma.py)
    return (cotangent_like(dh_SD, h_SD), cotangent_like(dw_DV.astype(w_DV.dtype), w_DV),
            None, None)


chunked_lm_losses.defvjp(_fwd, _bwd)
