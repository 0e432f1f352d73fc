"""Text files -> one OLMo-core token file (flat headerless uint8/uint16/uint32 array, each
input file one document followed by EOS): what `python -m olmo_jax.tokenize` runs.

`input_files(inputs, patterns)` lists the files, `tokenize_files(files, tokenizer, output)`
writes them. Directories are searched recursively for files matching the patterns; the
inputs and the files found are taken in sorted order, so the output is deterministic. The
dtype is the smallest dtype holding the tokenizer's largest id, as OLMo-core picks it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from olmo_jax.data.token_file import dtype_for_vocab, write_token_file
from olmo_jax.data.tokenizer import Tokenizer
from olmo_jax.errors import DataError

DEFAULT_PATTERNS = ("*.txt",)


def input_files(inputs: Sequence[Path], patterns: Sequence[str] = DEFAULT_PATTERNS) -> list[Path]:
    """Files named directly, then files under each directory matching any of `patterns`
    (in the order of `inputs`; each directory's files sorted). DataError when an input
    does not exist or nothing matches."""
    files: list[Path] = []
    for path in map(Path, inputs):
        if path.is_dir():
            files.extend(sorted({f for p in patterns for f in path.rglob(p) if f.is_file()}))
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist; pass text files or directories")
    if not files:
        raise DataError(f"no input files match {list(patterns)} in {[str(p) for p in inputs]}")
    return files


def tokenize_files(files: Sequence[Path], tokenizer: Tokenizer, output: str | Path) -> tuple[int, np.dtype]:
    """Writes `files` (UTF-8 text, undecodable bytes replaced), each one document followed
    by the tokenizer's EOS, to the token file `output` (atomically). Returns (tokens
    written, the file's dtype)."""
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    eos_N = np.array([tokenizer.eos_id], dtype=np.int64)

    def documents() -> Iterator[np.ndarray]:
        for file in files:
            yield tokenizer.encode(Path(file).read_text(encoding="utf-8", errors="replace"))
            yield eos_N

    return write_token_file(output, documents(), dtype), dtype
