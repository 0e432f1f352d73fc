"""The planner on XLA:GPU: a small bf16 config planned for 4 abstract H200s through
`planner.api.plan_config` from this (CPU-only) interpreter, which runs the planner in the GPU
compile venv (planner/xla_gpu.py; skipped, saying so, where none exists: `make test`
builds .venv-gpu first). The plan is XLA:GPU's: cuDNN fused attention, whose FLOPs are
the causal triangle x 7 score GEMMs (2 forward, 5 in the flash backward) against the
formula's 6; every parameter matmul exactly the formula's (XLA:GPU's GEMM fusions walked);
the routed experts' batched GEMMs the rowwise capacity padding over it; memory from
XLA:GPU's buffer assignment; the all-to-all bytes the dispatch formula's at bf16 (the GPU
sends what the program asks); matmuls and links priced at the stated efficiencies; the
ZeRO-1 all-gathers moving the bf16 compute copies and the reduce-scatters float32
gradients (parallel/zero.py). The fallback and its label are checked without a compile."""

import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from olmo_jax import config as config_lib
from olmo_jax.config import default_config, model_config
from olmo_jax.errors import ConfigError
from olmo_jax.model.abstract import abstract_model
from olmo_jax.model.moe import sizing
from olmo_jax.parallel import zero
from olmo_jax.planner import api, hardware, xla_gpu
from tests.sections import plan_for

BATCH, SEQ = 8, 64
EXPERTS, D = 8, 64

NO_XLA_GPU = (f"no XLA:GPU compile venv ({xla_gpu.ROOT / '.venv-gpu'}; `make gpu-venv` or "
              f"${xla_gpu.GPU_PYTHON_ENV}): the planner falls back to XLA:CPU here")


def small_config():
    c = default_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 128, D, 2, 4, 2
    m.n_dense_layers, m.dense_hidden, m.dtype = 1, 128, "bfloat16"
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = EXPERTS, 2, 64
    m.moe.gmm_impl = "einsum"  # batched GEMMs over the capacity groups (ragged_dot: the plan's error)
    c.parallel.expert, c.parallel.dispatch = 4, "rowwise"
    c.trainer.global_batch_size, c.trainer.seq_len = BATCH, SEQ
    return c


@pytest.fixture(scope="module")
def out():
    if xla_gpu.gpu_python() is None and not xla_gpu.has_cuda_plugin():
        pytest.skip(NO_XLA_GPU)
    return api.plan_config(config_lib.validate(small_config()), 4, "h200", config_path="small")


def test_the_plan_is_xla_gpus(out):
    text, plan = out["text"], out["json"]["plan"]
    print(text)
    assert "compiled by XLA:GPU for 4 abstract H200 GPUs" in text and "FALLBACK" not in text
    assert plan["compiler"] == "XLA:GPU" and plan["attention_impl"] == "cudnn"
    assert plan["errors"] == []  # einsum: no routed-expert op dense over the groups
    assert plan["matmul_efficiency"] == pytest.approx(hardware.MATMUL_EFFICIENCY)
    assert plan["link_efficiency"] == hardware.LINK_EFFICIENCY
    assert "at 79.2% of peak" in text and "80% of the link bandwidth" in text


def test_flops_match_the_formula_term_by_term(out):
    plan = out["json"]["plan"]
    f, h = plan["flops_per_token_formula"], plan["flops_per_token_hlo"]
    for term in ("attention_proj", "router", "dense_mlp", "lm_head"):
        assert h[term] == pytest.approx(f[term], rel=1e-6), term
    assert h["attention_scores"] / f["attention_scores"] == pytest.approx(7 / 6, rel=1e-6)
    assert h["routed_experts"] / f["routed_experts"] == pytest.approx(plan["buffer_factor"],
                                                                      rel=1e-6)
    assert plan["matmul_ratio"] == pytest.approx(1, rel=1e-6) and h["other"] == 0


def test_memory_is_xla_gpus_buffer_assignment(out):
    plan = out["json"]["plan"]
    assert sum(plan["argument_parts"].values()) == plan["argument_bytes"]
    assert plan["peak_bytes"] >= plan["temp_bytes"] > 0
    assert plan["peak_bytes_counted"] == plan["peak_bytes"] and plan["scores_bytes"] == 0
    labels = [g["label"] for g in plan["peak"]]
    assert "argument: params" in labels and "argument: opt_state" in labels
    assert "other" not in labels  # every live value found by name in XLA:GPU's module
    # XLA allocates its temporaries as one block: at least what is live at the peak.
    assert plan["allocated_bytes"] >= plan["peak_bytes"]
    assert plan["allocated_bytes"] >= plan["argument_bytes"] + plan["temp_bytes"]


def test_all_to_all_bytes_match_the_dispatch_formula_at_bf16(out):
    plan = out["json"]["plan"]
    rows = [r for r in plan["collectives"] if r["kind"] == "all-to-all"]
    assert {r["purpose"] for r in rows} == {"moe_rowwise"}
    tokens = BATCH // 4 * SEQ
    send = EXPERTS * sizing.capacity(tokens, 2, EXPERTS, 1.25) * D * 2  # bf16
    assert sum(r["jax_bytes_per_device"] for r in rows) == 4 * 1 * send  # 1 MoE layer
    assert all(r["bytes_per_device"] == r["jax_bytes_per_device"] for r in rows)
    assert plan["link_s"]["network"] == 0 and plan["link_s"]["nvlink"] > 0


def test_without_xla_gpu_the_cpu_fallback_is_labelled(monkeypatch):
    monkeypatch.setattr(xla_gpu, "has_cuda_plugin", lambda: False)
    monkeypatch.setattr(xla_gpu, "gpu_python", lambda: None)
    where = xla_gpu.where("b300")
    assert where.how == "cpu" and "XLA:CPU FALLBACK" in where.note and "make gpu-venv" in where.note
    assert xla_gpu.where("cpu").how == "cpu" and not xla_gpu.where("cpu").note
    with pytest.raises(ConfigError, match="--compiler=xla_gpu: no XLA:GPU here"):
        api.plan_config(config_lib.validate(small_config()), 4, "b300", compiler="xla_gpu")


def _split_compute_bytes(cfg, n_devices):
    """(bytes at the compute copies' dtypes, bytes in float32) of the per-device compute
    copies of every parameter ZeRO-1 splits, from the plan's layouts on n CPU devices."""
    model_cfg = model_config(cfg)
    params = abstract_model(model_cfg)[1]
    plan = plan_for(cfg, model_cfg, devices=jax.devices()[:n_devices])
    copy = f32 = 0
    lays = jax.tree.leaves(plan.layouts, is_leaf=lambda v: isinstance(v, zero.ParamLayout))
    for x, lay in zip(jax.tree.leaves(params), lays, strict=True):
        if lay.dim is not None:
            n = NamedSharding(plan.mesh, lay.compute).shard_shape(x.shape)
            copy += math.prod(n) * np.dtype(lay.dtype or x.dtype).itemsize
            f32 += math.prod(n) * 4
    return copy, f32


def test_zero1_gathers_bf16_copies_and_reduces_f32_gradients(out):
    # model.dtype=bfloat16: XLA:GPU's program all-gathers the bf16 compute copies of the
    # weights cast at use (float32 for norms, router, embedding) and reduce-scatters the
    # gradients in float32 (parallel/zero.py).
    plan = out["json"]["plan"]
    copy, f32 = _split_compute_bytes(small_config(), 4)
    assert copy < 0.7 * f32  # most split bytes are matmul weights
    rows = {(r["kind"], r["purpose"]): r for r in plan["collectives"]}
    gather, scatter = rows[("all-gather", "zero_gather")], rows[("reduce-scatter", "zero_reduce")]
    assert gather["executions"] == gather["ops"] and scatter["executions"] == scatter["ops"]  # once a step
    assert gather["bytes_per_device"] == copy
    assert scatter["bytes_per_device"] == f32


def test_the_step_as_scheduled_lies_between_the_bounds(out):
    """The train step replayed in XLA:GPU's schedule (planner/overlap.py): every
    collective's link time in it once, the compute the roofline's, and the step between
    nothing overlapped and collectives fully overlapped."""
    text, plan = out["text"], out["json"]["plan"]
    sc = plan["overlap"]
    assert plan["overlapped_s"] <= plan["scheduled_s"] <= plan["step_s"]
    assert sc["compute_s"] == pytest.approx(plan["roofline_s"], rel=1e-9)
    assert sc["link_s"] == pytest.approx(sum(plan["link_s"].values()), rel=1e-9)
    assert plan["scheduled_s"] == pytest.approx(sc["step_s"], rel=1e-9)
    assert sum(r["exposed_s"] for r in sc["rows"]) == pytest.approx(sc["exposed_s"], rel=1e-6)
    assert {r["kind"] for r in sc["rows"]} >= {"all-to-all", "all-gather", "reduce-scatter"}
    assert plan["tokens_per_s_per_device_scheduled"] == pytest.approx(
        plan["tokens_per_s_per_device"] * plan["step_s"] / plan["scheduled_s"])
    assert "as XLA:GPU scheduled it" in text and "Overlap as XLA:GPU scheduled the step" in text
