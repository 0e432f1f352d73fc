"""Report sections of a plan: "sizes" (the step planned at each batch size the run takes,
and the run's projected time), "memory" (per-device memory of the compiled step by
category) and "collectives" (bytes per collective per step, per device).

All three are the planner's numbers (`python -m olmo_jax.plan`), not a second estimate: the
config's real train step is AOT-compiled for the plan's mesh on abstract inputs, by
XLA:GPU for a GPU device kind where the planner can (else XLA:CPU on the plan's fake CPU
devices, labelled; the planner's API `planner.api.plan_config`, planner/xla_gpu.py),
`planner.plan_build.build` reads it, and this module only regroups the plan's JSON
(`Plan.to_json()`, what `python -m olmo_jax.plan --json` writes) into what the page
draws: the argument bytes by part of the train state, the buffers live at the peak
(XLA's buffer live ranges) by what they hold, the compiled memory analysis, and
`comms.summary` rows of the compiled collectives with the projected step time, nothing
overlapped / as the compiler scheduled it / fully overlapped. Every device runs the same
SPMD program, so its memory is every device's; with a pipeline the stages take different
branches of it, and the planner gives the collectives' runs and bytes as the mean over
the stages.
"""

from __future__ import annotations

from olmo_jax.planner import hardware
from olmo_jax.planner.api import plan_config

PEAK_PARTS = 8  # the planner's JSON lists the largest groups live at the peak

# What each collective purpose moves (the scopes olmo_jax/planner/comms.py documents).
PURPOSE = {
    "zero_gather": "ZeRO-1: updated parameter shards all-gathered over the data axes",
    "zero_reduce": "ZeRO-1: gradients reduce-scattered over the data axes",
    "fsdp_gather": "FSDP: parameters gathered for compute",
    "loss_allsum": "loss and router statistics summed over the batch shards",
    "pipe_gather": "pipeline: stored parameter shards to the stages that run them",
    "pipe_reduce": "pipeline: stage gradients back to the stored shards",
    "pipe_send": "pipeline: activations and cotangents between neighbouring stages",
    "other": "added by the compiler (e.g. the gradient-norm sum)",
}


def compile_plan(cfg, plan, device_kind: str) -> tuple[dict, dict, hardware.DeviceSpec]:
    """The planner's plan of `cfg` on the devices of `plan`'s mesh: the JSON of the step
    at the run's largest batch size, the run's (every size it takes) and the device
    kind's spec."""
    devices = list(plan.mesh.devices.flat)
    out = plan_config(cfg, len(devices), device_kind, devices=devices)
    return out["json"]["plan"], out["json"]["run"], hardware.device_spec(device_kind, len(devices))


def memory_data(pj: dict, hbm_bytes: float, kind: str) -> dict:
    args = [{"label": k, "bytes": v} for k, v in pj["argument_parts"].items() if v]
    peak = [{"label": g["label"], "bytes": g["bytes"], "detail": f"{g['values']} buffer(s), e.g. {g['example']}"}
            for g in pj["peak"]]
    rest = pj["peak_bytes"] - sum(g["bytes"] for g in pj["peak"])
    if rest > 0:
        peak.append({"label": "everything else live at the peak", "bytes": rest, "detail": ""})
    bars = [{"name": "arguments", "what": "the train state and batch this device holds",
             "parts": args},
            {"name": "compiled", "what": "XLA's memory analysis of the step",
             "parts": [{"label": "arguments", "bytes": pj["argument_bytes"]},
                       {"label": "temporaries", "bytes": pj["temp_bytes"]}]}]
    if pj["peak_bytes"]:
        bars.append({"name": "live at the peak", "what": "buffers live at the peak, by what they hold",
                     "parts": peak})
    counted = pj.get("peak_bytes_counted", pj["peak_bytes"])  # less the scores a GPU fuses
    fit = (f"; {kind.upper()} HBM {hbm_bytes / 1e9:,.0f} GB: "
           f"{'fits' if counted <= hbm_bytes else 'does NOT fit'}" if hbm_bytes and pj["peak_bytes"]
           else "")
    compiler = pj.get("compiler", "XLA:CPU")
    program = (f"{pj['devices']} abstract {kind.upper()} GPUs" if compiler == "XLA:GPU"
               else f"{pj['devices']} fake CPU devices")
    return {"devices": pj["devices"], "mesh": pj["mesh"], "bars": bars, "hbm_bytes": hbm_bytes,
            "note": (f"Per device, from the planner's AOT compile ({compiler}) of the real train "
                     f"step for {program} (mesh "
                     f"{' x '.join(f'{a}={n}' for a, n in pj['mesh'].items())}; every device runs "
                     f"the same SPMD program, so these are each device's numbers){fit}. "
                     + ("XLA:GPU's buffers. " if compiler == "XLA:GPU" else
                        "XLA:CPU's buffers, not a GPU's. ") + "Hover a part for its bytes.")}


def step_note(pj: dict) -> str:
    """The projected step's three columns (planner/roofline.py, planner/overlap.py)."""
    if "scheduled_s" not in pj:
        return ""
    sc = pj.get("overlap") or {}
    hidden = (f" ({1 - sc['exposed_s'] / sc['link_s']:.0%} of the link time hidden)"
              if sc.get("link_s") else "")
    return (f" Projected step on the {pj.get('device_kind', 'device').upper()}: "
            f"{pj['step_s']:,.3f} s with nothing overlapped, {pj['scheduled_s']:,.3f} s as "
            f"{pj.get('compiler', 'XLA:CPU')} scheduled it{hidden}, {pj['overlapped_s']:,.3f} s "
            "with the collectives fully overlapped.")


def collectives_data(pj: dict) -> dict:
    rows = [{"label": f"{r['kind']} {r['purpose']} ({r['phase']}, {r['axes']})",
             "bytes": r["jax_bytes_per_device"],
             "detail": (f"{PURPOSE.get(r['purpose'], r['purpose'])}; {r['ops']} op(s), "
                        f"{r['executions']} run(s) per step")}
            for r in pj["collectives"]]
    return {"rows": rows, "total": pj["collective_jax_bytes"],
            "note": (f"Bytes every collective of one training step moves per device (loop bodies x "
                     f"trip counts, at the JAX program's dtypes), from the compiled step: "
                     f"{len(rows)} kinds, {round(sum(r['executions'] for r in pj['collectives']), 1):,} runs. "
                     f"fwd / bwd: in the forward or backward pass; step: once per step."
                     + (" Pipelined: the stages run different branches, so runs and bytes are the "
                        "mean over the stages." if pj.get("pipeline") else "") + step_note(pj)),
            "table": {"head": ["collective", "purpose", "phase", "axes", "runs", "bytes / device"],
                      "rows": [[r["kind"], r["purpose"], r["phase"], r["axes"], r["executions"],
                                r["jax_bytes_per_device"]] for r in pj["collectives"]],
                      "numeric": [0, 0, 0, 0, 1, 1]}}


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:,.2f} h" if seconds >= 3600 else f"{seconds:,.1f} s"


def sizes_data(rj: dict, kind: str) -> dict:
    """The run's batch sizes (the planner's "run" JSON, planner/batch_sizes.py): one row per
    size its steps take, each from that size's own compiled step, and the run's total."""
    rows = [[s["batch_size"], f"{s['tokens_per_step']:,}", s["grad_accum"],
             f"{s['first_step']:,}", f"{s['steps']:,}", f"{s['step_s']:.3g}", f"{s['scheduled_s']:.3g}",
             f"{s['tokens_per_s_per_device_scheduled']:,.0f}", f"{s['mfu_scheduled']:.1%}",
             f"{s['peak_bytes_counted'] / 1e6:,.2f} MB", "yes" if s["fits"] else "NO"]
            for s in rj["sizes"]]
    schedule = rj["batch_size_schedule"]
    limit = (f"{rj['memory_limit_bytes'] / 1e9:,.1f} GB ({rj['memory_limit_source']})"
             if rj["memory_limit_bytes"] else "unknown")
    return {
        "note": ((f"trainer.batch_size_schedule={schedule}: each batch size the run's steps take is "
                  "its own program, compiled and priced here; the memory and collectives sections "
                  "are the largest size's step. " if schedule else
                  "One batch size (no trainer.batch_size_schedule). ")
                 + f"The run: {rj['steps']:,} steps, {rj['tokens']:,} tokens ({rj['binds']} binds), "
                 f"projected {_duration(rj['time_s'])} with nothing overlapped, "
                 f"{_duration(rj['time_s_scheduled'])} as scheduled on the {kind.upper()}. Memory "
                 f"limit per device {limit}."
                 + "".join(f" ERROR: {e}" for e in rj["errors"])),
        "table": {"head": ["batch size", "tokens / step", "microbatches", "first step", "steps",
                           "step s", "step s (scheduled)", "tokens/s/device (scheduled)",
                           "MFU (scheduled)", "peak", "fits"],
                  "rows": rows, "numeric": [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]}}


def plan_sections(cfg, plan, device_kind: str) -> list[dict]:
    pj, rj, spec = compile_plan(cfg, plan, device_kind)
    return [
        {"id": "sizes", "title": "Batch sizes", "kind": "sizes", "data": sizes_data(rj, device_kind)},
        {"id": "memory", "title": "Memory per device", "kind": "memory",
         "data": memory_data(pj, spec.hbm_bytes, device_kind)},
        {"id": "collectives", "title": "Bytes per collective", "kind": "collectives",
         "data": collectives_data(pj)},
    ]
