"""The golden loss curve (tests/golden/tiny_loss_curve.json, written by
tools/testing/golden_curve.py --write): the default configs/tiny.py run's first 16 losses,
float32, on one device and on data 2 x expert 4. Re-trained here by the real trainer in
child processes and diffed step by step at the JSON's relative tolerance (rtol: each step
within rtol of its golden loss; the two checked-in meshes are within rtol of each other), so a change
that moves the default run's numbers (init, data order, optimizer, the model's math, a
sharding that changes the sums) shows as a failed step. A change meant to move them
rewrites the JSON in the same commit."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("golden_curve", REPO / "tools" / "testing" / "golden_curve.py")
gc = sys.modules["golden_curve"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)


@pytest.fixture(scope="module")
def golden():
    return gc.load()


def test_the_checked_in_curve_is_the_scripts_run(golden):
    """The JSON states the run the script makes (config, overrides, meshes, tolerance)."""
    assert golden["config"] == gc.CONFIG and golden["overrides"] == gc.OVERRIDES
    assert golden["meshes"] == {m: {"devices": d, **o} for m, (d, o) in gc.MESHES.items()}
    assert golden["rtol"] == gc.RTOL
    assert all(len(c) == gc.STEPS for c in golden["curves"].values())
    assert not gc.check(golden["curves"], golden), "the checked-in meshes disagree at rtol"


@pytest.mark.parametrize("mesh", list(gc.MESHES))
def test_the_default_run_reproduces_the_golden_curve(golden, mesh):
    """Each mesh's run against its checked-in curve (the checked-in curves agree with each
    other at rtol, test above). The one-device run is in the fast tier (`make check`), the
    8-device run in the slow tier (tests/conftest.py SLOW)."""
    errors = gc.check({mesh: gc.run_curve(mesh)}, golden)
    assert not errors, "\n".join(errors)


def _tiny_config():
    spec = importlib.util.spec_from_file_location("tiny_config", REPO / gc.CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


NEGATIVE_STEPS = 3  # a 0.1% larger learning rate leaves RTOL by step 2


@pytest.mark.slow
def test_a_slightly_different_run_fails_the_check(golden):
    """The tolerance catches a 0.1% larger learning rate (on one device) within the curve's
    first NEGATIVE_STEPS steps. (Another init seed, a far larger change, moves step 1's
    loss: it is caught as surely, and its child run was left out for the suite's time.)"""
    cfg = _tiny_config()
    losses = gc.run_curve("1_device", {"optim.lr": cfg.optim.lr * 1.001}, steps=NEGATIVE_STEPS)
    assert gc.mismatches(losses, golden["curves"]["1_device"], golden["rtol"])
