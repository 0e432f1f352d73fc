"""Bad-step rules on the device (olmo_jax/trainer/guard.py): the spike rule equals a plain
NumPy transcription of OLMo-core's SkipStepOptimizer; a non-finite or spiking step's
update is discarded bitwise inside the jitted step, counted, and halts as configured."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.trainer import guard as g
from olmo_jax.trainer.state import TrainState


def olmo_core_skips(losses, grad_norms, sigma, window):
    """OLMo-core's rule: the last window+1 values are kept; once there are at least
    max(2, window // 2), a step is skipped if its loss or grad norm exceeds the mean of the
    earlier ones by more than sigma unbiased standard deviations."""
    skips, hist_l, hist_g = [], [], []
    for loss, gn in zip(losses, grad_norms, strict=True):
        hist_l, hist_g = (hist_l + [loss])[-(window + 1):], (hist_g + [gn])[-(window + 1):]
        if len(hist_l) < max(2, window // 2):
            skips.append(False)
            continue
        prev_l, prev_g = np.array(hist_l[:-1]), np.array(hist_g[:-1])
        skips.append(bool(loss - prev_l.mean() > sigma * prev_l.std(ddof=1)
                          or gn - prev_g.mean() > sigma * prev_g.std(ddof=1)))
    return skips


def run_judge(losses, grad_norms, cfg):
    judge = jax.jit(lambda gs, l, n, s: g.judge(gs, l, n, s, cfg))
    state, out = g.init_guard(cfg), []
    for i, (loss, gn) in enumerate(zip(losses, grad_norms, strict=True)):
        apply, reason, state = judge(state, loss, gn, i + 1)
        out.append((bool(apply), int(reason)))
    return out, state


def test_spike_rule_matches_olmo_core():
    rng = np.random.default_rng(0)
    losses = list(3.0 - 0.01 * np.arange(60) + 0.05 * rng.standard_normal(60))
    grads = list(1.0 + 0.1 * rng.standard_normal(60))
    losses[30] += 2.0  # a loss spike
    grads[45] *= 5.0  # a gradient-norm spike
    cfg = g.GuardConfig(spike_sigma=3.0, spike_window=16, max_skipped=0)
    got, state = run_judge(losses, grads, cfg)
    expected = olmo_core_skips(losses, grads, 3.0, 16)
    assert [not a for a, _ in got] == expected
    assert expected[30] and expected[45] and sum(expected) == 2
    assert got[30][1] == g.LOSS_SPIKE and got[45][1] == g.GRAD_SPIKE
    assert int(state.skipped) == 2 and int(state.halt_step) == 0
    # Before max(2, window // 2) values are known the rule is off, however large the loss.
    early, _ = run_judge([1.0] * 7 + [1e6], [1.0] * 8, cfg)
    assert all(a for a, _ in early)


def test_nonfinite_counts_and_halts():
    nan, inf = float("nan"), float("inf")
    skip = g.GuardConfig(nan_policy="skip", max_skipped=2)
    got, state = run_judge([1.0, nan, 1.0, 1.0, nan, 1.0, inf, 1.0], [1.0, 1.0, 1.0, inf, 1.0, nan, 1.0, 1.0], skip)
    assert [a for a, _ in got] == [True, False, True, False, False, False, False, False]
    assert got[1][1] == g.LOSS_NONFINITE and got[3][1] == g.GRAD_NONFINITE
    # Steps 4 and 5 skipped in a row = max_skipped: halted at step 5, everything after skipped.
    assert int(state.halt_step) == 5 and int(state.halt_reason) == g.LOSS_NONFINITE | g.TOO_MANY
    assert int(state.skipped) == 6 and int(state.appended) == 2  # finite, before the halt
    halt = g.GuardConfig(nan_policy="halt")
    got, state = run_judge([1.0, 2.0, 3.0], [1.0, inf, 1.0], halt)
    assert [a for a, _ in got] == [True, False, False]
    assert (int(state.halt_step), int(state.halt_reason)) == (2, g.GRAD_NONFINITE)
    msg = g.halt_message(2, g.GRAD_NONFINITE, halt, 1, "runs/x/checkpoints")
    assert "halted at step 2" in msg and "loss is finite and grad_norm is non-finite" in msg
    assert "step 1 in runs/x/checkpoints" in msg and "trainer.nan_policy=halt" in msg


def _toy_state(cfg):
    params = {"w": jnp.arange(4.0), "b": jnp.ones(2)}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state={"mu": jnp.zeros(4)}, model_state={"bias": jnp.zeros(3)},
                      rng=jnp.zeros(2, jnp.uint32), guard=g.init_guard(cfg))


def _poisoning_step(state, batch):
    """A stand-in train step whose gradient is poisoned when batch[0] is nan: the update
    (params, moments, model state) is nan and so is the gradient norm; the loss is finite."""
    poison = jnp.isnan(batch[0])
    upd = jnp.where(poison, jnp.nan, 0.5)
    new = state._replace(
        step=state.step + 1,
        params=jax.tree.map(lambda p: p - upd, state.params),
        opt_state=jax.tree.map(lambda m: m + upd, state.opt_state),
        model_state=jax.tree.map(lambda b: b + upd, state.model_state),
    )
    return new, {"loss": jnp.float32(2.0), "grad_norm": jnp.abs(upd) * 3}


@pytest.mark.parametrize("policy", ["skip", "halt"])
def test_poisoned_gradient_update_is_discarded_on_device(policy):
    cfg = g.GuardConfig(nan_policy=policy, max_skipped=3)
    step = jax.jit(g.guarded(_poisoning_step, cfg), donate_argnums=0)
    state = _toy_state(cfg)
    state, m = step(state, jnp.ones(1))
    before = jax.tree.map(np.asarray, state)
    state, m = step(state, jnp.full(1, jnp.nan))
    after = jax.tree.map(np.asarray, state)
    for part in ("params", "opt_state", "model_state"):  # bitwise the pre-step values
        jax.tree.map(np.testing.assert_array_equal, getattr(after, part), getattr(before, part))
    assert int(after.step) == 2 and int(m["skipped"]) == 1 and int(m["skipped_steps"]) == 1
    assert int(m["halted"]) == (2 if policy == "halt" else 0)
    state, m = step(state, jnp.ones(1))  # a good step: applied under skip, not after a halt
    applied = not np.array_equal(np.asarray(state.params["w"]), after.params["w"])
    assert applied == (policy == "skip")
    assert int(m["skipped_steps"]) == (1 if policy == "skip" else 2)
