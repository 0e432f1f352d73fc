"""Data: token files (OLMo-core format), tokenizers, the embedded stdlib corpus, and the
loader that turns them into deterministic, step-addressed global batches (grain:
stream.py), and the named eval sets (build.py).

    data = build_data(run.data, seq_len, global_batch_size, seed)  # run: config.RunConfig
    for step, batch_BX in data.train.iterate():  # int32 [B, seq_len + 1]
        inputs, targets = batch_BX[:, :-1], batch_BX[:, 1:]  # targets < 0: olmo_jax/labels.py
"""

from olmo_jax.data.build import Data, build_data, default_cache_dir
from olmo_jax.data.corpus import stdlib_corpus
from olmo_jax.data.loader import BatchLoader, TokenWindows, split_windows
from olmo_jax.data.token_file import TokenFile, dtype_for_vocab, write_token_file
from olmo_jax.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    pad_vocab,
)
from olmo_jax.errors import DataError

__all__ = [
    "BatchLoader",
    "ByteTokenizer",
    "Data",
    "DataError",
    "HFTokenizer",
    "TokenFile",
    "TokenWindows",
    "Tokenizer",
    "build_data",
    "default_cache_dir",
    "dtype_for_vocab",
    "load_tokenizer",
    "pad_vocab",
    "split_windows",
    "stdlib_corpus",
    "write_token_file",
]
