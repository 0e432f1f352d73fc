"""Fixtures shared by the data tests: a tiny Hugging Face tokenizer trained in memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

HF_TRAINING_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, naïve café — 日本語のテキスト 🚀",
    "def main():\n    return 0\n",
] * 20


def train_hf_tokenizer(path: Path, special_tokens: list[str]) -> Path:
    """Trains a byte-level BPE (300 ids) on HF_TRAINING_TEXT and saves it as `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(HF_TRAINING_TEXT, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def make_hf_tokenizer() -> Callable[[Path, list[str]], Path]:
    """`train_hf_tokenizer`, for tests that need other special tokens."""
    return train_hf_tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer.json with `<|endoftext|>` (id 0) and `<pad>` (id 1)."""
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    return train_hf_tokenizer(folder / "tokenizer.json", ["<|endoftext|>", "<pad>"])
