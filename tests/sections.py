"""Tests write their configs as ConfigDicts (as configs/*.py do) and hand them to the
builders the way the entry points do: as typed sections (olmo_jax.config.parse)."""

from olmo_jax.config import parse
from olmo_jax.parallel.strategy import build_plan


def plan_for(cfg, model_cfg, **kw):
    """build_plan of the ConfigDict `cfg`'s sections (parsed, not validated: the plan's own
    checks are what a test may be after)."""
    run = parse(cfg)
    return build_plan(run.parallel, run.trainer, model_cfg, optim=run.optim, **kw)
