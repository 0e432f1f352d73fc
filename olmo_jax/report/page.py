"""The report page: the sections of a run or a plan, gathered into one JSON document and
written into the HTML template (a package resource: inline CSS and vanilla JS, no
network). A section is {"id", "title", "kind", "data"} (drawn by the template's renderer
for `kind`) or {"id", "title", "kind", "absent": why} (shown as that message).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from olmo_jax import metrics as metrics_lib
from olmo_jax.parallel.expert import rowwise_capacity_factor
from olmo_jax.parallel.strategy import build_plan
from olmo_jax.report import pipeline_view, placement, plan_view, route, run_charts
from olmo_jax.report.sources import RunFolder


def section(id_: str, title: str, kind: str, data=None, absent: str | None = None) -> dict:
    out = {"id": id_, "title": title, "kind": kind}
    if absent is not None:
        out["absent"] = absent
    else:
        out["data"] = data
    return out


def _summary(cfg, model_cfg, plan, extra: list[tuple[str, str]]) -> dict:
    total, active = metrics_lib.param_counts(model_cfg)
    moe = model_cfg.moe
    t = cfg.trainer
    model = [
        ("layers", f"{model_cfg.n_layers} ({model_cfg.n_dense_layers} dense)"),
        ("d_model / heads", f"{model_cfg.d_model} / {model_cfg.n_heads} "
                            f"(kv {model_cfg.n_kv_heads or model_cfg.n_heads})"),
        ("experts", f"{moe.num_experts}, top-{moe.top_k}, hidden {moe.expert_hidden}"
                    + (f", {moe.n_shared_experts} shared" if moe.n_shared_experts else "")),
        ("parameters", f"{total / 1e6:,.2f}M total / {active / 1e6:,.2f}M active"),
        ("FLOPs / token", f"{metrics_lib.flops_per_token(model_cfg, t.seq_len) / 1e6:,.2f} MFLOP (fwd+bwd)"),
    ]
    mesh = plan.mesh
    run = [
        ("mesh", " x ".join(f"{a}={n}" for a, n in mesh.shape.items())),
        ("strategy", f"{plan.strategy}{' + ZeRO-1' if plan.zero1 else ''}, dispatch {plan.dispatch}"),
        ("batch", f"{t.global_batch_size} x {t.seq_len} tokens, grad_accum {t.grad_accum}"
                  + (f"; batch_size_schedule {t.batch_size_schedule}" if t.batch_size_schedule else "")),
        *extra,
    ]
    return {"model": model, "run": run}


def _pipeline_line(plan) -> str:
    if plan.pipeline is None:
        return "none (parallel.pipe=1)"
    s = plan.pipeline.schedule
    return (f"{s.kind}, P={s.stages}, M={s.microbatches}, V={s.virtual}: bubble {s.bubble:.1%}")


def _shared_sections(cfg, model_cfg, plan) -> list[dict]:
    p = cfg.parallel
    return [
        section("mesh", "Device mesh and placement", "mesh", placement.mesh_section(cfg, model_cfg, plan)),
        section("route", "One token's route through dispatch", "route",
                route.route_section(model_cfg.moe, plan.mesh.shape["expert"], p.dispatch,
                                    rowwise_capacity_factor(model_cfg.moe.capacity_factor),
                                    seed=cfg.trainer.seed)),
        pipeline_view.pipeline_section(cfg, model_cfg, plan),
    ]


def run_page(run: RunFolder, model_cfg) -> dict:
    cfg = run.cfg
    plan = build_plan(cfg.parallel, cfg.trainer, model_cfg, optim=cfg.optim)
    last = run.metrics[-1] if run.metrics else {}
    extra = [("pipeline", _pipeline_line(plan)),
             ("logged steps", f"{len(run.metrics)} (last step {last.get('step', '–')})"),
             ("final loss", f"{last['loss']:.4f}" if isinstance(last.get("loss"), float) else "–")]
    sections = [section("summary", "Summary", "summary", _summary(cfg, model_cfg, plan, extra))]
    sections += _shared_sections(cfg, model_cfg, plan)
    if run.metrics:
        sections.append(section("curves", "Training curves", "curves", run_charts.curves_section(run.metrics)))
        sections.append(section("balance", "Expert load and balance", "balance",
                                run_charts.balance_section(run.metrics, run.counts,
                                                           cfg.trainer.expert_counts_every)))
    else:
        absent = f"no metrics.jsonl records in {run.path} yet"
        sections.append(section("curves", "Training curves", "curves", absent=absent))
        sections.append(section("balance", "Expert load and balance", "balance", absent=absent))
    return {"title": f"olmo_jax run: {run.path.name}", "subtitle": str(run.path.resolve()),
            "mode": "run", "sections": sections}


def plan_page(cfg, model_cfg, config_path: str, device_kind: str = "b300") -> dict:
    """`device_kind` (planner/hardware.py): the device whose HBM the peak is compared to."""
    plan = build_plan(cfg.parallel, cfg.trainer, model_cfg, optim=cfg.optim)
    sections = [section("summary", "Summary", "summary",
                        _summary(cfg, model_cfg, plan, [("pipeline", _pipeline_line(plan))]))]
    sections += _shared_sections(cfg, model_cfg, plan)
    sections += plan_view.plan_sections(cfg, plan, device_kind)
    return {"title": f"olmo_jax plan: {Path(config_path).stem}", "subtitle": config_path,
            "mode": "plan", "sections": sections}


def render_html(page: dict) -> str:
    """The template with the page's JSON inlined (`</` escaped so no string can close the
    script element)."""
    template = resources.files("olmo_jax.report").joinpath("template.html").read_text()
    data = json.dumps(page, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    title = page["title"].replace("&", "&amp;").replace("<", "&lt;")
    return template.replace("__DATA__", data, 1).replace("__TITLE__", title, 1)


def write(page: dict, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(page))
    return out
