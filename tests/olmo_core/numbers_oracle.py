"""OLMo-core's own parameter counts, FLOPs per token and router-bias update as the oracle
(run in .venv-oracle, never imported by the product): `python numbers_oracle.py SPEC.json OUT.json`.

SPEC: {"configs": {name: case}, "bias": [{"bias": [E], "counts": [E], "rate": r}, ...]}, each
case in model_oracle.py's `model_config` keys plus "head_dim" and "seq_len". For each config it
builds OLMo-core's `OLMoDDPModelConfig` (blocks `OLMoDDPTransformerBlockConfig(name=moe_fused_v2)`,
as src/examples/olmo_ddp/moe_8l_ddp.py and OLMoE3-dev-u001.py do) and reports
  - `num_params` / `num_active_params`: the config's own properties (nothing is built);
  - `meta_params`: the parameters of the model built on the meta device (no memory), and
    `norm_params`: those of its RMSNorm weights (QK, block, embedding and LM-head norms);
  - `flops`: the built model's `num_flops_per_token(seq_len)` (OLMoDDPModel's own formula);
  - `benchmark_flops`: the benchmark scripts' `benchmark_num_flops_per_token` (below).
For each bias case it runs `MoERouterV2.post_batch` (the aux-loss-free update, its
`bias_gamma`) on the given `score_bias` and accumulated `batch_size_per_expert`.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_oracle import install_cpu_primitives, model_config, router_config  # noqa: E402


def benchmark_num_flops_per_token(c: dict) -> int:
    """allenai/OLMo-core src/examples/olmo_ddp/moe_8l_common.py `benchmark_num_flops_per_token`,
    "Canonical idealized FLOPs/token used by both benchmark stacks" (the SpeedMonitor's
    num_flops_per_token of moe_8l_ddp.py), copied as written with its module constants
    (D_MODEL, D_ATTN, NUM_KV_HEADS, ...) taken from the case. It assumes the script's shape:
    one dense first block then NUM_LAYERS - 1 MoE blocks."""
    D_MODEL, HEAD_DIM = c["d_model"], c["head_dim"]
    NUM_HEADS, NUM_KV_HEADS = c["n_heads"], c["n_kv_heads"]
    D_ATTN = NUM_HEADS * HEAD_DIM
    NUM_LAYERS, NUM_EXPERTS, TOP_K = c["n_layers"], c["num_experts"], c["top_k"]
    MOE_HIDDEN_SIZE, SHARED_MLP_HIDDEN_SIZE = c["expert_hidden"], c["shared_hidden"]
    NUM_SHARED_EXPERTS, DENSE_LAYER_MLP = 1, c["dense_hidden"]
    vocab_size, seq_len = c["vocab_size"], c["seq_len"]
    assert c["n_dense_layers"] == 1, "the script's formula has exactly one dense first block"

    projection_flops = 6 * (
        D_MODEL * D_ATTN + 2 * D_MODEL * NUM_KV_HEADS * HEAD_DIM + D_ATTN * D_MODEL
    )
    attention_positions = seq_len * (seq_len + 1) // 2
    attention_flops = projection_flops + (
        12 * NUM_HEADS * HEAD_DIM * attention_positions // seq_len
    )
    flops = attention_flops + 18 * D_MODEL * DENSE_LAYER_MLP
    for _ in range(1, NUM_LAYERS):
        flops += attention_flops
        flops += 6 * D_MODEL * NUM_EXPERTS
        flops += 18 * D_MODEL * MOE_HIDDEN_SIZE * TOP_K
        flops += 18 * D_MODEL * SHARED_MLP_HIDDEN_SIZE * NUM_SHARED_EXPERTS
    flops += 6 * D_MODEL * vocab_size
    return flops


def config_numbers(c: dict) -> dict:
    from olmo_core.nn.layer_norm import LayerNorm

    cfg = model_config(c)
    # model_oracle's attention leaves head_dim to d_model // n_heads; the 1.2T has 128-wide
    # heads over d_model 6144 (attention width 8192). One AttentionConfig serves every block.
    for block in [cfg.block, *(cfg.block_overrides or {}).values()]:
        block.sequence_mixer.head_dim = c["head_dim"]
    model = cfg.build(init_device="meta")
    norm_params = sum(p.numel() for m in model.modules() if isinstance(m, LayerNorm)
                      for p in m.parameters(recurse=False))
    out = {"num_params": cfg.num_params, "num_active_params": cfg.num_active_params,
           "meta_params": sum(p.numel() for p in model.parameters()),
           "norm_params": norm_params, "flops": model.num_flops_per_token(c["seq_len"])}
    if c["n_dense_layers"] == 1:
        out["benchmark_flops"] = benchmark_num_flops_per_token(c)
    return out


def bias_update(case: dict) -> list[float]:
    E = len(case["counts"])
    rc = router_config({"num_experts": E, "top_k": 1}, d_model=8)
    rc.bias_gamma = case["rate"]
    router = rc.build()
    router.reset_parameters()
    router.train()
    router.score_bias.copy_(torch.tensor(case["bias"], dtype=torch.float32))
    router.score_bias_batch_size_per_expert = torch.tensor(case["counts"], dtype=torch.float32)
    router.post_batch()
    return router.score_bias.tolist()


def main(spec_path: str, out_path: str) -> None:
    install_cpu_primitives()
    spec = json.loads(Path(spec_path).read_text())
    out = {"configs": {name: config_numbers(c) for name, c in spec["configs"].items()},
           "bias": [bias_update(case) for case in spec["bias"]]}
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
