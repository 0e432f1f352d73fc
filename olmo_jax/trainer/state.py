"""The training state: one pytree holding everything a step reads and writes.

    TrainState(step, params, opt_state, model_state, rng, guard)

`params` are the model's float32 `nnx.Param`s; `model_state` holds its other variables
(e.g. router biases, which the optimizer never touches); `guard` the skipped-step counts
and recent losses of the bad-step rules (trainer/guard.py); the model's structure (its
`nnx.GraphDef`) is static and kept outside the state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from olmo_jax.model import Transformer, TransformerConfig
from olmo_jax.model.abstract import abstract_model
from olmo_jax.trainer.guard import GuardConfig, GuardState, init_guard


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: number of completed optimizer steps
    params: nnx.State
    opt_state: Any
    model_state: nnx.State
    rng: jax.Array  # a key for stochastic parts of the step (router jitter, random routing)
    guard: GuardState | None = None  # bad-step counts and loss window (set by the builders below)


def initial_rng(seed: int) -> jax.Array:
    """The state's RNG key data for a run seeded with `seed`."""
    return jax.random.key_data(jax.random.key(seed + 1))


def abstract_train_state(model_cfg: TransformerConfig, tx: optax.GradientTransformation,
                         dispatcher=None, guard_cfg: GuardConfig | None = None,
                         ) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, TrainState of jax.ShapeDtypeStructs): the state's structure without
    allocating or initializing anything (what a restore reads into)."""
    graphdef, params, model_state = abstract_model(model_cfg, dispatcher)
    state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=params,
        opt_state=jax.eval_shape(tx.init, params),
        model_state=model_state,
        rng=jax.eval_shape(initial_rng, 0),
        guard=jax.eval_shape(lambda: init_guard(guard_cfg or GuardConfig())),
    )
    return graphdef, state


def initializer(model_cfg: TransformerConfig, tx: optax.GradientTransformation, seed: int,
                dispatcher=None, guard_cfg: GuardConfig | None = None, shardings=None):
    """The jitted function of no arguments that makes the TrainState of `init_state`; for
    a caller that has the graphdef already (e.g. from `abstract_train_state`)."""

    def build() -> TrainState:
        model = Transformer(model_cfg, rngs=nnx.Rngs(params=seed), dispatcher=dispatcher)
        _, params, model_state = nnx.split(model, nnx.Param, ...)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            model_state=model_state,
            rng=initial_rng(seed),
            guard=init_guard(guard_cfg or GuardConfig()),
        )

    return jax.jit(build, out_shardings=shardings)


def init_state(model_cfg: TransformerConfig, tx: optax.GradientTransformation, seed: int,
               dispatcher=None, guard_cfg: GuardConfig | None = None, shardings=None):
    """Builds the model from `seed` and returns (graphdef, TrainState), the whole state made
    by one compiled program. With `shardings` (a TrainState of shardings, e.g.
    `plan.state_shardings`) each device computes only the shards it holds, so no device
    ever holds the whole state; without, it lands on the default device. Parameter values
    depend only on the seed: not on the sharding (JAX's partitionable threefry) and not on
    being compiled as one program (they equal the module built op by op, bitwise:
    tests/trainer/test_init_state.py)."""
    graphdef, _, _ = abstract_model(model_cfg, dispatcher)
    return graphdef, initializer(model_cfg, tx, seed, dispatcher, guard_cfg, shardings)()
