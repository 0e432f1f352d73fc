"""Router losses on a mesh: by default from GLOBAL counts (so they equal the
single-device losses of the whole batch; covered by test_parallel_invariance), and with
model.moe.lb_granularity = "local" the mean over data-parallel ranks of each rank's
load-balancing loss from its own tokens."""

import dataclasses

import jax
import numpy as np

from olmo_jax.model.abstract import abstract_model
from olmo_jax.objective import forward_losses
from tests.parallel.harness import FAST_COMPILE, batches, host_state, make_cfg
from tests.sections import plan_for


def test_local_granularity_is_the_mean_of_per_rank_losses():
    model_cfg, tx, _, graphdef, state = host_state()
    local_cfg = model_cfg.replace(moe=dataclasses.replace(model_cfg.moe, lb_granularity="local"))
    batch = batches()[0]  # 8 sequences: one per rank on 8 devices
    plan = plan_for(make_cfg(2, 4, "allgather"), local_cfg)
    graphdef_ep = abstract_model(local_cfg, plan.dispatcher)[0]
    lb_of = plan.shard_eval(lambda p, ms, b: forward_losses(graphdef_ep, p, ms, b, local_cfg,
                                                            parallel=plan).lb_loss)
    placed = jax.device_put(state, plan.state_shardings(state, tx))
    lb_local = float(jax.jit(lb_of).lower(placed.params, placed.model_state,
                                          plan.place_batch(batch, 1)).compile(FAST_COMPILE)(
        placed.params, placed.model_state, plan.place_batch(batch, 1)))

    single = jax.jit(lambda p, ms, b: forward_losses(graphdef, p, ms, b, model_cfg).lb_loss)
    per_rank = [float(single(state.params, state.model_state, batch[r:r + 1])) for r in range(8)]
    whole = float(single(state.params, state.model_state, batch))
    np.testing.assert_allclose(lb_local, np.mean(per_rank), rtol=1e-5)
    assert abs(lb_local - whole) > 1e-3  # and it is not the global loss
