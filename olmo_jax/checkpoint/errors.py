"""The error every checkpoint and conversion failure raises: it names the file, item or
parameter at fault and, where there is one, the fix."""

from __future__ import annotations

from olmo_jax.model.config import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint or Hugging Face folder is missing, incomplete, corrupt, does not fit
    the model, or holds something olmo_jax cannot represent."""
