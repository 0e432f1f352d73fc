"""What `python -m olmo_jax.plan` runs once its flags are read: start JAX on n fake CPU
devices, compile the config's step (and, with --compare-strategies, its ddp + EP and fsdp
variants), build the plans and render them.

A config whose pipeline axis the trainer's step cannot run yet (`parallel.pipe > 1`
refused by `build_plan`) is planned with the pipeline axis folded into `data` on the same
devices, and the output says so in capitals.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import ml_collections

from olmo_jax.model.config import ConfigError
from olmo_jax.parallel import zero
from olmo_jax.planner import extrapolate, hardware, report
from olmo_jax.planner.compile import compile_train_step


def start_devices(n: int) -> list:
    """n fake CPU devices; must run before anything starts JAX's backend."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
    devices = jax.devices("cpu")
    if len(devices) != n:
        raise ConfigError(f"asked for {n} fake CPU devices, JAX started with {len(devices)} "
                          "(its backend was already running)")
    return devices


def fold_pipe(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config with parallel.pipe folded into parallel.data (same device count)."""
    out = copy.deepcopy(cfg)
    p = out.parallel
    if p.data != -1:
        p.data *= p.pipe
    p.pipe = 1
    return out


def _compile(cfg, devices):
    """(compiled step, notes, folded pipe size or 1): with the pipe axis folded into data
    when the step cannot run pipeline stages."""
    try:
        return compile_train_step(cfg, devices), [], 1
    except ConfigError as e:
        if not (cfg.parallel.pipe > 1 and str(e).startswith("parallel.pipe=")):
            raise
        pipe = cfg.parallel.pipe
        step = compile_train_step(fold_pipe(cfg), devices)
    compute = jax.tree.map(lambda x, lay: jax.sharding.NamedSharding(step.plan.mesh, lay.compute),
                           step.state.params, step.plan.layouts,
                           is_leaf=lambda x: isinstance(x, zero.ParamLayout))
    weights = zero.per_device_bytes(step.state.params, compute)
    notes = [
        f"PIPELINE NOT AVAILABLE: this trainer's step cannot run parallel.pipe={pipe} yet, so "
        f"this is the config with the pipe axis folded into data (mesh "
        f"{dict(step.plan.mesh.shape)}), on the same {step.n_devices} devices.",
        f"With pipe={pipe} each device would run 1/{pipe} of the blocks on {pipe}x the "
        f"tokens: the float32 weights gathered for compute, {weights / 1e9:,.1f} GB per "
        f"device here, would be ~{weights / pipe / 1e9:,.1f} GB; the EXTRAPOLATED section at "
        f"the end estimates the pipelined run from this plan.",
    ]
    return step, notes, pipe


def comparison_variants(cfg) -> list[tuple[str, dict]]:
    """(label, config changes): ddp + expert parallelism, fsdp as configured, and fsdp with
    capacity buffers (the same batched expert matmul as rowwise dispatch: XLA:CPU's
    dropless layout gathers each block's expert weights, which a GPU's grouped GEMM does
    not, so this variant isolates what the strategy itself costs)."""
    cf = cfg.parallel.capacity_factor
    return [(f"ddp + EP ({cfg.parallel.dispatch})", {"parallel.strategy": "ddp"}),
            ("fsdp", {"parallel.strategy": "fsdp"}),
            (f"fsdp, capacity {cf}", {"parallel.strategy": "fsdp",
                                       "model.moe.capacity_factor": cf})]


def _same(cfg, changes: dict) -> bool:
    return all(_get(cfg, k) == v for k, v in changes.items())


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _variant(cfg, devices, changes: dict):
    variant = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        *path, last = dotted.split(".")
        node = variant
        for part in path:
            node = node[part]
        node[last] = value
    step, _, _ = _compile(variant, devices)
    return (step,)


def run(cfg: ml_collections.ConfigDict, n_devices: int, kind: str, compare: bool,
        config_path: str = "") -> dict:
    devices = start_devices(n_devices)
    spec = hardware.device_spec(kind, n_devices)
    step, notes, pipe = _compile(cfg, devices)
    plan = report.build(step, spec, notes=notes)
    text = [report.format_plan(plan, config_path)]
    out = {"plan": plan.to_json()}
    if pipe > 1:
        est = extrapolate.estimate(plan, pipe, spec)
        text.append(extrapolate.format_estimate(est))
        out["pipeline_extrapolation"] = {
            "mesh": est.mesh, "step_s": est.projection.step_s,
            "overlapped_s": est.projection.overlapped_s, "link_s": est.projection.link_s,
            "tokens_per_s_per_device": est.projection.tokens_per_s(),
            "mfu": est.projection.mfu(), "mfu_overlapped": est.projection.mfu(True),
            "bubble": est.bubble, "microbatches": est.microbatches,
            "peak_bytes": est.peak_bytes, "p2p_bytes": est.p2p_bytes}
    if compare:
        plans = [dataclasses.replace(plan, label=label) if _same(cfg, changes)
                 else report.build(*_variant(cfg, devices, changes), spec, label=label)
                 for label, changes in comparison_variants(cfg)]
        text.append(report.format_comparison(plans))
        out["compare"] = [p.to_json() for p in plans]
    return {"text": "\n\n".join(text), "json": out}
