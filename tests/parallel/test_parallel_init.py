"""The inputs of a step do not depend on the mesh: parameters are initialized on the
host from the seed alone (whatever dispatcher the model is built with) and then placed;
a global batch is laid out so that microbatch i holds the same sequences on any mesh."""

import jax
import numpy as np
import pytest

from olmo_jax.trainer.state import init_state
from tests.parallel.harness import batches, host_state, make_cfg, with_capacity
from tests.sections import plan_for


def test_initial_parameters_do_not_depend_on_dispatcher_or_placement():
    model_cfg, tx, _, _, state = host_state()
    plan = plan_for(make_cfg(2, 4, "ragged"), model_cfg)
    _, with_dispatcher = init_state(model_cfg, tx, 0, dispatcher=plan.dispatcher)
    placed = jax.device_put(with_dispatcher, plan.state_shardings(with_dispatcher, tx))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(placed.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("mesh", [(2, 4), (4, 2), (1, 8)])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_microbatch_i_is_the_same_sequences_on_every_mesh(mesh, grad_accum):
    cfg = make_cfg(*mesh, grad_accum=grad_accum, batch=16)
    plan = plan_for(cfg, with_capacity(host_state()[0], cfg))
    batch = batches(batch=16)[0]
    placed = plan.place_batch(batch)
    micro = 16 // grad_accum
    np.testing.assert_array_equal(np.asarray(placed).reshape(batch.shape), batch)
    rows = micro // 8  # each device's rows of each microbatch
    for shard in placed.addressable_shards:
        _, d, _, e = (int(i) for i in np.argwhere(plan.mesh.devices == shard.device)[0])
        rank = d * mesh[1] + e  # position in the data x expert split
        for i in range(grad_accum):
            start = i * micro + rank * rows
            np.testing.assert_array_equal(np.asarray(shard.data)[i], batch[start:start + rows])
