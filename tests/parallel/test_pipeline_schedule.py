"""Pipeline schedule tables, layer chunking and the pipeline config checks: pure, nothing
compiled. The bubble of every table equals the textbook value; 1F1B's steady state pairs a
forward and a backward on every stage in each tick; every table is a valid execution
(each op once, after its inputs) whose buffer slots hold each value until it is read;
1F1B keeps at most min(2P - 1, M) microbatches of activations on a stage whatever M is,
GPipe all M x V."""

import runpy
from pathlib import Path

import jax
import numpy as np
import pytest

from olmo_jax.config import model_config
from olmo_jax.errors import ConfigError
from olmo_jax.parallel import rules
from olmo_jax.parallel.pipeline import chunking, schedule
from olmo_jax.parallel.pipeline.schedule import BWD, FWD, IDLE, NO_SLOT
from tests.parallel.harness import Pipe, make_cfg
from tests.sections import plan_for

ROOT = Path(__file__).resolve().parents[2]
CASES = [("gpipe", P, 1, M) for P in (2, 4, 8) for M in (1, 2, 4, 8, 16)]
CASES += [("1f1b", P, 1, M) for P in (2, 4, 8) for M in (1, 2, 4, 8, 16)]
CASES += [("interleaved_1f1b", P, V, M) for P in (2, 4, 8) for V in (2, 3, 4) for M in (P, 2 * P, 4 * P)]
CASES += [("gpipe", P, V, M) for P in (2, 4) for V in (2, 3) for M in (P, 2 * P)]  # circular


def _id(case):
    return "{}-P{}-V{}-M{}".format(*case)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_bubble_is_the_textbook_value(case):
    kind, P, V, M = case
    s = schedule.build(kind, P, V, M)
    # (P-1)/(V*M + P-1): the bubble over the busy time, (P-1)/M, divided by V.
    assert s.bubble == pytest.approx((P - 1) / (V * M + P - 1), abs=1e-12)
    assert s.bubble == pytest.approx(schedule.textbook_bubble(kind, P, M, V))
    idle = s.bubble * s.length * P
    assert idle / (s.length * P - idle) == pytest.approx((P - 1) / M / V)
    # In op times: P - 1 ticks of filling and P - 1 of draining around V M ops of each kind.
    assert s.length == 2 * (V * M + P - 1)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "gpipe"], ids=_id)
def test_1f1b_steady_state_pairs_a_forward_and_a_backward(case):
    """1F1B's ticks run one forward and one backward on every stage in the steady state.
    Around it: P - 1 ticks of filling and P - 1 of draining (each as long as one op), and
    for interleaved the (V - 1) P forwards of the earlier virtual stages before the first
    backward (and as many backwards after the last forward), every stage busy."""
    kind, P, V, M = case
    s = schedule.build(kind, P, V, M)
    warm = (V - 1) * P
    assert s.ticks == V * M + 2 * (P - 1) + warm
    paired = (s.ops_per_tick() == 2).all(axis=1)  # every stage runs F + B
    assert paired.sum() == max(0, V * M - 2 * (P - 1) - warm)
    if paired.any():  # one steady run of them
        first, last = np.nonzero(paired)[0][[0, -1]]
        assert paired[first:last + 1].all()


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_table_is_a_valid_execution(case):
    kind, P, V, M = case
    s = schedule.build(kind, P, V, M)
    K = P * V
    op, mb, virt = (s.table[..., schedule.COL[n]] for n in ("op", "mb", "virtual"))
    assert np.all(np.isin(op[:, 0], (IDLE, FWD))) and np.all(np.isin(op[:, 1], (IDLE, BWD)))
    when = {}  # (op, m, k) -> (tick, slot)
    for t, slot, stage in zip(*np.nonzero(op != IDLE), strict=True):
        key = (int(op[t, slot, stage]), int(mb[t, slot, stage]), int(virt[t, slot, stage]) * P + stage)
        assert key not in when
        when[key] = (int(t), int(slot))
    assert len(when) == 2 * M * K  # every forward and backward exactly once
    for m in range(M):
        for k in range(K):
            if k:  # from the neighbour: a tick later
                assert when[(FWD, m, k)][0] > when[(FWD, m, k - 1)][0]
            assert when[(BWD, m, k)] > when[(FWD, m, k)]  # same stage: a later slot
            if k < K - 1:
                assert when[(BWD, m, k)][0] > when[(BWD, m, k + 1)][0]
    # Slots: an op reads what its table row names; "none" only where nothing is read.
    fwd_in, stash = (s.table[..., schedule.COL[n]] for n in ("fwd_in", "stash"))
    assert np.all((stash >= 0) == (op != IDLE))
    assert np.all(fwd_in[:, 1] == NO_SLOT)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_buffer_slots_hold_each_value_until_it_is_read(case):
    """Replays the table's buffer traffic in execution order (each tick: the F slots, the
    B slots, then the arrivals): every read finds the value it needs, no write lands on
    a slot whose value is still to be read, every slot is within the allocation."""
    kind, P, V, M = case
    s = schedule.build(kind, P, V, M)
    K, col = P * V, schedule.COL
    bufs = [{name: {} for name in s.slots} for _ in range(P)]

    def write(stage, name, slot, value):
        assert 0 <= slot < s.slots[name], (name, slot)
        assert slot not in bufs[stage][name], (name, slot, "overwritten while alive")
        bufs[stage][name][slot] = value

    def read(stage, name, slot, value):
        assert bufs[stage][name].pop(slot) == value, (name, slot)

    for t in range(s.ticks):
        sent = {}
        for slot_i in (0, 1):
            for stage in range(P):
                cell = s.table[t, slot_i, stage]
                if cell[col["op"]] == IDLE:
                    continue
                m, k = int(cell[col["mb"]]), int(cell[col["virtual"]]) * P + stage
                if cell[col["op"]] == FWD:
                    if k:
                        read(stage, "fwd_in", cell[col["fwd_in"]], ("x", m, k))
                    write(stage, "stash", cell[col["stash"]], ("res", m, k))
                    if k == 0:
                        write(stage, "prologue", cell[col["prologue"]], ("pro", m))
                    if k == K - 1:
                        write(stage, "bwd_in", cell[col["head_out"]], ("dx", m, k))
                    else:
                        sent[("fwd", (stage + 1) % P)] = ("x", m, k + 1)
                else:
                    read(stage, "bwd_in", cell[col["bwd_in"]], ("dx", m, k))
                    read(stage, "stash", cell[col["stash"]], ("res", m, k))
                    if k == 0:
                        read(stage, "prologue", cell[col["prologue"]], ("pro", m))
                    else:
                        sent[("bwd", (stage - 1) % P)] = ("dx", m, k - 1)
        for stage in range(P):
            end = s.table[t, 1, stage]
            assert np.all(s.table[t, 0, stage, [col["recv_fwd"], col["recv_bwd"]]] == NO_SLOT)
            for way, name in (("fwd", "fwd_in"), ("bwd", "bwd_in")):
                slot = int(end[col["recv_" + way]])
                assert (slot != NO_SLOT) == ((way, stage) in sent)
                if slot != NO_SLOT:
                    write(stage, name, slot, sent[(way, stage)])
    assert all(not b for per_stage in bufs for b in per_stage.values())


def test_1f1b_activations_do_not_grow_with_microbatches():
    for P in (2, 4, 8):
        for M in (P, 2 * P, 4 * P, 8 * P):
            s = schedule.build("1f1b", P, 1, M)
            # Stage 0 fills the round trip to the last stage and back, 2 (P - 1) ticks of
            # one forward each, before its first backward pairs with a forward.
            assert s.slots["stash"] == min(2 * P - 1, M)
            assert schedule.build("gpipe", P, 1, M).slots["stash"] == M
        assert schedule.build("1f1b", P, 1, 1).slots["stash"] == 1
    # Interleaved: Megatron's warm-up, 2(P-1) + (V-1)P + 1 chunks of 1/V stage each.
    for P, V in ((2, 2), (4, 2), (4, 4), (8, 4)):
        for M in (P, 2 * P, 4 * P):
            s = schedule.build("interleaved_1f1b", P, V, M)
            assert s.slots["stash"] <= min(2 * (P - 1) + (V - 1) * P + 1, M * V)


def test_forward_only_schedule():
    s = schedule.forward_only(4, 2, 4)
    assert set(np.unique(s.column("op"))) == {IDLE, FWD}
    assert np.all(s.table[:, 1, :, schedule.COL["op"]] == IDLE)
    assert np.sum(s.column("op") == FWD) == 4 * 4 * 2


def test_schedule_refusals_name_the_field():
    with pytest.raises(ValueError, match="parallel.virtual_stages=2; use interleaved_1f1b"):
        schedule.build("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match="interleaved_1f1b needs parallel.virtual_stages >= 2"):
        schedule.build("interleaved_1f1b", 2, 1, 4)
    with pytest.raises(ValueError, match="parallel.microbatches=6 must be a multiple of it"):
        schedule.build("interleaved_1f1b", 4, 2, 6)
    with pytest.raises(ValueError, match="parallel.pipeline_schedule='zb'"):
        schedule.build("zb", 2, 1, 2)


def test_chunking_uneven_layers():
    # The 1.2T model: 61 MoE blocks over 8 stages x 4 virtual = 32 chunks of 2 slots.
    c = chunking(61, 8, 4)
    assert c.slots == 2 and sum(c.sizes) == 61 and c.sizes[0] == 1 and max(c.sizes) == 2
    assert int(c.keep.sum()) == 61 and c.rows.shape == (8, 8)
    # Every MoE block runs in exactly one (stage, slot), chunks in layer order.
    layers = sorted(int(r) for r, k in zip(c.rows.ravel(), c.keep.ravel(), strict=True) if k)
    assert layers == list(range(61))
    for k in range(32):
        stage, v = k % 8, k // 8
        got = c.rows[stage, v * 2: v * 2 + c.sizes[k]].tolist()
        assert got == c.chunk_layers(k) and got[0] == int(c.offsets[k])
    even = chunking(8, 2, 2)
    assert even.sizes == (2, 2, 2, 2) and even.keep.all()
    with pytest.raises(ConfigError, match=r"4 x 2 = 8 chunks, but the model has only 5 MoE blocks"):
        chunking(5, 4, 2)
    with pytest.raises(ConfigError, match="the model has none"):
        chunking(0, 2, 1)


def _plan(cfg):
    return plan_for(cfg, model_config(cfg))


def test_pipeline_config_refusals():
    layers = (6, 1)
    with pytest.raises(ConfigError, match="parallel.strategy='fsdp' is the non-pipelined baseline"):
        _plan(make_cfg(2, 2, strategy="fsdp", layers=layers, pipe=Pipe(2)))
    with pytest.raises(ConfigError, match="parallel.microbatches=2 splits the batch for pipeline"):
        _plan(make_cfg(4, 2, layers=layers, pipe=Pipe(1, "1f1b", 2)))
    with pytest.raises(ConfigError, match="parallel.virtual_stages=2 needs parallel.pipe > 1"):
        _plan(make_cfg(4, 2, layers=layers, pipe=Pipe(1, "gpipe", 1, 2)))
    with pytest.raises(ConfigError, match=r"x trainer.grad_accum x parallel.microbatches = "
                                          r"2 x 2 x 1 x 4 = 16"):
        _plan(make_cfg(2, 2, layers=layers, pipe=Pipe(2, "1f1b", 4)))  # batch 8
    with pytest.raises(ConfigError, match="use interleaved_1f1b"):
        _plan(make_cfg(2, 2, layers=layers, pipe=Pipe(2, "1f1b", 2, 2)))
    with pytest.raises(ConfigError, match="only 2 MoE blocks"):
        _plan(make_cfg(2, 2, layers=(3, 1), pipe=Pipe(2, "gpipe", 2, 2)))


def test_plan_placement_splits_every_weight_over_pipe():
    plan = _plan(make_cfg(2, 2, layers=(6, 1), pipe=Pipe(2, "1f1b", 2)))
    specs = plan.storage_specs()
    flat = {jax.tree_util.keystr(path): spec
            for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=rules.is_spec)}
    assert flat and all("pipe" in str(spec) for spec in flat.values()), flat
    # Stacked MoE weights keep their layers axis whole (stages take their chunks per step).
    moe = [spec for name, spec in flat.items() if name.startswith("['moe_blocks']")]
    assert moe and all(spec[0] is None for spec in moe)
    assert plan.microbatches == 2 and plan.pipeline.bubble == pytest.approx(1 / 3)


def test_reference_1p2t_config_pipeline():
    cfg = runpy.run_path(str(ROOT / "configs/olmoe3_1p2t.py"))["get_config"]()
    p = cfg.parallel
    assert (p.pipe, p.expert, p.pipeline_schedule, p.virtual_stages) == (8, 8, "interleaved_1f1b", 2)
    model_cfg = model_config(cfg)
    chunks = chunking(model_cfg.n_moe_layers, p.pipe, p.virtual_stages)
    s = schedule.build(p.pipeline_schedule, p.pipe, p.virtual_stages, p.microbatches)
    # The reference's 16 stages of 4 layer slots (61 MoE blocks: 3 padding slots).
    assert chunks.chunks == 16 and chunks.slots == 4
    assert s.bubble == pytest.approx(7 / 263)  # 128 microbatches in one schedule
    # 512 devices: data = 8, one sequence per microbatch on each data x expert shard.
    assert cfg.trainer.global_batch_size == 8 * 8 * p.microbatches * cfg.trainer.grad_accum
