"""Checkpoint conversion between Hugging Face OLMoE folders and olmo_jax (orbax).

python -m olmo_jax.convert hf-to-orbax --hf HF_DIR --out DIR
    DIR/checkpoints/0 (weights) + DIR/config.py (the run config of that model);
    fine-tune: python -m olmo_jax.train --config=DIR/config.py --config.trainer.init_from=DIR
python -m olmo_jax.convert orbax-to-hf --ckpt CKPT --out HF_DIR [--dtype bfloat16]
    CKPT: a run folder (its latest checkpoint), a checkpoints folder or one step folder;
    HF_DIR gets config.json + safetensors for OlmoeForCausalLM.from_pretrained.
"""

from __future__ import annotations

import argparse
import sys
import time

from olmo_jax.checkpoint.errors import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m olmo_jax.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-orbax", help="Hugging Face OLMoE folder -> olmo_jax checkpoint")
    a.add_argument("--hf", required=True, help="folder with config.json and *.safetensors")
    a.add_argument("--out", required=True, help="new (or empty) output folder")
    b = sub.add_parser("orbax-to-hf", help="olmo_jax checkpoint -> Hugging Face OLMoE folder")
    b.add_argument("--ckpt", required=True, help="run folder, checkpoints folder or step folder")
    b.add_argument("--out", required=True, help="new (or empty) output folder")
    b.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="tensor dtype (default: the source model's, else float32)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from olmo_jax.checkpoint import hf  # imports jax: after argument errors are reported

    t0 = time.perf_counter()
    try:
        if args.command == "hf-to-orbax":
            config_path = hf.hf_to_orbax(args.hf, args.out)
            out = config_path.parent
            print(f"wrote {out}/checkpoints/0 and {config_path} in {time.perf_counter() - t0:.1f}s")
            print(
                f"fine-tune: python -m olmo_jax.train --config={config_path} "
                f"--config.trainer.init_from={out} --config.data.paths=YOUR_TOKENS.npy"
            )
        else:
            hf.orbax_to_hf(args.ckpt, args.out, args.dtype)
            print(
                f"wrote {args.out} (config.json + safetensors) in {time.perf_counter() - t0:.1f}s"
            )
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
