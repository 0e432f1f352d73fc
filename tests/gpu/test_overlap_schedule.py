"""The overlap XLA:GPU schedules, read back by planner/overlap.py from small programs
compiled for 4 abstract H200s: an all-gather whose result the only matmul needs (nothing
can run beside it: XLA runs it synchronously, the replay hides none of it) against the same
all-gather beside an independent matmul (the latency-hiding scheduler puts the matmul
between its start and done: the replay hides it). Each replay lies between the roofline's
two bounds, nothing overlapped and collectives fully overlapped."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from olmo_jax import targets
from olmo_jax.planner import comms, hardware, hlo, hlo_cost, overlap, roofline

SPEC = hardware.DEVICES["h200"]
MESH_SHAPE = {"x": 4}
N = 2048


@pytest.fixture(scope="module")
def mesh4():
    return targets.make_mesh("h200", (4,), ("x",))


def _replay(mesh, fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
            for s, p in shapes]
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=tuple(p for _, p in shapes),
                              out_specs=P()))
    module = hlo.parse_module(f.lower(*args).compile().as_text())
    ops = hlo_cost.program_cost(module).ops
    acc = roofline.Accounting.for_program(True, True)
    s = overlap.simulate(module, ops, SPEC, "bfloat16", MESH_SHAPE, acc)
    links = roofline.link_uses(comms.collectives(module))
    p = roofline.project(ops, links, SPEC, "bfloat16", MESH_SHAPE, 1.0, 1.0, accounting=acc,
                         replayed_s=s.step_s)
    return s, p


def test_a_collective_nothing_can_overlap_is_not_hidden(mesh4):
    def fn(x, w):
        y = jax.lax.all_gather(x, "x", tiled=True)  # [N, N]: the matmul needs all of it
        return jax.lax.pmax((y @ w).max(), "x")

    s, p = _replay(mesh4, fn, ((N, N), P("x")), ((N, N), P()))
    (gather,) = [r for r in s.rows if r.kind == "all-gather"]
    assert gather.link_s > 0 and gather.hidden_s == pytest.approx(0, abs=1e-12)
    assert gather.between_s == 0
    assert p.overlapped_s <= p.scheduled_s <= p.step_s
    assert s.compute_s == pytest.approx(p.roofline_s) and s.link_s == pytest.approx(p.links_s)


def test_an_independent_matmul_hides_the_collective(mesh4):
    def fn(x, a, b):
        y = jax.lax.all_gather(x, "x", tiled=True)
        z = a @ b  # independent of the gather: scheduled between its start and done
        return jax.lax.pmax(y.max() + z.max(), "x")

    s, p = _replay(mesh4, fn, ((N, N), P("x")), ((4 * N, 4 * N), P()), ((4 * N, 4 * N), P()))
    (gather,) = [r for r in s.rows if r.kind == "all-gather"]
    assert gather.async_runs == 1 and gather.between_s > gather.link_s > 0
    assert gather.hidden_s == pytest.approx(gather.link_s)
    assert p.overlapped_s <= p.scheduled_s < p.step_s
