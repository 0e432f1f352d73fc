"""The reference's benchmark configs have the reference's parameter counts and FLOPs,
checked on abstract shapes (jax.eval_shape: nothing is allocated)."""

import math
import runpy
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from olmo_jax import config as config_lib
from olmo_jax import metrics
from olmo_jax.model import Transformer, TransformerConfig
from olmo_jax.model.config import HF_OLMOE_LAYOUT

ROOT = Path(__file__).resolve().parents[1]

# name -> (total, active) from the reference (docs/reference.md), checked within 0.1%.
EXPECTED = {
    "olmoe3_47b": (46.863e9, 3.175e9),
    "olmoe3_1p2t": (1.2005e12, 58.36e9),
    "olmoe3_2p4t": (2.3795e12, 58.41e9),
}


def _model_cfg(name):
    return config_lib.model_config(runpy.run_path(str(ROOT / f"configs/{name}.py"))["get_config"]())


def _abstract_param_count(model_cfg) -> int:
    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_parameter_counts(name):
    model_cfg = _model_cfg(name)
    total, active = metrics.param_counts(model_cfg)
    assert _abstract_param_count(model_cfg) == total
    want_total, want_active = EXPECTED[name]
    assert abs(total / want_total - 1) < 1e-3, (name, total)
    assert abs(active / want_active - 1) < 1e-3, (name, active)


def test_47b_flops_per_token():
    cfg = runpy.run_path(str(ROOT / "configs/olmoe3_47b.py"))["get_config"]()
    flops = metrics.flops_per_token(config_lib.model_config(cfg), cfg.trainer.seq_len)
    assert abs(flops / 18.19e9 - 1) < 0.01, flops


def test_4p6b_and_1b7b_sizes():
    total, _ = metrics.param_counts(_model_cfg("olmoe3_4p6b"))
    assert abs(total / 4.6e9 - 1) < 0.01, total
    total, active = metrics.param_counts(_model_cfg("olmoe_1b7b"))
    assert abs(total / 6.92e9 - 1) < 0.01 and abs(active / 1.28e9 - 1) < 0.02, (total, active)


# The reference's values, read from allenai/OLMo-core's example scripts:
# 47B / 8e: src/examples/olmo_ddp/moe_8l_ddp.py + moe_8l_common.py (TECH_REPORT_NUM_EXPERTS
# 128 / 8); 1.2T: src/examples/olmo_ddp/OLMoE3-dev-u001.py. Field -> value.
_SHARED = {
    "model.norm_eps": 1e-6, "model.init_std": 0.01, "model.qk_norm": True,
    "model.head_qk_norm": True, "model.embedding_norm": True, "model.lm_z_loss_coef": 1e-4,
    "model.rope_theta": 500_000.0, "model.head_dim": 128, "model.vocab_size": 100_352,
    "model.moe.top_k": 4, "model.moe.gating": "softmax", "model.moe.norm_topk_prob": True,
    "model.moe.router_weight_scale": 4.0, "model.moe.routing_mode": "random",
    "model.moe.lb_granularity": "local", "model.moe.n_shared_experts": 1,
    "optim.weight_decay": 0.1, "optim.b1": 0.9, "optim.b2": 0.95, "optim.decay_embeddings": False,
    "optim.clip_grad_norm": 1.0, "trainer.seq_len": 8192, "trainer.seed": 2026,
}
_47B = {
    **_SHARED,
    "model.d_model": 4096, "model.n_layers": 8, "model.n_heads": 32, "model.n_kv_heads": 8,
    "model.n_dense_layers": 1, "model.dense_hidden": 4 * 4096 + 4096, "model.block_norm": "post",
    "model.embed_scale": 64.0, "model.moe.expert_hidden": 4096, "model.moe.shared_hidden": 4096,
    "model.moe.lb_loss_coef": 0.015, "model.moe.z_loss_coef": 1e-4,
    "model.moe.capacity_factor": 1.25, "parallel.expert": 8, "optim.lr": 3e-4,
    "optim.schedule": "cosine", "optim.min_lr_ratio": 0.1, "optim.warmup_steps": 10,
    "trainer.global_batch_size": 4 * 2**20 // 8192, "data.repetition_filter": False,
}
REFERENCE = {
    "olmoe3_47b": {**_47B, "model.moe.num_experts": 128},
    "olmoe3_47b_8e": {**_47B, "model.moe.num_experts": 8},
    "olmoe3_4p6b": {**_47B, "model.moe.num_experts": 8},
    "olmoe3_1p2t": {
        **_SHARED,
        "model.d_model": 6144, "model.n_layers": 63, "model.n_heads": 64, "model.n_kv_heads": 32,
        "model.n_dense_layers": 2, "model.dense_hidden": 4 * 8192 + 8192,
        "model.block_norm": "peri", "model.embed_scale": 6144 ** 0.5, "model.remat": "block",
        "model.attention_precision": "mxfp8", "model.moe.precision": "mxfp8",
        "model.moe.num_experts": 128, "model.moe.expert_hidden": 8192,
        "model.moe.shared_hidden": 8192, "model.moe.lb_loss_coef": 0.005,
        "model.moe.z_loss_coef": 2e-4, "model.moe.capacity_factor": 1.1875,
        "parallel.pipe": 8, "parallel.expert": 8, "parallel.pipeline_schedule": "interleaved_1f1b",
        "parallel.virtual_stages": 2, "optim.lr": 1.2e-4 * 8 ** 0.53, "optim.schedule": "constant",
        "optim.warmup_steps": 447, "trainer.global_batch_size": 8192,
        "parallel.microbatches": 128, "data.repetition_filter": True,
        "data.repetition_max_period": 13, "data.repetition_min_period": 1,
        "data.repetition_max_count": 32,
    },
}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_configs_hold_the_reference_scripts_values(name):
    cfg = runpy.run_path(str(ROOT / f"configs/{name}.py"))["get_config"]()
    wrong = {}
    for path, want in REFERENCE[name].items():
        got = config_lib.get_path(cfg, path)
        if got != pytest.approx(want, rel=1e-12) if isinstance(want, float) else got != want:
            wrong[path] = (got, want)
    assert not wrong, f"{name}: field (config, reference): {wrong}"
    config_lib.model_config(cfg)  # and the config validates


LAYOUT_FIELDS = ("model.block_norm", "model.qk_norm", "model.head_qk_norm",
                 "model.embedding_norm", "model.norm_eps", "model.init_std")


def test_the_default_architecture_is_the_reference_scripts_layout():
    """The model's layout defaults are OLMo-core 3's reference MoE: the 47B script's values
    in the table above (which the configs are checked against), the embeddings scaled by
    sqrt(d_model) at any width; the Hugging Face OLMoE layout is the explicit alternative."""
    default = TransformerConfig()
    got = {path: getattr(default, path.split(".", 1)[1]) for path in LAYOUT_FIELDS}
    assert got == {path: _47B[path] for path in LAYOUT_FIELDS}
    assert default.embedding_scale == math.sqrt(default.d_model)
    assert TransformerConfig(d_model=4096).embedding_scale == _47B["model.embed_scale"]
    hf = TransformerConfig(**HF_OLMOE_LAYOUT)
    assert (hf.block_norm, hf.head_qk_norm, hf.embedding_scale, hf.embedding_norm) == (
        "pre", False, 0.0, False)
