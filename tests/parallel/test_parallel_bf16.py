"""bf16 compute copies (olmo_jax/parallel/zero.py): with model.dtype=bfloat16 the weights
the model casts at use (model/params.py CAST_AT_USE) are cast from their float32 shards
before the ZeRO-1 / FSDP / pipeline gathers, so every gather of them moves bf16, while the
gradients are summed and reduced in float32 and the float32 master weights and AdamW
moments stay sharded.

- The copy changes no value: on one device the bf16 model's loss and float32 gradients
  from compute copies equal, bit for bit, those from the float32 weights.
- The program JAX lowers (before XLA:CPU's own widening converts) all-gathers exactly the
  CAST_AT_USE shards in bf16 and everything else in f32, and every reduce-scatter (the
  gradient reductions) is f32; with a pipeline the all_to_all over `pipe` moves the bf16
  copies too and the gradients' way back is f32.
- Numerics: bf16 runs on 8 devices (ddp + ZeRO-1 + expert parallelism, FSDP, interleaved
  1F1B over pipe x data x expert) against the single-device bf16 run: the same losses
  within 1e-5 (first step) and 5e-3 (five AdamW steps), gradients within 3e-2 (bf16
  weight gradients; float32 runs match within 1e-5, test_parallel_invariance.py).
"""

import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.model.params import CAST_AT_USE, compute_copy_dtype, path_name
from olmo_jax.parallel import zero
from olmo_jax.trainer.step import make_grads_fn
from tests.parallel.harness import (
    Pipe,
    batches,
    host_state,
    make_cfg,
    plan_run,
    reference_run,
    rel_err,
    with_capacity,
)
from tests.parallel.test_parallel_invariance import _leaves, _total
from tests.sections import plan_for

BF16 = "bfloat16"
PIPE_LAYERS, PIPE_BATCH = (10, 1), 16
PIPE = Pipe(2, "interleaved_1f1b", 4, 2)  # x data 2 x expert 2, 4 microbatches, 2 virtual


def _runs():
    return {
        "ddp": (plan_run(2, 4, "rowwise", dtype=BF16), reference_run(dtype=BF16)),
        "fsdp": (plan_run(2, 4, strategy="fsdp", dtype=BF16), reference_run(dtype=BF16)),
        "pipe": (plan_run(2, 2, "rowwise", batch=PIPE_BATCH, layers=PIPE_LAYERS, pipe=PIPE,
                          dtype=BF16),
                 reference_run(grad_accum=PIPE.microbatches, batch=PIPE_BATCH,
                               layers=PIPE_LAYERS, dtype=BF16)),
    }


CASES = ["ddp", "fsdp", "pipe"]


def test_compute_copies_change_no_value():
    model_cfg, _, _, graphdef, state = host_state(dtype=BF16)
    grads_fn = jax.jit(make_grads_fn(graphdef, model_cfg, grad_accum=2))
    copies = jax.tree_util.tree_map_with_path(
        lambda p, x: x.astype(compute_copy_dtype(p, x, jnp.bfloat16) or x.dtype), state.params)
    dtypes = collections.Counter(str(x.dtype) for x in jax.tree.leaves(copies))
    assert dtypes["bfloat16"] and dtypes["float32"], dtypes  # some weights cast, some not
    batch, key = jnp.asarray(batches()[0]), jax.random.key(0)
    g_ref, parts_ref = grads_fn(state.params, state.model_state, batch, key)
    g, parts = grads_fn(copies, state.model_state, batch, key)
    for a, b in zip(jax.tree.leaves((g, parts)), jax.tree.leaves((g_ref, parts_ref)), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert {x.dtype for x in jax.tree.leaves(g)} == {jnp.dtype(jnp.float32)}


def _ops(hlo: str, op: str) -> collections.Counter:
    """(dtype, dims) of every `op` in an HLO text."""
    return collections.Counter(re.findall(rf"= (\w+)\[([\d,]*)\][^\n]*? {op}\(", hlo))


def _layouts(case):
    """The plan and (is cast at use, compute shape, layout) of every parameter."""
    layers = PIPE_LAYERS if case == "pipe" else (2, 0)
    if case == "pipe":
        cfg = make_cfg(2, 2, batch=PIPE_BATCH, layers=layers, pipe=PIPE)
    else:
        cfg = make_cfg(2, 4, strategy="fsdp" if case == "fsdp" else "ddp")
    model_cfg, _, _, _, state = host_state(layers=layers, dtype=BF16)
    plan = plan_for(cfg, with_capacity(model_cfg, cfg))
    out = []
    lays = jax.tree.leaves(plan.layouts, is_leaf=lambda v: isinstance(v, zero.ParamLayout))
    for (path, x), lay in zip(jax.tree_util.tree_leaves_with_path(state.params), lays, strict=True):
        cast = path_name(path).rsplit("/", 1)[-1] in CAST_AT_USE
        assert (lay.dtype == BF16) == cast, (path_name(path), lay)
        out.append((cast, x.shape, lay))
    return plan, out


@pytest.mark.parametrize("case", CASES)
def test_gathers_move_bf16_copies_and_gradients_reduce_in_f32(case):
    run = _runs()[case][0]
    gathers, scatters = _ops(run.lowered, "all-gather"), _ops(run.lowered, "reduce-scatter")
    print(case, "all-gathers", dict(gathers), "reduce-scatters", dict(scatters))
    plan, leaves = _layouts(case)
    split = [(cast, shape, lay) for cast, shape, lay in leaves if lay.dim is not None]
    assert any(cast for cast, *_ in split) and any(not cast for cast, *_ in split)
    # One bf16 all-gather per split weight cast at use (ZeRO-1: once per step; FSDP: in
    # the microbatch's loss), plus, with a pipeline, one over `pipe` per non-stage weight
    # split over it; every f32 all-gather gathers a weight used in float32.
    expected = sum(cast for cast, *_ in split)
    if case == "pipe":
        expected += sum(cast and not lay.stage and lay.pipe_dim is not None
                        for cast, _, lay in leaves)
    assert sum(n for (dt, _), n in gathers.items() if dt == "bf16") == expected
    assert set(dt for dt, _ in gathers) == {"bf16", "f32"}
    # Every gradient reduction is float32, and there is one per split weight at least.
    assert scatters and set(dt for dt, _ in scatters) == {"f32"}
    assert sum(scatters.values()) >= len(split)
    if case == "pipe":  # the stage weights' all_to_all: bf16 copies out, f32 gradients back
        a2a = _ops(run.lowered, "all-to-all")
        moved = sum(cast for cast, _, lay in leaves if lay.stage and lay.pipe_dim is not None)
        assert moved
        # out: one bf16 all_to_all per cast stage weight (the dispatch adds its own bf16
        # ones); back: f32 for every stage weight
        assert sum(n for (d, _), n in a2a.items() if d == "bf16") >= moved
        assert sum(n for (d, _), n in a2a.items() if d == "f32") >= sum(
            lay.stage and lay.pipe_dim is not None for _, _, lay in leaves)
    # Stored state: the master weights and both AdamW moments stay float32 and sharded.
    for x in jax.tree.leaves((run.state.params, run.state.opt_state[1])):
        if x.ndim:
            assert x.dtype == jnp.float32
    for _, shape, lay in split:
        dp = math.prod(plan.mesh.shape[a] for a in lay.axes)
        assert dp > 1 and shape[lay.dim] % dp == 0


@pytest.mark.parametrize("case", CASES)
def test_bf16_on_a_mesh_matches_bf16_on_one_device(case):
    run, ref = _runs()[case]
    m, r = run.metrics[0], ref.metrics[0]
    errs = {
        "loss": rel_err(_total(m), _total(r)),
        "grads": max(rel_err(g, x) for g, x in zip(_leaves(run.grads), _leaves(ref.grads),
                                                    strict=True)),
        "curve": rel_err(run.curve, ref.curve),
    }
    print(case, errs)
    assert errs["loss"] <= 1e-5, errs
    assert errs["grads"] <= 3e-2, errs
    assert errs["curve"] <= 5e-3, errs
    assert ref.curve[-1] < ref.curve[0] - 0.05  # a real training curve
