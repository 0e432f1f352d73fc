"""The run config's `optim` section as a typed dataclass (olmo_jax/config.py generates the
ConfigDict from it): the optimizer, its learning-rate schedule and Muon's knobs."""

from __future__ import annotations

from dataclasses import dataclass

from olmo_jax.errors import ConfigError, check_choice
from olmo_jax.optim import groups, schedulers
from olmo_jax.optim.optimizer import OPTIMIZERS
from olmo_jax.optim.schedules import LR_SCHEDULES


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # OPTIMIZERS: adamw | muon (Muon on weight matrices, AdamW on the rest)
    lr: float = 3e-3
    schedule: str = "cosine"  # schedules.LR_SCHEDULES: cosine | wsd | constant
    warmup_steps: int = 20
    shorten_warmup: bool = False  # True: a warmup_steps > trainer.max_steps is cut to the run (else refused)
    min_lr_ratio: float = 0.1  # final lr / peak lr
    decay_fraction: float = 0.2  # wsd: fraction of steps spent decaying
    # OLMo-core's scheduler, as its Python writes it (optim/schedulers.py), e.g.
    # "cos_with_warmup(warmup=2000, units='tokens')"; it replaces schedule, warmup_steps,
    # min_lr_ratio and decay_fraction. "" = the schedule above.
    scheduler: str = ""
    weight_decay: float = 0.1
    # Per-parameter-group lr / weight-decay multipliers by glob on parameter paths (optim/groups.py,
    # OLMo-core's group_overrides), e.g. "*router*,embedding: wd_mult=0.0; lm_head: lr_mult=0.5"
    group_overrides: str = ""
    decay_embeddings: bool = True  # False: no weight decay on the token embedding (OLMo-core's runs)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_grad_norm: float = 1.0  # 0 = no clipping
    muon_beta: float = 0.95  # muon: momentum
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations
    muon_rms: float = 0.2  # muon: update RMS of every matrix (scale rule: RMS matched to AdamW)
    muon_lr: float = 0.0  # muon: peak lr of the matrices (0 = optim.lr, which the scale rule allows)

    def validate(self, prefix: str = "optim") -> OptimConfig:
        check_choice(f"{prefix}.schedule", self.schedule, LR_SCHEDULES)
        check_choice(f"{prefix}.name", self.name, OPTIMIZERS)
        if self.scheduler:
            schedulers.parse(self.scheduler)
        if self.group_overrides:
            groups.parse(self.group_overrides)
            if self.name == "muon":
                raise ConfigError(
                    f"{prefix}.group_overrides with {prefix}.name=muon: per-group overrides are "
                    "AdamW's (as in OLMo-core, not for matrix-aware optimizers); use adamw or "
                    f"leave {prefix}.group_overrides empty")
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{prefix}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.name == "muon":
            if not 0 <= self.muon_beta < 1:
                raise ConfigError(f"{prefix}.muon_beta must be in [0, 1), got {self.muon_beta}")
            if self.muon_ns_steps < 1:
                raise ConfigError(f"{prefix}.muon_ns_steps must be >= 1, got {self.muon_ns_steps}")
            if self.muon_rms <= 0:
                raise ConfigError(f"{prefix}.muon_rms must be > 0, got {self.muon_rms}")
            if self.muon_lr < 0:
                raise ConfigError(f"{prefix}.muon_lr must be >= 0 (0 = optim.lr), got {self.muon_lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"{prefix}.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"{prefix}.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        return self
