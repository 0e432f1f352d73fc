"""Rotary position embedding, "rotate half" layout (Hugging Face / OLMo-core), with
OLMo-core's RoPE scaling (nn/rope.py): ABF, PI, stepwise (Llama 3.1) and YaRN.

A scaling changes only the inverse frequencies and a factor the cos / sin tables are
multiplied by (YaRN's attention factor, section 3.4 of the paper: it scales q and k, so the
attention scores by its square, as OLMo-core and Hugging Face apply it); `inv_freq` computes
both, so every path that builds tables from positions shares it.

Positions are [T] (every row of the batch at 0 .. T-1, tables [T, H]) or, with document
masking, [B, T] (each row's positions restart at its documents' starts, tables [B, T, H]):
`document_positions` derives them from segment ids as OLMo-core's `RotaryEmbedding` does
from `cu_doc_lens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from olmo_jax import shapes


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling (model.rope_scaling*, resolved: 0 = OLMo-core's default for the kind).
    kind: abf | pi | stepwise | yarn (model/config.ROPE_SCALINGS less "none")."""

    kind: str
    factor: float = 0.0  # pi, stepwise, yarn: the context expansion multiplier
    new_theta: float = 0.0  # abf: the new base (OLMo-core's new_theta)
    old_context_len: int = 8192  # stepwise, yarn: the base model's training length
    low_freq_proportion: float = 0.0  # stepwise
    high_freq_proportion: float = 0.25  # stepwise
    beta_fast: float = 32.0  # yarn: the ramp's high-frequency end (rotations)
    beta_slow: float = 1.0  # yarn: the ramp's low-frequency end (rotations)
    attention_factor: float = 0.0  # the tables' factor; 0 = the kind's own

    # OLMo-core's defaults (nn/rope.py) for a field left at 0.
    DEFAULT_FACTOR = {"pi": 2.0, "stepwise": 32.0, "yarn": 8.0}
    DEFAULT_NEW_THETA = 8_000_000.0

    @property
    def resolved_factor(self) -> float:
        return self.factor or self.DEFAULT_FACTOR.get(self.kind, 1.0)

    @property
    def resolved_new_theta(self) -> float:
        return self.new_theta or self.DEFAULT_NEW_THETA

    @property
    def resolved_attention_factor(self) -> float:
        """The cos / sin factor: given, else YaRN's 0.1 ln(factor) + 1, else 1."""
        if self.attention_factor:
            return float(self.attention_factor)
        return 0.1 * math.log(self.resolved_factor) + 1.0 if self.kind == "yarn" else 1.0


def scaling_of(cfg) -> RopeScaling | None:
    """The RopeScaling of a TransformerConfig's rope_scaling* fields (None = plain RoPE)."""
    if cfg.rope_scaling == "none":
        return None
    return RopeScaling(
        kind=cfg.rope_scaling, factor=cfg.rope_scaling_factor, new_theta=cfg.rope_new_theta,
        old_context_len=cfg.rope_old_context_len,
        low_freq_proportion=cfg.rope_low_freq_proportion,
        high_freq_proportion=cfg.rope_high_freq_proportion, beta_fast=cfg.rope_beta_fast,
        beta_slow=cfg.rope_beta_slow, attention_factor=cfg.rope_attention_factor)


def window_scalings(cfg) -> tuple[RopeScaling | None, ...]:
    """The RoPE scaling of the layers of each of `cfg.window_choices` (0 = full first):
    model.rope_scaling on the full-attention layers, and on the sliding-window ones only
    with model.rope_scaling_layers=all (`full`: they keep plain RoPE, as OLMo-core's
    `with_rope_scaling(full_attn_layers_only=True)` builds them)."""
    s = scaling_of(cfg)
    return tuple(s if w == 0 or cfg.rope_scaling_layers == "all" else None
                 for w in cfg.window_choices)


def by_window(cfg) -> bool:
    """Whether the layers' RoPE tables differ by window (window_scalings): the tables then
    hold one entry per window choice on axis -3 ([W, T, H] or [B, W, T, H]) and each layer
    takes its own (`for_window`)."""
    return len(set(window_scalings(cfg))) > 1


def for_window(table, window_index):
    """A layer's table from a per-window stack (axis -3; by_window), by its window index."""
    return jnp.take(table, window_index, axis=-3)


def _base_inv_freq(theta: float, head_dim: int) -> jax.Array:
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def inv_freq(head_dim: int, theta: float,
             scaling: RopeScaling | None = None) -> tuple[jax.Array, float]:
    """The inverse frequencies [head_dim // 2] (float32) and the tables' factor, as
    OLMo-core's `compute_scaled_inv_freq` computes them."""
    if scaling is None:
        return _base_inv_freq(theta, head_dim), 1.0
    s, factor = scaling, scaling.resolved_factor
    if s.kind == "abf":
        return _base_inv_freq(s.resolved_new_theta, head_dim), s.resolved_attention_factor
    base = _base_inv_freq(theta, head_dim)
    if s.kind == "pi":  # positions / factor = inverse frequencies / factor
        return (base / factor if factor != 1.0 else base), s.resolved_attention_factor
    if s.kind == "stepwise":
        low_freq_factor = 1.0 / (1 - s.low_freq_proportion)
        high_freq_factor = 1.0 / s.high_freq_proportion
        low_band = s.old_context_len / low_freq_factor
        high_band = s.old_context_len / high_freq_factor
        # scalar / tensor as torch computes it (reciprocal, then times the scalar): the band
        # weight below cancels, so its rounding shows in the tables
        wavelen = (1.0 / base) * (2 * math.pi)
        inv = jnp.where(wavelen > low_band, base / factor, base)  # long wavelengths: scaled
        w = ((1.0 / wavelen) * s.old_context_len - low_freq_factor) / (
            high_freq_factor - low_freq_factor)
        smoothed = (1 - w) * inv / factor + w * inv
        mid = (wavelen <= low_band) & (wavelen >= high_band)
        return jnp.where(mid, smoothed, inv), s.resolved_attention_factor
    if s.kind == "yarn":
        half = base.shape[0]

        def dim_of(n_rot: float) -> float:
            return (head_dim * math.log(s.old_context_len / (n_rot * 2.0 * math.pi))
                    / (2.0 * math.log(theta)))

        low = max(math.floor(dim_of(s.beta_fast)), 0)
        high = min(math.ceil(dim_of(s.beta_slow)), half - 1)
        span = max(high - low, 1e-3)
        ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / span, 0, 1)
        inv = (base / factor) * ramp + base * (1.0 - ramp)
        return inv, s.resolved_attention_factor
    raise ValueError(f"unknown RoPE scaling {s.kind!r}")  # model/config.py validates it


@shapes.check("-> T H, T H")
def rope_tables(positions_T: jax.Array, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables, each [T, head_dim], float32 (times the scaling's factor)."""
    inv, factor = inv_freq(head_dim, theta, scaling)
    freqs_Th = positions_T.astype(jnp.float32)[:, None] * inv[None, :]
    emb_TH = jnp.concatenate([freqs_Th, freqs_Th], axis=-1)
    cos_TH, sin_TH = jnp.cos(emb_TH), jnp.sin(emb_TH)
    if factor != 1.0:
        cos_TH, sin_TH = cos_TH * factor, sin_TH * factor
    return cos_TH, sin_TH


@shapes.check("-> B T H, B T H")
def rope_tables_batch(positions_BT: jax.Array, head_dim: int, theta: float,
                      scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """`rope_tables` of per-row positions: cos and sin [B, T, head_dim], float32."""
    B, T = positions_BT.shape
    cos_XH, sin_XH = rope_tables(positions_BT.reshape(B * T), head_dim, theta, scaling)
    return cos_XH.reshape(B, T, head_dim), sin_XH.reshape(B, T, head_dim)


@shapes.check("-> B T")
def document_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """Each token's position inside its document, int32 [B, T]: 0 at every document start (a
    position whose segment id differs from the previous one's, and position 0), counting up
    to the next. Equal ids must be contiguous (as packed documents are)."""
    B, T = segment_ids_BT.shape
    t_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    starts_BT = jnp.concatenate(
        [jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    first_BT = jax.lax.cummax(jnp.where(starts_BT, t_BT, 0), axis=1)  # the document's start
    return t_BT - first_BT


@shapes.check("cos_TH: ... T H", "sin_TH: ... T H", "-> B T N H")
def apply_rope(x_BTNH: jax.Array, cos_TH: jax.Array, sin_TH: jax.Array) -> jax.Array:
    """x rotated by the [T, H] tables (shared by the rows) or [B, T, H] ones (per row)."""
    half = x_BTNH.shape[-1] // 2
    x1, x2 = x_BTNH[..., :half], x_BTNH[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos = _heads_axis(cos_TH).astype(x_BTNH.dtype)
    sin = _heads_axis(sin_TH).astype(x_BTNH.dtype)
    return x_BTNH * cos + rotated * sin


def _heads_axis(table):
    """A [T, H] or [B, T, H] table broadcastable against [B, T, N, H]."""
    return table[None, :, None, :] if table.ndim == 2 else table[:, :, None, :]
