"""olmo_jax: mixture-of-experts language model training in JAX/XLA (OLMo-core 3's design, in JAX)."""

__version__ = "0.1.0"
