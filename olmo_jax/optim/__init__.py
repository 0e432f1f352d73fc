"""Optimizer (optax chain) and learning-rate schedules."""

from olmo_jax.optim.optimizer import build_optimizer
from olmo_jax.optim.schedules import lr_schedule

__all__ = ["build_optimizer", "lr_schedule"]
