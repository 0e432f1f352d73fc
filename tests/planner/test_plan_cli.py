"""`python -m olmo_jax.plan --compiler=xla_cpu` (the XLA:CPU program; XLA:GPU's:
test_plan_xla_gpu.py) end to end on a small config and 4 fake devices, with
--compare-strategies: every section printed, the JSON's numbers consistent with the
model (parameter counts, formula FLOPs, matmul part within 5%) and the strategies
(fsdp moves parameters, ddp + EP tokens); bad flags are refused with the fix named; a
pipelined config's fsdp variants fold the pipeline into data."""

import json
import os
import subprocess
import sys
from pathlib import Path

from olmo_jax import config as config_lib
from olmo_jax import metrics
from olmo_jax.config import default_config, model_config
from olmo_jax.parallel.expert import ROWWISE_CAPACITY_FACTOR
from olmo_jax.planner.api import comparison_variants

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["--config.model.d_model=32", "--config.model.n_layers=2",
             "--config.model.n_dense_layers=0", "--config.model.moe.expert_hidden=32",
             "--config.model.vocab_size=128", "--config.trainer.seq_len=32",
             "--config.trainer.global_batch_size=8", "--config.parallel.expert=4"]


def _plan(*args, timeout=600):
    env = dict(os.environ, XLA_FLAGS="")  # the CLI sets up its own devices
    return subprocess.run([sys.executable, "-m", "olmo_jax.plan", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_plan_cli_end_to_end(tmp_path):
    out = tmp_path / "plan.json"
    proc = _plan("--config=configs/tiny.py", *OVERRIDES, "--devices=4", "--device-kind=h200",
                 "--compiler=xla_cpu", "--compare-strategies", f"--json={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    print(text)
    for heading in ("olmo_jax plan: configs/tiny.py", "FLOPs per token", "Memory per device",
                    "Collectives per step", "Projected step on H200", "Strategies side by side",
                    "compiled by XLA:CPU for 4 fake CPU devices",
                    "XLA:CPU program (--compiler=xla_cpu), priced for the H200"):
        assert heading in text, heading
    result = json.loads(out.read_text())
    plan = result["plan"]
    cfg = default_config()
    cfg.model.update({"d_model": 32, "n_layers": 2, "n_dense_layers": 0, "vocab_size": 128})
    cfg.model.moe.expert_hidden = 32
    mcfg = model_config(cfg)
    assert tuple(plan["params"]) == metrics.param_counts(mcfg)
    assert plan["flops_per_token_formula"] == metrics.flops_per_token_parts(mcfg, 32)
    assert abs(plan["matmul_ratio"] - 1) < 0.05
    assert plan["mesh"] == {"pipe": 1, "data": 1, "context": 1, "expert": 4} and plan["devices"] == 4
    assert plan["peak_bytes"] > 0 and plan["step_s"] > 0 and 0 < plan["mfu"] < 1
    kinds = {(r["kind"], r["purpose"]) for r in plan["collectives"]}
    assert ("all-to-all", "moe_rowwise") in kinds
    ddp, fsdp, fsdp_cap = result["compare"]
    assert ddp["collective_jax_bytes"] == plan["collective_jax_bytes"]
    assert not any(r["kind"] == "all-to-all" for r in fsdp["collectives"])
    # fsdp gathers every weight (experts too) and reduce-scatters every gradient.
    fsdp_params = sum(r["jax_bytes_per_device"] for r in fsdp["collectives"]
                      if r["purpose"] == "fsdp_gather")
    assert fsdp_params >= 4 * metrics.param_counts(mcfg)[0] * 3 / 4  # float32, 3/4 gathered
    assert fsdp_cap["flops_per_token_hlo"]["routed_experts"] > 0


def test_plan_cli_refuses_bad_flags():
    proc = _plan("--config=configs/tiny.py", "--device-kind=tpu", timeout=120)
    assert proc.returncode == 2 and "--device-kind=tpu: choose one of" in proc.stderr
    proc = _plan("--config=configs/tiny.py", "--config.parallel.expertz=2", timeout=120)
    assert proc.returncode == 2 and "parallel.expert" in proc.stderr


def test_fsdp_variants_of_a_pipelined_config_fold_the_pipeline():
    cfg = default_config()
    cfg.parallel.pipe, cfg.parallel.data, cfg.parallel.expert = 4, 2, 8
    cfg.parallel.microbatches, cfg.trainer.grad_accum = 8, 2
    (_, ddp), (label, fsdp), (_, capacity) = comparison_variants(config_lib.parse(cfg))
    assert ddp == {"parallel.strategy": "ddp"} and label == "fsdp, pipe into data"
    assert fsdp["parallel.pipe"] == 1 and fsdp["parallel.data"] == 8  # same 64 devices
    assert fsdp["parallel.microbatches"] == 1 and fsdp["trainer.grad_accum"] == 16
    assert capacity == fsdp | {"model.moe.capacity_factor": ROWWISE_CAPACITY_FACTOR}  # rowwise's
    cfg.parallel.data = -1
    assert comparison_variants(config_lib.parse(cfg))[1][1]["parallel.data"] == -1
    cfg.parallel.pipe = 1
    assert comparison_variants(config_lib.parse(cfg))[1] == ("fsdp", {"parallel.strategy": "fsdp"})
