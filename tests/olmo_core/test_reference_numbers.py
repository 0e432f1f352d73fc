"""olmo_jax's parameter counts, FLOPs per token and aux-loss-free bias update against
OLMo-core's own (ai2-olmo-core in .venv-oracle, one subprocess for the file:
numbers_oracle.py), for every reference config: OLMo-core builds its `OLMoDDPModelConfig` with
the same values and reports its config's `num_params` / `num_active_params`, its model's
`num_flops_per_token` (built on the meta device) and the benchmark scripts' own formula."""

from __future__ import annotations

import json
import runpy
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo_jax import config as config_lib
from olmo_jax import metrics
from olmo_jax.model.moe.bias_balancing import update_router_bias
from olmo_jax.model.moe.router import RouterBias

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"


def _has_olmo_core() -> bool:
    if not ORACLE_PY.exists():
        return False
    probe = subprocess.run([str(ORACLE_PY), "-c", "import olmo_core"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _has_olmo_core(),
                                reason="no .venv-oracle with ai2-olmo-core (make oracle)")

CONFIGS = ["olmoe3_47b", "olmoe3_47b_8e", "olmoe3_4p6b", "olmoe3_1p2t", "olmoe3_2p4t"]
BIAS_CASES = [(8, 0.001, 0), (128, 0.001, 1), (256, 1e-4, 2), (64, 0.01, 3)]


def _run_cfg(name):
    return runpy.run_path(str(ROOT / f"configs/{name}.py"))["get_config"]()


def _case(m, seq_len: int) -> dict:
    """The model config in model_oracle.py's `model_config` keys."""
    e = m.moe
    assert e.n_shared_experts == 1  # model_oracle builds one shared expert
    return {
        "d_model": m.d_model, "vocab_size": m.vocab_size, "n_layers": m.n_layers,
        "n_heads": m.n_heads, "n_kv_heads": m.kv_heads, "head_dim": m.head_size,
        "n_dense_layers": m.n_dense_layers, "dense_hidden": m.dense_hidden_size,
        "eps": m.norm_eps, "rope_theta": m.rope_theta, "head_qk_norm": m.head_qk_norm,
        "block_norm": m.block_norm, "embedding_norm": m.embedding_norm,
        "embed_scale": m.embed_scale, "init_std": m.init_std, "seed": 0,
        "num_experts": e.num_experts, "top_k": e.top_k, "expert_hidden": e.expert_hidden,
        "shared_hidden": e.shared_hidden, "seq_len": seq_len,
    }


def _bias_inputs(E: int, rate: float, seed: int):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4 * E, E).astype(np.float32)
    if seed % 2:  # mean 4: a quarter above, a quarter below, half exactly at it (sign 0)
        counts = np.resize(np.float32([3.0, 5.0, 4.0, 4.0]), E)
    bias = rng.normal(0, 0.01, E).astype(np.float32)
    return bias, counts, rate


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("numbers")
    cfgs = {n: _run_cfg(n) for n in CONFIGS}
    spec = {
        "configs": {n: _case(config_lib.model_config(c), c.trainer.seq_len) for n, c in cfgs.items()},
        "bias": [{"bias": b.tolist(), "counts": k.tolist(), "rate": r}
                 for b, k, r in (_bias_inputs(*c) for c in BIAS_CASES)],
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("numbers_oracle.py")),
                    str(tmp / "spec.json"), str(tmp / "out.json")], check=True, cwd=tmp, timeout=300)
    return json.loads((tmp / "out.json").read_text())


def _norm_weights(m) -> int:
    """The RMSNorm weights of the model: QK-norms (one [head_dim] each with per-head QK-norm,
    else the whole q / k widths), the block norms (2 per block, peri-norm 4), the embedding
    and LM-head norms."""
    qk = 2 * m.head_size if m.head_qk_norm else (m.n_heads + m.kv_heads) * m.head_size
    block = (4 if m.block_norm == "peri" else 2) * m.d_model
    return m.n_layers * (qk * m.qk_norm + block) + m.d_model * (1 + m.embedding_norm)


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_counts_match_olmo_core(oracle, name):
    m = config_lib.model_config(_run_cfg(name))
    got = oracle["configs"][name]
    total, active = metrics.param_counts(m)
    print(f"{name}: olmo_jax {total} / {active}; OLMo-core {got['num_params']} / "
          f"{got['num_active_params']} (meta model {got['meta_params']}, norms {got['norm_params']})")
    assert got["meta_params"] == got["num_params"]  # OLMo-core's config agrees with its model
    assert got["norm_params"] == _norm_weights(m)  # every norm weight is where we think
    assert (total, active) == (got["num_params"], got["num_active_params"])


@pytest.mark.parametrize("name", CONFIGS)
def test_flops_per_token_match_olmo_core(oracle, name):
    run = _run_cfg(name)
    m, S = config_lib.model_config(run), run.trainer.seq_len
    got = oracle["configs"][name]
    flops = metrics.flops_per_token(m, S)
    print(f"{name}: olmo_jax {flops:.0f}; OLMo-core model {got['flops']}, "
          f"script formula {got.get('benchmark_flops')}")
    # The benchmark scripts' formula (47B shape, moe_8l_common.py): the same, exactly.
    if "benchmark_flops" in got:
        assert flops == got["benchmark_flops"]
    # OLMoDDPModel.num_flops_per_token counts 6 x every parameter of the attention and the
    # LM head, norm weights included: the QK-norm weights of each block and the LM head's
    # final norm, which olmo_jax (and the scripts' formula) leave out as negligible.
    qk = (2 * m.head_size if m.head_qk_norm else (m.n_heads + m.kv_heads) * m.head_size)
    explained = 6 * (m.n_layers * qk * m.qk_norm + m.d_model)
    assert got["flops"] - flops == explained, (got["flops"] - flops, explained)


def test_bias_update_matches_olmo_core(oracle):
    worst = 0.0
    for (E, rate, seed), want in zip(BIAS_CASES, oracle["bias"], strict=True):
        bias, counts, _ = _bias_inputs(E, rate, seed)
        state = nnx.State({"router": {"bias": RouterBias(jnp.asarray(bias)[None])}})
        new = update_router_bias(state, jnp.asarray(counts)[None], rate)
        got = np.asarray(new["router"]["bias"][...])[0]
        want = np.asarray(want, np.float32)
        worst = max(worst, float(np.max(np.abs(got - want))))
        np.testing.assert_array_equal(got, want)  # bitwise
        assert (got != bias).any()
    print(f"bias update: max |olmo_jax - OLMo-core| = {worst}")
