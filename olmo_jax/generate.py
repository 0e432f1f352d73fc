"""Text generation from any checkpoint with the KV-cache decoder (olmo_jax/model/decode.py).

python -m olmo_jax.generate --model PATH --prompt TEXT [--prompt TEXT ...]
        [--tokenizer tokenizer.json|bytes] [--max-new-tokens 64] [--temperature 0]
        [--top-p 1] [--seed 0] [--no-stop] [--json OUT.json]

--model: an olmo_jax run folder, checkpoints folder or step folder (orbax; training or
converted), or a Hugging Face folder (config.json + safetensors) of an OLMoE model
(model_type olmoe) or of OLMo-core's olmo3moe export. --tokenizer: a tokenizer.json (or
the folder holding it), or `bytes`; by default the tokenizer.json in the model folder or
in one of its two parents. The prompts are decoded together as one batch (left-padded);
each row stops at the tokenizer's end-of-text token unless --no-stop. Temperature 0 is
greedy. Prints each prompt and its continuation, and the decode speed; --json writes
{"prompts", "completions", "token_ids", "seconds", "tokens_per_s"}. Runs on the default
device; bad input is one `error:` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from olmo_jax import cli
from olmo_jax.errors import CheckpointError, ConfigError, DataError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m olmo_jax.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True,
                   help="orbax run / checkpoint folder, or a Hugging Face olmoe / olmo3moe folder")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--tokenizer", default="",
                   help="tokenizer.json (or its folder) or 'bytes'; default: the model's own")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stop", action="store_true", help="do not stop at end-of-text")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    return p


def load_model(path: str):
    """The HFModel (config, params, model_state) of an orbax checkpoint or an HF folder."""
    from olmo_jax.checkpoint import hf, olmo3moe

    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        if model_type == "olmo3moe":
            return olmo3moe.load_model(folder)
        return hf.load_model(folder)
    return hf.load_checkpoint(folder)


def find_tokenizer(model_path: str, spec: str):
    from olmo_jax.data.tokenizer import load_tokenizer

    if spec:
        return load_tokenizer(spec)
    folder = Path(model_path).expanduser().resolve()
    for where in (folder, *list(folder.parents)[:2]):
        if (where / "tokenizer.json").is_file():
            return load_tokenizer(str(where / "tokenizer.json"))
    raise DataError(f"no tokenizer.json in {folder} or its two parents: pass --tokenizer "
                    "PATH/tokenizer.json (or --tokenizer bytes for the byte tokenizer)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        return cli.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        return cli.error(f"--temperature must be >= 0 and --top-p in (0, 1], got "
                         f"{args.temperature} and {args.top_p}")
    from olmo_jax.model import decode  # imports jax: after argument errors are reported

    try:
        tokenizer = find_tokenizer(args.model, args.tokenizer)
        model = load_model(args.model)
        vocab = model.config.vocab_size
        if tokenizer.vocab_size > vocab:
            return cli.error(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                f"{vocab}: pass the tokenizer the model was trained with (--tokenizer)")
        prompts = [tokenizer.encode(p).tolist() for p in args.prompt]
        empty = [p for p, ids in zip(args.prompt, prompts, strict=True) if not ids]
        if empty:
            return cli.error(f"the prompt {empty[0]!r} has no tokens")
        stop = () if args.no_stop else (tokenizer.eos_id,)
        t0 = time.perf_counter()
        gen = decode.generate(model.config, model.params, model.model_state, prompts,
                              args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, stop_ids=stop, seed=args.seed)
        seconds = time.perf_counter() - t0
    except (CheckpointError, ConfigError, DataError) as e:
        return cli.error(str(e))
    ids = [gen.tokens_BT[b, : gen.lengths_B[b]].tolist() for b in range(len(prompts))]
    texts = [tokenizer.decode([t for t in row if t not in stop]) for row in ids]
    n_tokens = int(gen.lengths_B.sum())
    for prompt, text in zip(args.prompt, texts, strict=True):
        print(f"{prompt}\033[1m{text}\033[0m" if sys.stdout.isatty() else prompt + text)
        print("---")
    print(f"{n_tokens} tokens in {seconds:.2f}s (compilation included): "
          f"{n_tokens / seconds:.1f} tokens/s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "prompts": args.prompt, "completions": texts, "token_ids": ids,
            "seconds": seconds, "tokens_per_s": n_tokens / seconds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
