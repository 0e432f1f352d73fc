"""Tokenizers: the byte-level default and a wrapper around a local Hugging Face
`tokenizer.json`, plus `load_tokenizer`, which picks one from a config string.

Both expose the same small surface (`Tokenizer`): `encode(text) -> int32 ids`,
`decode(ids) -> str`, `eos_id`, `pad_id`, `vocab_size` and `padded_vocab_size` (the
vocabulary rounded up to a multiple of 128, the embedding table's size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from olmo_jax.errors import DataError

VOCAB_MULTIPLE = 128
# Names under which tokenizers commonly store the end-of-document token, most common first.
EOS_TOKEN_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>")
PAD_TOKEN_NAMES = ("<pad>", "<|padding|>", "[PAD]", "<|pad|>")


def pad_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """`vocab_size` rounded up to a multiple of `multiple`."""
    return -(-vocab_size // multiple) * multiple


class Tokenizer(Protocol):
    eos_id: int
    pad_id: int
    vocab_size: int
    padded_vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray | list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then EOS (256) and PAD (257)."""

    eos_id = 256
    pad_id = 257
    vocab_size = 258
    padded_vocab_size = pad_vocab(258)  # 384

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        ids_S = np.asarray(ids)
        byte_ids = ids_S[(ids_S >= 0) & (ids_S < 256)]
        return byte_ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local `tokenizer.json`.

    `eos_id` is the explicit argument when given, else the id of the first of
    `EOS_TOKEN_NAMES` in the vocabulary; `pad_id` likewise from `PAD_TOKEN_NAMES`, falling
    back to `eos_id`.
    """

    def __init__(self, path: str | Path, eos_id: int | None = None):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise DataError(
                f"loading the tokenizer {path} needs the `tokenizers` package, which is not "
                "installed: pip install 'olmo-jax[hf]' (or pip install tokenizers)"
            ) from e
        self.path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise DataError(
                f"{self.path} is not a readable Hugging Face tokenizer.json ({e}); "
                "point data.tokenizer at the tokenizer.json saved with the model's tokenizer"
            ) from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.padded_vocab_size = pad_vocab(self.vocab_size)
        self.eos_id = eos_id if eos_id is not None else self._find_eos()
        if not 0 <= self.eos_id < self.vocab_size:
            raise DataError(
                f"eos_id={self.eos_id} is outside the vocabulary of {self.path} "
                f"(size {self.vocab_size}); pass an id in [0, {self.vocab_size})"
            )
        pad_ids = [self._tok.token_to_id(name) for name in PAD_TOKEN_NAMES]
        self.pad_id = next((i for i in pad_ids if i is not None), self.eos_id)

    def _find_eos(self) -> int:
        for name in EOS_TOKEN_NAMES:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise DataError(
            f"{self.path} has none of the usual end-of-document tokens {EOS_TOKEN_NAMES}; "
            "pass eos_id= explicitly (HFTokenizer(path, eos_id=...))"
        )

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        ids_S = np.asarray(ids)
        in_vocab = ids_S[(ids_S >= 0) & (ids_S < self.vocab_size)]
        return self._tok.decode(in_vocab.tolist(), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, eos_id={self.eos_id})"


def load_tokenizer(spec: str, eos_id: int | None = None) -> ByteTokenizer | HFTokenizer:
    """`""` or `"bytes"`: the byte tokenizer; a path to a tokenizer.json, or to a directory
    holding one: that Hugging Face tokenizer."""
    if spec in ("", "bytes"):
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"tokenizer {spec!r}: {path} does not exist; set data.tokenizer to '' or 'bytes' "
            "for the byte tokenizer, or to the path of a Hugging Face tokenizer.json "
            "(or the directory that holds it)"
        )
    return HFTokenizer(path, eos_id=eos_id)
