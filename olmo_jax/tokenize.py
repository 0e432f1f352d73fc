"""Entry point: tokenizes text files into one OLMo-core token file (flat headerless
uint8/uint16/uint32 array, each input file one document followed by EOS).

    python -m olmo_jax.tokenize notes.txt books/ -o data/mine.npy
    python -m olmo_jax.tokenize src/ --glob '*.py' --glob '*.md' -o code.npy \\
        --tokenizer path/to/tokenizer.json

Directories are searched recursively for files matching the --glob patterns; inputs and
the files found are taken in sorted order, so the output is deterministic. The dtype is
the smallest dtype holding the tokenizer's largest id, as OLMo-core picks it
(olmo_jax/data/text_files.py). Train on the result with --config.data.paths=OUTPUT.

Exit codes: 0 written, 2 bad input (a missing input, no matching file, a bad tokenizer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from olmo_jax import cli
from olmo_jax.data import load_tokenizer
from olmo_jax.data.text_files import DEFAULT_PATTERNS, input_files, tokenize_files
from olmo_jax.errors import DataError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m olmo_jax.tokenize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inputs", nargs="+", type=Path, help="text files or directories")
    parser.add_argument("-o", "--output", type=Path, required=True, help="token file to write")
    parser.add_argument("--tokenizer", default="bytes", help="'bytes' (default) or a path to a tokenizer.json")
    parser.add_argument("--glob", action="append", dest="patterns",
                        help=f"file-name pattern for directories, repeatable (default: {', '.join(DEFAULT_PATTERNS)})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        files = input_files(args.inputs, args.patterns or DEFAULT_PATTERNS)
        n_tokens, dtype = tokenize_files(files, tokenizer, args.output)
    except DataError as e:
        return cli.error(str(e))
    print(f"{n_tokens} tokens ({len(files)} documents, {dtype.name}) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
