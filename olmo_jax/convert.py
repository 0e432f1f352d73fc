"""Checkpoint conversion between Hugging Face OLMoE folders, OLMo-core's olmo3moe exports
and olmo_jax (orbax).

python -m olmo_jax.convert hf-to-orbax --hf HF_DIR --out DIR
    DIR/checkpoints/0 (weights) + DIR/config.py (the run config of that model);
    fine-tune: python -m olmo_jax.train --config=DIR/config.py --config.trainer.init_from=DIR
python -m olmo_jax.convert orbax-to-hf --ckpt CKPT --out HF_DIR [--dtype bfloat16]
    CKPT: a run folder (its latest checkpoint), a checkpoints folder or one step folder;
    HF_DIR gets config.json + safetensors for OlmoeForCausalLM.from_pretrained.
python -m olmo_jax.convert olmo3moe-to-orbax --hf HF_DIR --out DIR
python -m olmo_jax.convert orbax-to-olmo3moe --ckpt CKPT --out HF_DIR [--dtype bfloat16]
    the same for OLMo-core 3's Hugging Face export of its MoE (model_type olmo3moe, written
    by its convert_olmo3moe_state_to_hf; olmo_jax/checkpoint/olmo3moe.py).
python -m olmo_jax.convert upcycle --ckpt CKPT --out DIR --experts E --top-k K
        [--granularity G] [--keep-dense N] [--shared-expert] [--noise S] [--gating ...]
    a dense model -> an MoE of E copies of each MLP (granular: E*G experts of hidden F/G,
    top K*G), fresh router; exact (same logits) at --noise 0 (olmo_jax/checkpoint/upcycle.py).
python -m olmo_jax.convert experts --ckpt CKPT --out DIR
        (--duplicate N [--noise S] | --prune E --counts RUN_DIR | --top-k K)
    expert surgery on an MoE model (olmo_jax/checkpoint/surgery.py).
Both write DIR/checkpoints/0 (weights only: the optimizer state is dropped) + DIR/config.py;
    fine-tune: python -m olmo_jax.train --config=DIR/config.py --config.trainer.init_from=DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from olmo_jax import cli, storage
from olmo_jax.errors import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    from olmo_jax.model.config import GATINGS

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
        help="tensor dtype: float32 | bfloat16 | float16, olmo_jax.model.config.DTYPES "
        "(default: the source model's, else float32)",
    )
    c = sub.add_parser("olmo3moe-to-orbax",
                       help="OLMo-core olmo3moe Hugging Face export -> olmo_jax checkpoint")
    c.add_argument("--hf", required=True, help="folder with config.json and *.safetensors")
    c.add_argument("--out", required=True, help="new (or empty) output folder")
    d = sub.add_parser("orbax-to-olmo3moe",
                       help="olmo_jax checkpoint -> OLMo-core olmo3moe Hugging Face folder")
    d.add_argument("--ckpt", required=True, help="run folder, checkpoints folder or step folder")
    d.add_argument("--out", required=True, help="new (or empty) output folder")
    d.add_argument("--dtype", default=None,
                   help="tensor dtype: olmo_jax.model.config.DTYPES (default: the source "
                   "model's, else float32)")
    u = sub.add_parser("upcycle", help="dense olmo_jax checkpoint -> MoE (copies of the MLPs)")
    u.add_argument("--ckpt", required=True, help="run folder, checkpoints folder or step folder")
    u.add_argument("--out", required=True, help="new (or empty) output folder")
    u.add_argument("--experts", type=int, required=True, help="E copies of each dense MLP")
    u.add_argument("--top-k", type=int, required=True, help="copies routed per token")
    u.add_argument("--granularity", type=int, default=1,
                   help="G slices of the hidden dim per copy: E*G experts, top-k*G routed")
    u.add_argument("--keep-dense", type=int, default=0, help="the first N blocks stay dense")
    u.add_argument("--shared-expert", action="store_true",
                   help="the MLP also becomes a shared expert (shared and routed get half each)")
    u.add_argument("--noise", type=float, default=0.0,
                   help="relative Gaussian noise per routed copy (0 = exact upcycling)")
    u.add_argument("--gating", default="topk_softmax", choices=GATINGS)
    u.add_argument("--norm-topk-prob", action="store_true", help="softmax: renormalize over the k")
    u.add_argument("--router-weight-scale", type=float, default=1.0)
    u.add_argument("--seed", type=int, default=0, help="router init and noise")
    e = sub.add_parser("experts", help="expert surgery on an MoE olmo_jax checkpoint")
    e.add_argument("--ckpt", required=True, help="run folder, checkpoints folder or step folder")
    e.add_argument("--out", required=True, help="new (or empty) output folder")
    op = e.add_mutually_exclusive_group(required=True)
    op.add_argument("--duplicate", type=int, help="N copies of every expert (top-k x N)")
    op.add_argument("--prune", type=int, help="keep this many most-used experts per block")
    op.add_argument("--top-k", type=int, help="experts routed per token")
    e.add_argument("--counts", help="--prune: a run folder or its expert_counts.jsonl")
    e.add_argument("--noise", type=float, default=0.0, help="--duplicate: relative noise per copy")
    e.add_argument("--seed", type=int, default=0)
    return parser


def _upcycle(args):
    from olmo_jax.checkpoint import rewrite, upcycle

    spec = upcycle.UpcycleSpec(
        args.experts, args.top_k, args.granularity, args.keep_dense, args.shared_expert,
        args.noise, args.gating, args.norm_topk_prob, args.router_weight_scale, args.seed)
    _, model, path = rewrite.rewrite(
        args.ckpt, args.out, lambda c, p, s: upcycle.upcycle(c, p, spec, s), "upcycle",
        "MoE upcycled from the dense model")
    exact = args.noise == 0 and upcycle.weights_sum_to_one(model.config.moe)
    return model, path, ("same logits as the dense model" if exact else
                         "NOT exact: " + ("--noise > 0" if args.noise else
                                          "the combine weights do not sum to 1 (use "
                                          "--gating topk_softmax or --norm-topk-prob)"))


def _experts(args):
    from olmo_jax.checkpoint import rewrite, surgery

    if args.prune is not None:
        if not args.counts:
            raise SystemExit("error: --prune needs --counts RUN_DIR (its expert_counts.jsonl)")

        def transform(c, p, s):
            return surgery.prune(c, p, s, args.prune, surgery.read_counts(args.counts, c))
        what = f"MoE pruned to the {args.prune} most-used experts per block of the model"
    elif args.duplicate is not None:
        def transform(c, p, s):
            return surgery.duplicate(c, p, s, args.duplicate, args.noise, args.seed)
        what = f"MoE with every expert duplicated x{args.duplicate} of the model"
    else:
        def transform(c, p, s):
            return surgery.set_top_k(c, p, s, args.top_k)
        what = f"MoE with top_k={args.top_k} of the model"
    _, model, path = rewrite.rewrite(args.ckpt, args.out, transform, "experts", what)
    return model, path, what


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    remote = {k: v for k, v in vars(args).items()
              if k in ("hf", "ckpt", "out", "counts") and v and storage.is_remote(v)}
    if not remote:
        return _convert(args)
    # s3:// / gs:// folders: inputs are copied to a local folder first, the output is written
    # locally and then uploaded (a conversion reads and writes whole folders anyway).
    with tempfile.TemporaryDirectory(prefix="olmo_jax_convert_") as tmp:
        staged = argparse.Namespace(**vars(args))
        for key, url in remote.items():
            local = os.path.join(tmp, key)
            if key == "out":
                staged.out = local
                continue
            try:
                storage.download_tree(url, local)
            except (OSError, ValueError) as e:
                return cli.error(f"--{key}: " + storage.storage_error(url, e))
            setattr(staged, key, local)
        if "out" in remote:
            try:  # refuse a missing bucket / denied access before converting
                storage.makedirs(remote["out"])
                held = storage.filesystem(remote["out"]).find(remote["out"])
            except (OSError, ValueError) as e:
                return cli.error("--out: " + storage.storage_error(remote["out"], e, "writing"))
            if held:
                return cli.error(f"--out {remote['out']} already holds {len(held)} object(s); "
                                 "choose a new (or empty) prefix")
        code = _convert(staged)
        if code == 0 and "out" in remote:
            try:
                storage.upload_tree(staged.out, remote["out"])
            except (OSError, ValueError) as e:
                return cli.error("--out: " + storage.storage_error(remote["out"], e, "writing"))
            print(f"uploaded {staged.out} to {remote['out']}")
        return code


def _convert(args) -> int:
    from olmo_jax.checkpoint import hf  # imports jax: after argument errors are reported

    t0 = time.perf_counter()
    try:
        if args.command in ("hf-to-orbax", "olmo3moe-to-orbax"):
            if args.command == "hf-to-orbax":
                config_path = hf.hf_to_orbax(args.hf, args.out)
            else:
                from olmo_jax.checkpoint import olmo3moe

                config_path = olmo3moe.to_orbax(args.hf, args.out)
            out = config_path.parent
            print(f"wrote {out}/checkpoints/0 and {config_path} in {time.perf_counter() - t0:.1f}s")
            print(
                f"fine-tune: python -m olmo_jax.train --config={config_path} "
                f"--config.trainer.init_from={out} --config.data.paths=YOUR_TOKENS.npy"
            )
        elif args.command in ("upcycle", "experts"):
            from olmo_jax.checkpoint.rewrite import OPTIMIZER_NOTE

            model, path, note = (_upcycle if args.command == "upcycle" else _experts)(args)
            m = model.config.moe
            print(f"wrote {path.parent}/checkpoints/0 and {path} in {time.perf_counter() - t0:.1f}s: "
                  f"{m.num_experts} experts of hidden {m.expert_hidden}, top-{m.top_k}, "
                  f"{model.config.n_moe_layers} MoE blocks; {note}")
            print(OPTIMIZER_NOTE)
            print(f"fine-tune: python -m olmo_jax.train --config={path} "
                  f"--config.trainer.init_from={path.parent} --config.data.paths=YOUR_TOKENS.npy")
        else:
            if args.command == "orbax-to-olmo3moe":
                from olmo_jax.checkpoint import olmo3moe

                hf.check_dtype(args.dtype)
                olmo3moe.from_orbax(args.ckpt, args.out, args.dtype)
            else:
                hf.orbax_to_hf(args.ckpt, args.out, args.dtype)
            print(
                f"wrote {args.out} (config.json + safetensors) in {time.perf_counter() - t0:.1f}s"
            )
    except CheckpointError as e:
        return cli.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
