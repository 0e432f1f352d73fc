"""The report's data, checked against independent references: placement slices against
hand-derived expectations and the plan's own byte count, the token route against a naive
capacity rule and a real all_to_all over 4 devices, the run series and heatmap against
the files, the pipeline schedule against the schedule table the trainer runs, the plan
sections' regrouping of the planner's JSON, and clear errors for bad inputs."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from olmo_jax import config as config_lib
from olmo_jax.model.config import MoEConfig
from olmo_jax.optim import build_optimizer
from olmo_jax.parallel import zero
from olmo_jax.parallel.pipeline import schedule
from olmo_jax.parallel.strategy import build_plan
from olmo_jax.report import page, pipeline_view, placement, plan_view, route, run_charts, sources
from olmo_jax.report.__main__ import main as report_main
from olmo_jax.trainer.state import abstract_train_state
from tests.report.fixtures import BLOCKS, EXPERTS, NAN_STEP, STEPS, report_config, write_run


@pytest.fixture(scope="module")
def plan_and_mesh():
    cfg = config_lib.parse(report_config())
    model_cfg = sources.model_config(cfg)
    plan = build_plan(cfg.parallel, cfg.trainer, model_cfg, optim=cfg.optim)
    return cfg, model_cfg, plan, placement.mesh_section(cfg, model_cfg, plan)


def test_mesh_section_slices_cover_every_leaf_and_match_the_plan(plan_and_mesh):
    cfg, model_cfg, plan, d = plan_and_mesh
    assert d["shape"] == [1, 2, 4] and d["axes"] == ["pipe", "data", "expert"]
    assert d["coords"] == [[0, dd, x] for dd in range(2) for x in range(4)]
    leaves = {lf["name"]: lf for lf in d["leaves"]}
    for lf in d["leaves"]:  # distinct shards tile the array exactly once
        volume = sum(math.prod(b - a for a, b in sh) for sh in lf["shards"])
        assert volume == math.prod(lf["shape"]), lf["name"]
        copies = np.bincount(lf["device_shard"])
        assert (copies == copies[0]).all(), lf["name"]  # every shard replicated equally
    # Experts [2 MoE blocks, 8 experts, ...]: ZeRO-1 splits the blocks over data, the
    # experts live on their expert rank: device (d, x) stores block d, experts 2x, 2x+1.
    w_up = leaves["params/moe_blocks/ffn/experts/w_up"]
    assert w_up["compute"] == str((None, "expert", None, None))
    for i, (_, dd, x) in enumerate(d["coords"]):
        assert w_up["shards"][w_up["device_shard"][i]] == [[dd, dd + 1], [2 * x, 2 * x + 2], [0, 32], [0, 32]]
    mu = leaves["opt_state/1/0/mu/moe_blocks/ffn/experts/w_up"]
    assert mu["category"] == "mu" and mu["param"] == "moe_blocks/ffn/experts/w_up"
    assert mu["shards"] == w_up["shards"] and mu["device_shard"] == w_up["device_shard"]
    # per-device bytes: the plan's own accounting (zero.per_device_bytes)
    tx, _ = build_optimizer(cfg.optim, cfg.trainer.max_steps)
    _, state = abstract_train_state(model_cfg, tx, dispatcher=plan.dispatcher)
    sh = plan.state_shardings(state, tx)
    assert d["device_bytes"]["param"] == [zero.per_device_bytes(state.params, sh.params)] * 8
    opt = np.sum([d["device_bytes"][c] for c in ("mu", "nu", "opt")], axis=0).tolist()
    assert opt == [zero.per_device_bytes(state.opt_state, sh.opt_state)] * 8
    # one line per leaf, as the plan's placement table has them
    assert [f"{lf['name']} {'x'.join(map(str, lf['shape'])) or 'scalar'} {lf['spec']}"
            for lf in d["leaves"]] == plan.placement(state, tx)


def naive_keep_and_slot(idx_Sk, E, C):
    """Choice-major: all first choices in token order, then second choices; an assignment
    takes the next slot of its expert while fewer than C are taken."""
    S, k = idx_Sk.shape
    taken = [0] * E
    keep, slot = np.zeros((S, k), bool), np.full((S, k), -1)
    for c in range(k):
        for t in range(S):
            e = idx_Sk[t, c]
            if taken[e] < C:
                keep[t, c], slot[t, c] = True, taken[e]
            taken[e] += 1
    return keep, slot


def test_route_matches_the_capacity_rule_and_a_real_all_to_all():
    moe = MoEConfig(num_experts=EXPERTS, top_k=2, expert_hidden=8)
    ep, cf = 4, 1.25
    d = route.route_section(moe, ep, "rowwise", cf, seed=3)
    El, C, S = EXPERTS // ep, d["capacity"], d["tokens"]
    assert C == math.ceil(cf * S * 2 / EXPERTS) and d["local_experts"] == El
    idx = route.example_routing(ep, S, EXPERTS, 2, seed=3)
    assert sum(s["dropped"] for s in d["senders"]) > 0  # the skewed example shows drops
    send = np.zeros((ep, El * ep * C), np.int32)
    for s, snd in enumerate(d["senders"]):
        keep, slot = naive_keep_and_slot(idx[s], EXPERTS, C)
        for a in snd["assignments"]:
            t, c = a["token"], a["choice"]
            assert a["expert"] == idx[s, t, c] and a["rank"] == a["expert"] // El
            assert a["local"] == a["expert"] % El and a["kept"] == keep[t, c]
            if a["kept"]:
                assert a["slot"] == slot[t, c]
                send[s, a["send_row"]] = 1000 * s + 10 * t + c + 1
        assert snd["dropped"] == (~keep).sum()

    mesh = Mesh(np.asarray(jax.devices()[:ep]), ("expert",))

    def exchange(buf):  # [1, ep * El * C] -> the all_to_all over destination ranks
        out = jax.lax.all_to_all(buf.reshape(ep, El * C), "expert", 0, 0)
        return out.reshape(1, -1)

    a2a = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=PartitionSpec("expert"),
                                out_specs=PartitionSpec("expert")))
    recv = np.asarray(a2a(jnp.asarray(send)))
    back = np.asarray(a2a(jnp.asarray(recv)))
    np.testing.assert_array_equal(back, send)  # the mirror exchange returns every row
    for s, snd in enumerate(d["senders"]):
        for a in snd["assignments"]:
            if a["kept"]:
                assert recv[a["rank"], a["recv_row"]] == 1000 * s + 10 * a["token"] + a["choice"] + 1
    assert (recv > 0).sum() == sum(len([a for a in s["assignments"] if a["kept"]]) for s in d["senders"])


def test_route_without_expert_parallelism_is_labelled_an_illustration():
    d = route.route_section(MoEConfig(num_experts=6, top_k=2, expert_hidden=8), 1, "rowwise", 1.25)
    assert d["mesh_ep"] == 1 and d["ep"] == 3  # largest divisor of 6 up to 4


def test_run_series_and_heatmap_follow_the_files(tmp_path):
    run = sources.load_run(write_run(tmp_path / "run"))
    curves = run_charts.curves_section(run.metrics)
    assert curves["loss"]["step"] == list(range(1, STEPS + 1))
    assert curves["loss"]["value"][NAN_STEP - 1] is None  # "nan" in the file -> a gap
    assert curves["eval_loss"]["step"] == [6, 12]
    bal = run_charts.balance_section(run.metrics, run.counts, 2)
    m = bal["metrics"]["expert_imbalance"]
    assert list(m["blocks"]) == [str(b) for b in BLOCKS]
    assert m["all"]["value"] == [r["expert_imbalance"] for r in run.metrics]
    assert bal["metrics"]["rank_imbalance"]["blocks"] == {}
    hm = bal["heatmap"]
    assert hm["steps"] == list(range(2, STEPS + 1, 2)) and hm["blocks"] == list(BLOCKS)
    counts = np.array([r["counts"] for r in run.counts])  # [N, L, E]
    np.testing.assert_array_equal(np.array(hm["counts"]).transpose(1, 0, 2), counts)
    np.testing.assert_allclose(np.array(hm["mean"]).T, counts.mean(-1))
    assert hm["stride"] == 1


def test_page_json_is_inlined_safely(tmp_path):
    run = sources.load_run(write_run(tmp_path / "run</script>"))
    html = page.render_html(page.run_page(run, sources.model_config(run.cfg)))
    assert html.count("</script>") == 2  # the data's "</" is escaped
    data = html.split('id="report-data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(data)["subtitle"].endswith("run</script>")  # the run folder's path
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html


def test_bad_inputs_get_clear_errors(tmp_path, capsys):
    with pytest.raises(sources.ReportError, match="does not exist"):
        sources.load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(sources.ReportError, match="config.json not found.*run folder"):
        sources.load_run(tmp_path / "empty")
    run = write_run(tmp_path / "run")
    cfg = json.loads((run / "config.json").read_text())
    cfg["parallel"]["pipes"] = 2
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(sources.ReportError, match="config.json does not fit.*pipes"):
        sources.load_run(run)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    (run / "config.json").write_text(json.dumps(report_config().to_dict()))
    with pytest.raises(sources.ReportError, match="metrics.jsonl: line 2 is not JSON"):
        sources.load_run(run)
    assert report_main(["report", str(tmp_path / "nope")]) == 2
    assert "run folder" in capsys.readouterr().err
    assert report_main(["report"]) == 2
    assert "--config=configs/<name>.py" in capsys.readouterr().err
    assert report_main(["report", "--device-kind=tpu", str(run)]) == 2
    assert "--device-kind=tpu: choose one of b300" in capsys.readouterr().err


def test_device_count_rules():
    cfg = config_lib.parse(report_config())
    assert sources.device_count(cfg, None, 0) == 8
    assert sources.device_count(cfg, {"pipe": 1, "data": 4, "expert": 4}, 0) == 16
    assert sources.device_count(cfg, None, 32) == 32
    cfg = cfg.with_values({"parallel.data": -1})
    assert sources.device_count(cfg, None, 0) == 0  # fill: whatever devices there are


def test_pipeline_section_is_the_trainers_schedule_table(tmp_path):
    # a run folder trained with pipe=2 (1F1B, M=2): its page draws that schedule
    run = sources.load_run(write_run(tmp_path / "run", pipelined=True))
    model_cfg = sources.model_config(run.cfg)
    sections = {s["id"]: s for s in page.run_page(run, model_cfg)["sections"]}
    d = sections["pipeline"]["data"]
    ref = schedule.build("1f1b", 2, 1, 2)
    assert (d["schedule"], d["stages"], d["microbatches"], d["virtual_stages"]) == ("1f1b", 2, 2, 1)
    assert d["ticks"] == ref.ticks and d["bubble"] == ref.bubble == pytest.approx(1 / 3)
    grid = np.full((2 * ref.ticks, 2, 2), -1)  # (op, microbatch) per op slot and stage, from the cells
    for c in d["cells"]:
        grid[2 * c["tick"] + c["slot"], c["stage"]] = (
            {"F": schedule.FWD, "B": schedule.BWD}[c["kind"]], c["microbatch"])
        assert c["virtual"] == 0 and c["chunk"] == c["stage"]
    busy = ref.column("op") != schedule.IDLE
    np.testing.assert_array_equal(grid[..., 0][busy], ref.column("op")[busy])
    np.testing.assert_array_equal(grid[..., 1][busy], ref.column("mb")[busy])
    assert (grid[..., 0][~busy] == -1).all() and len(d["cells"]) == 2 * 2 * 2
    # blocks: 0 dense (stage 0, with the embedding), MoE blocks 1 and 2 one per stage
    assert [st["chunks"][0]["blocks"] for st in d["stage_blocks"]] == [[1], [2]]
    assert d["stage_blocks"][0]["first"] == ["embedding", "dense block 0"]
    assert d["stage_blocks"][1]["last"] and not d["stage_blocks"][0]["last"]


def test_pipeline_section_without_a_pipeline_is_one_stage(plan_and_mesh):
    _, model_cfg, plan, _ = plan_and_mesh
    cfg = config_lib.parse(report_config()).with_values({"trainer.grad_accum": 2})
    d = pipeline_view.pipeline_section(cfg, model_cfg, plan)["data"]
    assert d["schedule"] == "no pipeline" and d["stages"] == 1 and d["bubble"] == 0.0
    assert "parallel.pipe=1" in d["note"] and "grad_accum=2" in d["note"]
    assert [(c["tick"], c["kind"], c["microbatch"]) for c in d["cells"]] == [
        (0, "F", 0), (0, "B", 0), (1, "F", 1), (1, "B", 1)]
    assert d["stage_blocks"][0]["chunks"][0]["blocks"] == [1, 2]


def test_plan_sections_regroup_the_planners_json():
    pj = {  # the keys of planner.plan_build.Plan.to_json() the report reads
        "devices": 4, "mesh": {"pipe": 2, "data": 1, "expert": 2},
        "argument_parts": {"params": 300, "opt_state": 600, "model_state": 0, "step, rng": 12, "batch": 40},
        "argument_bytes": 952, "temp_bytes": 5000, "peak_bytes": 4000,
        "peak": [{"label": "loop state", "bytes": 2500, "values": 3, "example": "f32[2,8]"},
                 {"label": "argument: opt_state", "bytes": 600, "values": 2, "example": "f32[4]"}],
        "collectives": [
            {"kind": "all-to-all", "purpose": "moe_rowwise", "phase": "fwd", "axes": "expert", "ops": 2,
             "executions": 8, "bytes_per_device": 640, "jax_bytes_per_device": 320},
            {"kind": "collective-permute", "purpose": "pipe_send", "phase": "fwd", "axes": "group of 2",
             "ops": 1, "executions": 6, "bytes_per_device": 96, "jax_bytes_per_device": 96}],
        "collective_jax_bytes": 416, "device_kind": "b300", "compiler": "XLA:GPU",
        "step_s": 2.5, "scheduled_s": 2.25, "overlapped_s": 2.0,
        "overlap": {"link_s": 0.5, "exposed_s": 0.25}}
    mem = plan_view.memory_data(pj, 1e3, "cpu")
    bars = {b["name"]: b["parts"] for b in mem["bars"]}
    assert [(p["label"], p["bytes"]) for p in bars["arguments"]] == [
        ("params", 300), ("opt_state", 600), ("step, rng", 12), ("batch", 40)]
    assert [p["bytes"] for p in bars["compiled"]] == [952, 5000]
    assert [(p["label"], p["bytes"]) for p in bars["live at the peak"]] == [
        ("loop state", 2500), ("argument: opt_state", 600), ("everything else live at the peak", 900)]
    assert "does NOT fit" in mem["note"] and "pipe=2 x data=1 x expert=2" in mem["note"]
    col = plan_view.collectives_data(pj)
    assert [(r["label"], r["bytes"]) for r in col["rows"]] == [
        ("all-to-all moe_rowwise (fwd, expert)", 320), ("collective-permute pipe_send (fwd, group of 2)", 96)]
    assert col["total"] == 416 and "between neighbouring stages" in col["rows"][1]["detail"]
    assert ("2.500 s with nothing overlapped, 2.250 s as XLA:GPU scheduled it (50% of the link "
            "time hidden), 2.000 s with the collectives fully overlapped") in col["note"]
    assert col["table"]["rows"][1] == ["collective-permute", "pipe_send", "fwd", "group of 2", 6, 96]
