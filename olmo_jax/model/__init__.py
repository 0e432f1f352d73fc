"""Single-device model math in Flax NNX; sharding appears only as logical axis names.

    from olmo_jax.model import Transformer, TransformerConfig, MoEConfig
"""

from olmo_jax.model.config import ConfigError, MoEConfig, TransformerConfig
from olmo_jax.model.transformer import Output, Transformer

__all__ = ["ConfigError", "MoEConfig", "Output", "Transformer", "TransformerConfig"]
