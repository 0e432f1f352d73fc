"""Collectives of one compiled training step, from its HLO (loop bodies x trip counts):
rowwise token all-to-all bytes match 2 x tokens x top_k x d_model x bytes x
capacity_factor per MoE layer (forward, and the same again backward); in ddp the expert
weights are never gathered across the `expert` axis (only ZeRO-1's once-per-step gather
of their `data` shards); FSDP gathers every weight, experts too, over all devices."""

import numpy as np

from olmo_jax.planner import comms
from tests.parallel.harness import BATCH, NO_DROP_CF, SEQ, host_state, plan_run

N_DEVICES = 8


def _expert_gathers(colls):
    return [c for c in colls if c.kind == "all-gather" and "/experts/" in c.op_name]


def test_rowwise_all_to_all_bytes_match_the_formula():
    model_cfg = host_state()[0]
    colls = comms.collectives(plan_run(2, 4, "rowwise").hlo)
    tokens, k, D = BATCH * SEQ, model_cfg.moe.top_k, model_cfg.d_model
    per_layer = 2 * tokens * k * D * 4 * NO_DROP_CF  # float32 payload, dispatch + combine
    a2a = [c for c in colls if c.kind == "all-to-all"]
    assert {c.count for c in a2a} == {model_cfg.n_moe_layers}  # inside the layer scan
    for backward in (False, True):
        measured = comms.total_bytes(colls, "all-to-all", backward) * N_DEVICES
        ratio = measured / (per_layer * model_cfg.n_moe_layers)
        print(f"{'bwd' if backward else 'fwd'} all-to-all: {measured} B per step "
              f"= {ratio:.4f} x formula")
        assert abs(ratio - 1) <= 0.05


def test_ddp_never_gathers_expert_weights_across_the_expert_axis():
    for run in (plan_run(2, 4, "rowwise"), plan_run(4, 2, "ragged")):
        gathers = _expert_gathers(comms.collectives(run.hlo))
        assert gathers  # ZeRO-1's gather of the updated expert shards ...
        assert all(c.axes == ("data",) and c.count == 1 for c in gathers)  # ... over data, once
    assert not _expert_gathers(comms.collectives(plan_run(1, 8, "allgather", zero1=False).hlo))


def test_fsdp_gathers_every_weight_over_all_devices():
    colls = comms.collectives(plan_run(2, 4, strategy="fsdp").hlo)
    print(comms.format_table(colls, "fsdp, data=2 x expert=4", N_DEVICES))
    gathers = _expert_gathers(colls)
    assert gathers and all(set(c.axes) == {"data", "expert"} for c in gathers)
    assert all(c.purpose == "fsdp_gather" for c in gathers)
    scatters = [c for c in colls if c.kind == "reduce-scatter"]
    assert scatters and all(c.backward for c in scatters)  # gradients, from autodiff
    assert not [c for c in colls if c.kind == "all-to-all"]  # no expert parallelism


def test_ddp_versus_fsdp_parameter_traffic():
    ddp = comms.collectives(plan_run(2, 4, "rowwise").hlo)
    fsdp = comms.collectives(plan_run(2, 4, strategy="fsdp").hlo)
    gathered = {name: sum(c.bytes_per_run for c in colls if c.kind == "all-gather")
                for name, colls in (("ddp", ddp), ("fsdp", fsdp))}
    print(f"parameter all-gather bytes per device per step: {gathered}")
    assert gathered["fsdp"] > gathered["ddp"]  # experts re-gathered whole vs resident


WHILE_LINE = ('  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, '
              'backend_config={"known_trip_count":{"n":"6"}}')


def test_trip_counts_multiply_loop_bodies():
    text = """HloModule m, num_partitions=4

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
}

%cond (p: (s32[], f32[8])) -> pred[] {
}

ENTRY %main (x: f32[8]) -> f32[8] {
WHILE
  %g = f32[16]{0} all-gather(%x), channel_id=2, replica_groups={{0,1},{2,3}}, dimensions={0}
}
""".replace("WHILE", WHILE_LINE)
    colls = {c.kind: c for c in comms.collectives(text)}
    assert colls["all-reduce"].count == 6 and colls["all-reduce"].group_size == 4
    assert colls["all-reduce"].bytes_per_run == 6 * 32
    assert colls["all-gather"].count == 1 and colls["all-gather"].group_size == 2
    assert np.isclose(comms.total_bytes(list(colls.values())), 6 * 32 + 64)
