"""olmo_jax/trainer/state.py `init_state` / `initializer`: the train state made by one compiled program, on
the shardings asked for (what `python -m olmo_jax.train` starts from when nothing is
resumed). Reference: the model built op by op (eager) from the same seed. Every leaf
equals it bitwise, on one device and sharded over data 2 x expert 4 (ragged dispatch's
model, the expert weights and their AdamW moments split over `expert`); each sharded leaf
is made on its sharding, and on a device the program's outputs and temporaries together
are less than the whole state: no device makes the state and then slices it."""

import jax
import numpy as np
from flax import nnx

from olmo_jax.model import Transformer
from olmo_jax.trainer.state import abstract_train_state, init_state, initializer
from tests.parallel.harness import host_state, make_cfg, with_capacity
from tests.sections import plan_for


def _eager(model_cfg, seed, dispatcher=None):
    model = Transformer(model_cfg, rngs=nnx.Rngs(params=seed), dispatcher=dispatcher)
    return nnx.split(model, nnx.Param, ...)


def _assert_bitwise(made, ref):
    leaves = jax.tree.leaves_with_path(made)
    assert len(leaves) == len(jax.tree.leaves(ref))
    for (path, a), b in zip(leaves, jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_one_device_state_equals_the_eager_model():
    model_cfg, tx, *_ = host_state()
    graphdef, state = init_state(model_cfg, tx, 3)
    ref_graphdef, params, model_state = _eager(model_cfg, 3)
    assert graphdef == ref_graphdef and jax.tree.leaves(state.params)
    _assert_bitwise(state.params, params)
    _assert_bitwise(state.model_state, model_state)
    _assert_bitwise(state.opt_state, tx.init(params))
    assert int(state.step) == 0


def test_sharded_state_is_made_on_its_shardings():
    cfg = make_cfg(2, 4, "ragged")
    model_cfg, tx, *_ = host_state()
    model_cfg = with_capacity(model_cfg, cfg)
    plan = plan_for(cfg, model_cfg)
    _, abstract = abstract_train_state(model_cfg, tx, dispatcher=plan.dispatcher)
    shardings = plan.state_shardings(abstract, tx)
    compiled = initializer(model_cfg, tx, 0, plan.dispatcher, shardings=shardings).lower().compile()
    state = compiled()
    for a, sh in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        assert a.sharding.is_equivalent_to(sh, a.ndim), (a.shape, a.sharding, sh)
    split = [a for a in jax.tree.leaves(state.params) if not a.sharding.is_fully_replicated]
    assert split, "the expert weights are split over `expert`"
    _, params, model_state = _eager(model_cfg, 0, plan.dispatcher)
    _assert_bitwise(state.params, params)
    _assert_bitwise(state.model_state, model_state)
    # Per device: what the program writes and uses beside is less than the whole state.
    whole = sum(a.nbytes for a in jax.tree.leaves(state))
    mem = compiled.memory_analysis()
    per_device = mem.output_size_in_bytes + mem.temp_size_in_bytes
    print(f"state {whole:,} B; per device: outputs {mem.output_size_in_bytes:,} B, temporaries "
          f"{mem.temp_size_in_bytes:,} B")
    assert per_device < whole, (per_device, whole)
