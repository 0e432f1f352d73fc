"""Compiled temporaries of one training step's gradient per model.remat and
model.lm_loss_chunk, from XLA's memory analysis (compile only: nothing is allocated or run).

    .venv/bin/python tools/experiments/step_temporaries.py            # the docs/training.md table
    .venv/bin/python tools/experiments/step_temporaries.py --seq 2048 --vocab 32768

The model: one dense and two MoE blocks (8 experts, top-2), float32, the XLA attention and
norms and the einsum expert GEMMs (so the numbers do not depend on the CPU kernels), the
LM z-loss on; each setting compiles `trainer.step.make_grads_fn` on a zero batch and
prints `temp_size_in_bytes` (activations kept for the backward pass and scratch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from olmo_jax.model import MoEConfig, Transformer, TransformerConfig  # noqa: E402
from olmo_jax.trainer.step import make_grads_fn  # noqa: E402

SETTINGS = [dict(remat="none"), dict(remat="attention"), dict(remat="mlp"), dict(remat="dots"),
            dict(remat="block"), dict(lm_loss_chunk=512), dict(lm_loss_chunk=512, remat="mlp")]


def temporaries(cfg: TransformerConfig, batch: int, seq: int) -> int:
    graphdef, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jnp.zeros((batch, seq + 1), jnp.int32)
    compiled = jax.jit(make_grads_fn(graphdef, cfg)).lower(
        params, rest, tokens, jax.random.key(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=256)
    args = ap.parse_args()
    base = TransformerConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_layers=3, n_heads=max(args.d_model // 64, 2),
        n_dense_layers=1, lm_z_loss_coef=1e-4, attention_impl="xla", norm_impl="xla",
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=args.d_model, gmm_impl="einsum"))
    logits = args.batch * args.seq * args.vocab * 4
    print(f"float32 logits [B, T, V]: {logits / 2**20:.1f} MiB")
    for setting in SETTINGS:
        t = temporaries(base.replace(**setting), args.batch, args.seq)
        print(f"{', '.join(f'{k}={v}' for k, v in setting.items())}: {t / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
