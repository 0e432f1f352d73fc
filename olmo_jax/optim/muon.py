"""Muon: momentum orthogonalized by Newton-Schulz, on the model's weight matrices.

    updates = muon_transform(...)  # inside optax.partition with AdamW for the rest

Which parameters are matrices (`matrix_dims`, by leaf name): the attention projections
q/k/v_proj [..., D, H, hd] (one [D, H*hd] matrix per layer) and o_proj [..., H, hd, D]
([H*hd, D]); every SwiGLU weight w_gate / w_up [..., D, F] and w_down [..., F, D] (dense
MLPs, shared experts, and each routed expert of [L, E, D, F] on its own). Leading axes
(stacked layers, experts) are batch axes: every [d, h] slice is orthogonalized alone.
Embeddings, the LM head, norms and the router stay on AdamW (`optimizer.py`).

The update of a matrix W (m x n, fan_in m = the contracted axes, fan_out n):
    mu     <- beta mu + (1 - beta) g                     (stored like the params: ZeRO-1 shards)
    mu_hat  = Nesterov, bias-corrected as optax.contrib.scale_by_muon
    O       = NS5(mu_hat / ||mu_hat||_F)                 (quintic Newton-Schulz, 5 steps)
    W      <- W - lr (rms * sqrt(max(m, n)) O + wd W)
The scale rule (RMS matching, Liu et al. 2025 "Muon is scalable for LLM training"): an
orthogonal m x n matrix has RMS 1/sqrt(max(m, n)), so rms * sqrt(max(m, n)) gives every
matrix's update an RMS of `rms` (0.2 = AdamW's typical update RMS), which lets Muon share
AdamW's learning rate and weight decay. It is optax.contrib's `consistent_rms`.

Newton-Schulz is not elementwise: `scale_by_muon`'s update takes an `orthogonalize`
extra argument (`orthogonalize(mats, dims, ns)` -> orthogonalized mats, by leaf path);
the default runs every matrix here; a ParallelPlan passes its own, where each
data-parallel rank orthogonalizes whole matrices it owns (olmo_jax/parallel/muon_owners.py).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from olmo_jax.model.params import path_name as leaf_name

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (= optax.contrib's default)
MATRIX_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "w_gate", "w_up", "w_down")


class MatrixDims(NamedTuple):
    """Axes of a parameter leaf: batch (each index one matrix), reduction (fan in, the
    contracted axes), output (fan out)."""
    batch: tuple[int, ...]
    reduction: tuple[int, ...]
    output: tuple[int, ...]

    def units(self, shape) -> int:
        return math.prod(shape[a] for a in self.batch)

    def matrix(self, shape) -> tuple[int, int]:
        return (math.prod(shape[a] for a in self.reduction),
                math.prod(shape[a] for a in self.output))


def matrix_dims(name: str, ndim: int) -> MatrixDims | None:
    """The matrix layout of the parameter at path `name` ('moe_blocks/attn/q_proj'), or
    None for a parameter AdamW keeps (embedding, LM head, norms, router)."""
    leaf = name.rsplit("/", 1)[-1]
    if leaf not in MATRIX_NAMES:
        return None
    if leaf in ("q_proj", "k_proj", "v_proj"):  # [..., D, H, hd]
        red, out = (ndim - 3,), (ndim - 2, ndim - 1)
    elif leaf == "o_proj":  # [..., H, hd, D]
        red, out = (ndim - 3, ndim - 2), (ndim - 1,)
    else:  # [..., D, F] / [..., F, D]
        red, out = (ndim - 2,), (ndim - 1,)
    return MatrixDims(tuple(range(min(red))), red, out)


def to_units(x, dims: MatrixDims):
    """[batch..., red..., out...] -> x_GMN: G matrices of M x N (fan in x fan out)."""
    order = dims.batch + dims.reduction + dims.output
    m, n = dims.matrix(x.shape)
    return jnp.transpose(x, order).reshape(dims.units(x.shape), m, n)


def from_units(x_GMN, dims: MatrixDims, shape):
    """Inverse of `to_units` for a leaf of `shape`."""
    order = dims.batch + dims.reduction + dims.output
    y = x_GMN.reshape(tuple(shape[a] for a in order))
    return jnp.transpose(y, tuple(order.index(a) for a in range(len(shape))))


def newton_schulz(x_GMN, steps: int = 5, coeffs=NS_COEFFS, eps: float = 1e-8):
    """Orthogonalizes each of the U matrices: X / (||X||_F + eps), then `steps` quintic
    iterations X <- a X + (b A + c A A) X with A = X X^T, on the wide orientation (the
    math of optax.contrib.orthogonalize_via_newton_schulz, batched over U)."""
    a, b, c = coeffs
    x = x_GMN.astype(jnp.float32)
    tall = x.shape[1] > x.shape[2]
    if tall:
        x = jnp.swapaxes(x, 1, 2)
    x = x / (jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True)) + eps)
    for _ in range(steps):
        A_UMM = jnp.einsum("umn,ukn->umk", x, x)
        B_UMM = b * A_UMM + c * jnp.einsum("umk,ukj->umj", A_UMM, A_UMM)
        x = a * x + jnp.einsum("umk,ukn->umn", B_UMM, x)
    return jnp.swapaxes(x, 1, 2) if tall else x


def orthogonalize_local(mats: dict, dims: dict, ns) -> dict:
    """Every matrix of every leaf orthogonalized where it lies (one device, or GSPMD)."""
    return {k: from_units(ns(to_units(x, dims[k])), dims[k], x.shape) for k, x in mats.items()}


class MuonState(NamedTuple):
    count: jax.Array  # int32 scalar
    mu: Any  # momentum, the (masked) params' structure


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _named_leaves(tree) -> dict:
    flat = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_masked)
    return {leaf_name(p): x for p, x in flat if not _is_masked(x)}


def _replace_named(tree, values: dict):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if _is_masked(x) else values[leaf_name(p)], tree, is_leaf=_is_masked)


def scale_by_muon(beta: float = 0.95, ns_steps: int = 5, coeffs=NS_COEFFS,
                  eps: float = 1e-8, rms: float = 0.2) -> optax.GradientTransformationExtraArgs:
    """Nesterov momentum -> Newton-Schulz per matrix -> rms * sqrt(max(m, n)) scale, for
    leaves that `matrix_dims` names (apply it under optax.partition). Extra argument
    `orthogonalize` (default `orthogonalize_local`): how the matrices are orthogonalized."""

    def ns(x_GMN):
        return newton_schulz(x_GMN, ns_steps, coeffs, eps)

    def init_fn(params):
        return MuonState(jnp.zeros((), jnp.int32), optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None, orthogonalize=None, **extra):
        del params, extra
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(
            lambda m, g: beta * m + (1 - beta) * g,
            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
            optax.tree.bias_correction(updates, beta, count),
        )
        mats = _named_leaves(mu_hat)
        dims = {k: matrix_dims(k, x.ndim) for k, x in mats.items()}
        unknown = [k for k, d in dims.items() if d is None]
        if unknown:
            raise ValueError(f"Muon got parameters that are not matrices: {unknown}")
        ortho = (orthogonalize or orthogonalize_local)(mats, dims, ns)
        scaled = {k: o * (rms * math.sqrt(max(dims[k].matrix(o.shape)))) for k, o in ortho.items()}
        return _replace_named(mu_hat, scaled), MuonState(count, mu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def muon_labels(params):
    """'muon' for the matrices `matrix_dims` names, 'adamw' for every other leaf."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: "muon" if matrix_dims(leaf_name(p), x.ndim) is not None else "adamw", params)


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """Matmul FLOPs of `newton_schulz` on one m x n matrix (s = min, l = max side)."""
    s, l = min(m, n), max(m, n)
    return steps * (2 * s * s * l + 2 * s * s * s + 2 * s * s * l)
