"""The model's structure without allocating: `abstract_model(cfg)` -> (graphdef, params,
model_state) with jax.ShapeDtypeStructs for leaves (nnx.eval_shape), for what needs the
shapes and logical axes of the weights but not their values: the parallel plan's
layouts, checkpoint restores and conversion, the trainer's abstract state.
"""

from __future__ import annotations

from flax import nnx

from olmo_jax.model.config import TransformerConfig
from olmo_jax.model.transformer import Transformer


def abstract_model(model_cfg: TransformerConfig, dispatcher=None):
    """(graphdef, abstract params, abstract model_state) without allocating."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0), dispatcher=dispatcher))
    return nnx.split(abstract, nnx.Param, ...)
