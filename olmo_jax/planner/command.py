"""What `python -m olmo_jax.plan` runs once its flags are read: compile the config's step
(and, with --compare-strategies, its ddp + EP and fsdp variants) for n devices, build the
plans and render them. For a GPU device kind the step is XLA:GPU's, compiled for n
abstract GPUs here or in the GPU compile venv; else (and as the labelled fallback) it is
XLA:CPU's on n fake CPU devices (planner/xla_gpu.py says which). A pipelined config
(parallel.pipe > 1) is compiled as the trainer runs it: its schedule, stages and
stage-to-stage sends.

`python -m olmo_jax.planner.command IN OUT` is the GPU compile venv's worker
(xla_gpu.run_in_gpu_venv starts it): `run` on the pickled config IN, compiling on
XLA:GPU, the rendered plan and its JSON (or the config's error) written to OUT.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
from pathlib import Path

import jax

from olmo_jax import targets
from olmo_jax.config import RunConfig
from olmo_jax.errors import ConfigError, DataError
from olmo_jax.parallel.expert import rowwise_capacity_factor
from olmo_jax.planner import hardware, report, xla_gpu
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


def _variant(cfg: RunConfig, devices, changes: dict, kind: str):
    return compile_train_step(cfg.with_values(changes), devices, kind=kind)


def run(cfg: RunConfig, n_devices: int, kind: str, compare: bool,
        config_path: str = "", compiler: str = "auto", devices=None) -> dict:
    """{"text": the rendered plan(s), "json": {"plan": ..., "compare": [...]}} of the
    validated config `cfg` (config.validate). `compiler`:
    auto | xla_gpu | xla_cpu (planner/xla_gpu.py); `devices`: the fake CPU devices an
    XLA:CPU plan compiles for when JAX already runs (default: start n of them)."""
    try:
        where = xla_gpu.where(kind, compiler)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if where.how == "subprocess":
        return xla_gpu.run_in_gpu_venv(where.python, cfg, n_devices, kind, compare, config_path)
    if where.how == "here":
        devices = targets.abstract_devices(kind, n_devices)
    elif devices is None:
        devices = start_devices(n_devices)
    notes = [where.note] if where.note else []
    spec = hardware.device_spec(kind, n_devices)
    plan = report.build(compile_train_step(cfg, devices, kind=kind), spec, notes=notes)
    text = [report.format_plan(plan, config_path)]
    out = {"plan": plan.to_json()}
    if compare:
        plans = [dataclasses.replace(plan, label=label) if _same(cfg, changes)
                 else report.build(_variant(cfg, devices, changes, kind), spec, label=label,
                                   notes=notes)
                 for label, changes in comparison_variants(cfg)]
        text.append(report.format_comparison(plans))
        out["compare"] = [p.to_json() for p in plans]
    return {"text": "\n\n".join(text), "json": out}


def _worker(src: str, dst: str) -> int:
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

    args = pickle.loads(Path(src).read_bytes())
    if not xla_gpu.has_cuda_plugin():
        print(f"{sys.executable} has no jax CUDA plugin", file=sys.stderr)
        return 1
    try:
        out = run(args["cfg"], args["n_devices"], args["kind"], args["compare"],
                  args["config_path"], compiler="xla_gpu")
    except (ConfigError, DataError) as e:
        out = {"error": str(e), "kind": type(e).__name__}
    Path(dst).write_text(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(*sys.argv[1:]))
