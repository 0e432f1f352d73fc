"""Where every parameter and optimizer-state leaf lives, for a reference config (the
harness model on pipe=1 x data=2 x expert=4), per strategy, compared with the checked-in
golden file tests/parallel/golden/placement.txt.

After an intended placement change, regenerate the file and review its diff:
    OLMO_JAX_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/parallel/test_parallel_placement.py
"""

import ast
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from olmo_jax.config import model_config
from olmo_jax.model.abstract import abstract_model
from olmo_jax.optim import build_optimizer
from olmo_jax.trainer.state import TrainState
from tests.parallel.harness import make_cfg
from tests.sections import plan_for

GOLDEN = Path(__file__).parent / "golden" / "placement.txt"
CASES = [("ddp", True), ("ddp", False), ("fsdp", True)]


def placement_text() -> str:
    out = []
    for strategy, zero1 in CASES:
        cfg = make_cfg(data=2, expert=4, strategy=strategy, zero1=zero1)
        model_cfg = model_config(cfg)
        tx, _ = build_optimizer(cfg.optim, cfg.trainer.max_steps)
        _, params, model_state = abstract_model(model_cfg)
        state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params,
                           jax.eval_shape(tx.init, params), model_state,
                           jax.ShapeDtypeStruct((2,), jnp.uint32))
        plan = plan_for(cfg, model_cfg, abstract_params=params)
        out.append(f"[strategy={strategy} zero1={zero1} mesh pipe=1 data=2 expert=4]")
        out += plan.placement(state, tx)
    return "\n".join(out) + "\n"


def test_placement_matches_golden_file():
    text = placement_text()
    if os.environ.get("OLMO_JAX_REGEN_GOLDEN"):
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"missing {GOLDEN}; generate it with OLMO_JAX_REGEN_GOLDEN=1"
    assert text == GOLDEN.read_text(), "placement changed; see the module docstring to regenerate"


def test_golden_file_says_what_the_design_says():
    lines = GOLDEN.read_text().splitlines()
    sections, current = {}, None
    for line in lines:
        if line.startswith("["):
            current = sections.setdefault(line, [])
        else:
            current.append(line.split(" ", 2))
    ddp0, ddp_plain, fsdp = sections.values()
    experts = [ast.literal_eval(s) for p, _, s in ddp0 if "/experts/" in p]
    others = [s for p, _, s in ddp0 if "/experts/" not in p and "/count" not in p]
    # ZeRO-1: experts on `expert` (dim 1 after the layer axis) and split over `data` on
    # another dim; everything else split over all 8 devices.
    assert experts and all(s[1] == "expert" and "data" in s for s in experts)
    assert all("('data', 'expert')" in s for s in others)
    assert all("'data'" not in s for _, _, s in ddp_plain)  # DDP: replicated over data
    assert all(s.startswith("(None, 'expert'") for p, _, s in ddp_plain if "/experts/" in p)
    fsdp_params = [s for p, _, s in fsdp if "/count" not in p]
    assert all("('data', 'expert')" in s for s in fsdp_params)  # FSDP: experts too, over all
