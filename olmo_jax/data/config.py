"""The run config's `data` section as a typed dataclass (olmo_jax/config.py generates the
ConfigDict from it): token files, tokenizer, eval splits, read-ahead."""

from __future__ import annotations

from dataclasses import dataclass, field

from olmo_jax.data.mixture import parse_sources
from olmo_jax.data.repetition import RepetitionFilter
from olmo_jax.errors import ConfigError, DataError, check_choice
from olmo_jax.labels import INSTANCES


@dataclass(frozen=True)
class DataConfig:
    paths: str = ""  # comma-separated token files; "" = the embedded stdlib corpus
    tokenizer: str = "bytes"  # bytes | path to a tokenizer.json
    vocab_size: int = 0  # vocab of the token files (0 = the tokenizer's padded vocab)
    dtype: str = ""  # "" = from the vocab size (OLMo-core's rule); uint8 | uint16 | uint32
    # > 0: this share of the instances held out of training as the eval split (at least one
    # global batch); 0 = none (OLMo-core trains on every instance).
    eval_fraction: float = 0.0
    # loader.INSTANCES: olmo_core (seq_len tokens at stride seq_len, the last position
    # unlabelled: OLMo-core's NumpyFSLDataset) | plus_one (seq_len + 1 tokens, all labelled).
    instances: str = "olmo_core"
    # OLMo-core's instance filter (data/repetition.py): an instance with a pattern of period
    # in [min_period, max_period] repeated max_count times or more adds no loss.
    repetition_filter: bool = False
    repetition_max_period: int = 13
    repetition_min_period: int = 1
    repetition_max_count: int = 32
    # Named eval sets {name: token files (a list or comma-separated)}, held out by the user;
    # each logged as eval/<name>/loss and eval/<name>/perplexity (olmo_jax/data/loader.py).
    eval_sets: dict = field(default_factory=dict)
    prefetch: int = 2  # batches the grain pipeline reads ahead on its own thread (0 = none)
    # A source mixture (data/mixture.py, OLMo-core's SourceMixtureDatasetConfig), instead of
    # data.paths: {name: {paths (globs allowed), target_ratio, max_repetition_ratio (default
    # 1), max_source_fraction (default 1)}}, taken in name order.
    sources: dict = field(default_factory=dict)
    requested_tokens: int = 0  # the mixture's token budget; 0 = the run's tokens (max_steps / max_tokens)
    # An OLMo-core mix file (data/mix_file.py): a path, or the name of a mix the installed
    # ai2-olmo-core ships; its paths are under mix_root, {TOKENIZER} = mix_tokenizer.
    mix: str = ""
    mix_root: str = ""
    mix_tokenizer: str = ""
    # The data order's seed (the training windows' shuffle), apart from the model init:
    # -1 = trainer.seed (one seed for both).
    seed: int = -1
    # Token files in an object store (s3://, gs://) are read by byte ranges through a local
    # cache of this many MiB (least recently used blocks evicted), never downloaded whole.
    remote_cache_mb: int = 256

    def order_seed(self, trainer_seed: int) -> int:
        """The seed of the training data's order: data.seed, or trainer.seed where it is -1."""
        return trainer_seed if self.seed == -1 else self.seed
    # Document masking, as OLMo-core's: the documents packed into an instance (each ended by
    # the tokenizer's EOS, as loader.document_lengths cuts them) do not attend to each other
    # and their RoPE positions restart at 0 (model.doc_mask_eos). False = plain causal
    # attention across the whole instance (OLMo-core's default).
    doc_mask: bool = False

    def validate(self, prefix: str = "data") -> DataConfig:
        if self.seed < -1:
            raise ConfigError(f"{prefix}.seed must be >= 0, or -1 (= trainer.seed), got {self.seed}")
        if self.remote_cache_mb < 1:
            raise ConfigError(f"{prefix}.remote_cache_mb must be >= 1 (MiB of the object-store "
                              f"read cache), got {self.remote_cache_mb}")
        if self.prefetch < 0:
            raise ConfigError(f"{prefix}.prefetch must be >= 0 (0 = no read-ahead), got {self.prefetch}")
        check_choice(f"{prefix}.instances", self.instances, INSTANCES)
        if self.repetition_filter and self.instances != "olmo_core":
            raise ConfigError(
                f"{prefix}.repetition_filter needs {prefix}.instances='olmo_core' (a filtered "
                "instance is marked in its unlabelled last position); set it, or "
                f"{prefix}.repetition_filter=False")
        rule = RepetitionFilter(self.repetition_max_period, self.repetition_min_period,
                                self.repetition_max_count)
        if self.repetition_filter and rule.problem():
            raise ConfigError(rule.problem())
        if self.requested_tokens < 0:
            raise ConfigError(f"{prefix}.requested_tokens={self.requested_tokens} must be > 0, "
                              "or 0 for the run's tokens (trainer.max_steps global batches)")
        if self.paths and (self.mix or self.sources):
            raise ConfigError(
                f"{prefix}.paths is set together with {prefix}."
                f"{'mix' if self.mix else 'sources'}; give the token files one way: clear "
                f"{prefix}.paths, or clear {prefix}.mix and {prefix}.sources")
        if self.sources and not self.mix:  # with a mix, a source's paths may come from it
            try:
                parse_sources(self.sources, f"{prefix}.sources")
            except DataError as e:
                raise ConfigError(str(e)) from e
        return self
