"""Checkpoints: orbax save / resume / reshard for training runs (`manager`; when a run
saves and what it resumes from is the trainer's, olmo_jax/trainer/checkpoints.py), and
two-way Hugging Face OLMoE conversion (`hf`, `hf_config`, `safetensors_io`).

    from olmo_jax.checkpoint.hf import load_model, save_model
    model = load_model("path/to/hf_olmoe")      # model(ids[B, T]) -> logits [B, T, V]
"""

from olmo_jax.checkpoint.manager import Checkpoints, resolve
from olmo_jax.errors import CheckpointError

__all__ = ["CheckpointError", "Checkpoints", "resolve"]
