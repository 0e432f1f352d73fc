"""The reference's benchmark configs have the reference's parameter counts and FLOPs,
checked on abstract shapes (jax.eval_shape: nothing is allocated)."""

import runpy
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from olmo_jax import config as config_lib
from olmo_jax import metrics
from olmo_jax.model import Transformer

ROOT = Path(__file__).resolve().parents[1]

# name -> (total, active) from the reference (DESIGN §6), checked within 0.1%.
EXPECTED = {
    "olmoe3_47b": (46.863e9, 3.175e9),
    "olmoe3_1p2t": (1.2005e12, 58.36e9),
    "olmoe3_2p4t": (2.3795e12, 58.41e9),
}


def _model_cfg(name):
    return config_lib.model_config(runpy.run_path(str(ROOT / f"configs/{name}.py"))["get_config"]())


def _abstract_param_count(model_cfg) -> int:
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_parameter_counts(name):
    model_cfg = _model_cfg(name)
    total, active = metrics.param_counts(model_cfg)
    assert _abstract_param_count(model_cfg) == total
    want_total, want_active = EXPECTED[name]
    assert abs(total / want_total - 1) < 1e-3, (name, total)
    assert abs(active / want_active - 1) < 1e-3, (name, active)


def test_47b_flops_per_token():
    cfg = runpy.run_path(str(ROOT / "configs/olmoe3_47b.py"))["get_config"]()
    flops = metrics.flops_per_token(config_lib.model_config(cfg), cfg.trainer.seq_len)
    assert abs(flops / 18.19e9 - 1) < 0.01, flops


def test_4p6b_and_1b7b_sizes():
    total, _ = metrics.param_counts(_model_cfg("olmoe3_4p6b"))
    assert abs(total / 4.6e9 - 1) < 0.01, total
    total, active = metrics.param_counts(_model_cfg("olmoe_1b7b"))
    assert abs(total / 6.92e9 - 1) < 0.01 and abs(active / 1.28e9 - 1) < 0.02, (total, active)
