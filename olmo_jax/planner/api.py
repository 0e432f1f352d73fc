"""The planner's front door: `plan_config(run, n_devices, kind)` compiles the config's
step (and, with compare=True, its ddp + EP and fsdp variants) for n devices, builds the
plans (planner/plan_build.py) and renders them (planner/plan_text.py). For a GPU device
kind the step is XLA:GPU's, compiled for n abstract GPUs here or in the GPU compile venv
(planner/xla_gpu.py's `run_in_gpu_venv`, whose worker, planner/command.py, calls
`plan_config` there); else (and as the labelled fallback) it is XLA:CPU's on n fake CPU
devices (planner/xla_gpu.py says which). A pipelined config (parallel.pipe > 1) is
compiled as the trainer runs it: its schedule, stages and stage-to-stage sends. With
trainer.batch_size_schedule the step is compiled at every batch size the run's steps take
(planner/batch_sizes.py): the detailed plan (and the strategies compared) is the largest
size's, the run's table lists each size's step time and memory.

`python -m olmo_jax.plan` calls it once its flags are read, and so does the report's
plan view (report/plan_view.py).
"""

from __future__ import annotations

import dataclasses

import jax

from olmo_jax import targets
from olmo_jax.config import RunConfig
from olmo_jax.errors import ConfigError
from olmo_jax.parallel.expert import rowwise_capacity_factor
from olmo_jax.planner import batch_sizes, hardware, plan_build, plan_text, xla_gpu
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


def comparison_variants(cfg: RunConfig) -> list[tuple[str, dict]]:
    """(label, config changes): ddp + expert parallelism, fsdp as configured, and fsdp with
    capacity buffers (the same batched expert matmul as rowwise dispatch: XLA:CPU's
    dropless layout gathers each block's expert weights, which a GPU's grouped GEMM does
    not, so this variant isolates what the strategy itself costs). fsdp runs no pipeline:
    with parallel.pipe > 1 its variants fold the pipe axis into data on the same devices
    and the pipeline's microbatches into gradient accumulation (same microbatch size)."""
    p = cfg.parallel
    cf = rowwise_capacity_factor(cfg.model.moe.capacity_factor)  # the rowwise variant's
    fsdp = {"parallel.strategy": "fsdp"}
    label = "fsdp"
    if p.pipe > 1:
        fsdp.update({"parallel.pipe": 1, "parallel.data": p.data * p.pipe if p.data > 0 else -1,
                     "parallel.microbatches": 1, "parallel.virtual_stages": 1,
                     "trainer.grad_accum": cfg.trainer.grad_accum * p.microbatches})
        label = "fsdp, pipe into data"
    return [(f"ddp + EP ({p.dispatch})", {"parallel.strategy": "ddp"}),
            (label, fsdp),
            (f"{label}, capacity {cf}", {**fsdp, "model.moe.capacity_factor": cf})]


def _same(cfg: RunConfig, changes: dict) -> bool:
    return all(cfg.get(k) == v for k, v in changes.items())


def _variant(cfg: RunConfig, devices, changes: dict, kind: str, batch_size: int):
    return compile_train_step(cfg.with_values(changes), devices, kind=kind, batch_size=batch_size)


def plan_sizes(run: RunConfig, devices, kind: str, spec: hardware.DeviceSpec,
               notes: list[str] | None = None) -> dict[int, plan_build.Plan]:
    """{batch size: the Plan of the step compiled at it} for each size the run's steps
    take (batch_sizes.run_sizes: trainer.global_batch_size alone without a schedule),
    compiled for `devices` (`kind`: compile_train_step's) and priced on `spec`."""
    sizes = [r.size for r in batch_sizes.run_sizes(run.trainer)]
    return {size: plan_build.build(compile_train_step(run, devices, kind=kind, batch_size=size),
                                   spec, notes=notes)
            for size in reversed(sizes)}  # the largest first: the one that must fit


def plan_run(run: RunConfig, by_size: dict[int, plan_build.Plan], config_path: str = ""
             ) -> tuple[plan_build.Plan, list[str], dict]:
    """(the detailed plan: the largest size's, carrying the run's errors; its text and the
    run's by size; their JSON {"plan", "run"}) of `by_size` (plan_sizes)."""
    run_plan = batch_sizes.build(run.trainer, by_size)
    plan = run_plan.largest.plan
    plan.errors += [e for e in run_plan.errors if e not in plan.errors]
    text = [plan_text.format_plan(plan, config_path), plan_text.format_run(run_plan)]
    return plan, text, {"plan": plan.to_json(), "run": run_plan.to_json()}


def plan_config(run: RunConfig, n_devices: int, kind: str, *, compare: bool = False,
                compiler: str = "auto", config_path: str = "", devices=None) -> dict:
    """{"text": the rendered plan(s), "json": {"plan": ..., "run": ..., "compare": [...]}} of the
    validated config `run` (config.validate) on `n_devices` of device kind `kind`
    (hardware.KINDS). `compare`: add the strategies side by side (comparison_variants);
    `compiler`: auto | xla_gpu | xla_cpu (planner/xla_gpu.py); `config_path`: the
    config file named in the text; `devices`: the fake CPU devices an XLA:CPU plan
    compiles for when JAX already runs (default: start n of them). "plan" is the step
    at the largest batch size the run takes (trainer.global_batch_size without a
    trainer.batch_size_schedule), "run" the step planned at each size
    (planner/batch_sizes.py)."""
    try:
        where = xla_gpu.where(kind, compiler)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if where.how == "subprocess":
        return xla_gpu.run_in_gpu_venv(where.python, run, n_devices, kind, compare, config_path)
    if where.how == "here":
        devices = targets.abstract_devices(kind, n_devices)
    elif devices is None:
        devices = start_devices(n_devices)
    notes = [where.note] if where.note else []
    spec = hardware.device_spec(kind, n_devices)
    plan, text, out = plan_run(run, plan_sizes(run, devices, kind, spec, notes), config_path)
    if compare:
        plans = [dataclasses.replace(plan, label=label) if _same(run, changes)
                 else plan_build.build(_variant(run, devices, changes, kind, plan.step.batch_size), spec,
                                       label=label, notes=notes)
                 for label, changes in comparison_variants(run)]
        text.append(plan_text.format_comparison(plans))
        out["compare"] = [p.to_json() for p in plans]
    return {"text": "\n\n".join(text), "json": out}
