"""The run config's `data` section as a typed dataclass (olmo_jax/config.py generates the
ConfigDict from it): token files, tokenizer, eval splits, read-ahead."""

from __future__ import annotations

from dataclasses import dataclass, field

from olmo_jax.errors import ConfigError


@dataclass(frozen=True)
class DataConfig:
    paths: str = ""  # comma-separated token files; "" = the embedded stdlib corpus
    tokenizer: str = "bytes"  # bytes | path to a tokenizer.json
    vocab_size: int = 0  # vocab of the token files (0 = the tokenizer's padded vocab)
    dtype: str = ""  # "" = from the vocab size; uint16 | uint32
    eval_fraction: float = 0.01  # the default eval split: this share of the windows held out of training
    # Named eval sets {name: token files (a list or comma-separated)}, held out by the user;
    # each logged as eval/<name>/loss and eval/<name>/perplexity (olmo_jax/data/loader.py).
    eval_sets: dict = field(default_factory=dict)
    prefetch: int = 2  # batches the grain pipeline reads ahead on its own thread (0 = none)

    def validate(self, prefix: str = "data") -> DataConfig:
        if self.prefetch < 0:
            raise ConfigError(f"{prefix}.prefetch must be >= 0 (0 = no read-ahead), got {self.prefetch}")
        return self
