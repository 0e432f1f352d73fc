"""Tokenizes text files into one OLMo-core token file (flat headerless uint8/uint16/uint32 array,
each input file one document followed by EOS).

    python tools/tokenize_files.py notes.txt books/ -o data/mine.npy
    python tools/tokenize_files.py src/ --glob '*.py' --glob '*.md' -o code.npy \
        --tokenizer path/to/tokenizer.json

Directories are searched recursively for files matching the --glob patterns; inputs and
the files found are taken in sorted order, so the output is deterministic. The dtype is
the smallest dtype holding the tokenizer's largest id, as OLMo-core picks it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from olmo_jax.data import DataError, dtype_for_vocab, load_tokenizer, write_token_file


def input_files(inputs: list[Path], patterns: list[str]) -> list[Path]:
    """Files named directly, then files under each directory matching any of `patterns`."""
    files: list[Path] = []
    for path in inputs:
        if path.is_dir():
            files.extend(sorted({f for p in patterns for f in path.rglob(p) if f.is_file()}))
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist; pass text files or directories")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="text files or directories")
    parser.add_argument("-o", "--output", type=Path, required=True, help="token file to write")
    parser.add_argument(
        "--tokenizer", default="bytes", help="'bytes' (default) or a path to a tokenizer.json"
    )
    parser.add_argument(
        "--glob",
        action="append",
        dest="patterns",
        help="file-name pattern for directories, repeatable (default: *.txt)",
    )
    args = parser.parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        files = input_files(args.inputs, args.patterns or ["*.txt"])
        if not files:
            raise DataError(f"no input files match {args.patterns or ['*.txt']} in {args.inputs}")
        dtype = dtype_for_vocab(tokenizer.vocab_size)
        eos_N = np.array([tokenizer.eos_id], dtype=np.int64)

        def documents() -> Iterator[np.ndarray]:
            for file in files:
                yield tokenizer.encode(file.read_text(encoding="utf-8", errors="replace"))
                yield eos_N

        n_tokens = write_token_file(args.output, documents(), dtype)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{n_tokens} tokens ({len(files)} documents, {dtype.name}) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
