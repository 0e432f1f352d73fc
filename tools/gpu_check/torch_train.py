"""The GPU check's torch sections: the same shape and batch as configs/gpu_check_1b.py
trained in torch, in its own process, under a Python with torch (the GPU image's python3;
in `make test`'s dry run .venv-oracle). It never imports olmo_jax.

    python tools/gpu_check/torch_train.py hf|olmo_core OUT.json --shape JSON [--steps 30] [--dry-run]

  hf         Hugging Face transformers' OlmoeForCausalLM with its defaults (sdpa attention,
             grouped_mm experts where torch has them), every block MoE, QK-norm, top-k
             softmax router without renormalization, LB loss coefficient as ours
  olmo_core  OLMo-core 3's own MoE model (ai2-olmo-core 3.0.0: OLMoDDPModel, the fused
             MoE-v2 block; on one GPU the no-expert-parallel path, whose grouped GEMM is
             torch.nn.functional.grouped_mm), built at the same shape

Both train the same way as the JAX side: bf16 weights for compute, fp32 master weights
with fused AdamW (lr, betas, weight decay and clipping as configs/gpu_check_1b.py; a
constant lr), random tokens with fixed seeds, one warm-up step and `--steps` timed steps;
tokens/s is steps x tokens / wall time. Eager PyTorch: no torch.compile. If a model
cannot be built or trained, the section's error says exactly where and why (on a CPU,
OLMo-core's MoE-v2 block needs CUDA streams)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch


class MasterAdamW:
    """fp32 master copies of bf16 parameters: grads upcast, clipped by global norm, fused
    AdamW on the masters, the bf16 weights rewritten from them."""

    def __init__(self, params, s: dict):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        fused = self.masters[0].is_cuda or self.masters[0].device.type == "cpu"
        self.opt = torch.optim.AdamW(self.masters, lr=s["lr"], betas=(s["b1"], s["b2"]),
                                     weight_decay=s["weight_decay"], fused=fused)
        self.clip = s["clip"]

    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        if self.clip:
            torch.nn.utils.clip_grad_norm_([m for m in self.masters if m.grad is not None], self.clip)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)


def hf_model(s: dict, device):
    import transformers

    cfg = transformers.OlmoeConfig(
        vocab_size=s["vocab_size"], hidden_size=s["d_model"], intermediate_size=s["expert_hidden"],
        num_hidden_layers=s["n_layers"], num_attention_heads=s["n_heads"],
        num_key_value_heads=s["n_kv_heads"], num_experts=s["num_experts"],
        num_experts_per_tok=s["top_k"], rope_theta=s["rope_theta"], rms_norm_eps=s["norm_eps"],
        max_position_embeddings=s["seq_len"], initializer_range=s["init_std"],
        router_aux_loss_coef=s["lb_loss_coef"], output_router_logits=True, norm_topk_prob=False,
        tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it trains (3.9B parameters: not on the host)
        model = transformers.OlmoeForCausalLM(cfg).to(dtype=torch.bfloat16)
    info = {"transformers": transformers.__version__, "attn": model.config._attn_implementation,
            "experts": getattr(model.config, "_experts_implementation", None)}

    def loss(ids):
        return model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss  # HF shifts labels itself
    return model, loss, info


def olmo_core_model(s: dict, device):
    import olmo_core
    from olmo_core.config import DType
    from olmo_core.nn.attention import AttentionConfig, AttentionType
    from olmo_core.nn.ddp.block import OLMoDDPTransformerBlockConfig
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
    from olmo_core.nn.lm_head import LMHeadConfig
    from olmo_core.nn.moe.v2.routed_experts import RoutedExpertsConfig
    from olmo_core.nn.moe.v2.router import MoERouterConfigV2
    from olmo_core.nn.rope import RoPEConfig
    from olmo_core.nn.transformer import OLMoDDPModelConfig, TransformerBlockType, TransformerType

    dt, d = DType.bfloat16, s["d_model"]
    norm = LayerNormConfig(name=LayerNormType.rms, eps=s["norm_eps"], bias=False, dtype=dt)
    cfg = OLMoDDPModelConfig(
        init_seed=0, d_model=d, vocab_size=s["vocab_size"], n_layers=s["n_layers"],
        name=TransformerType.moe_fused_v2, init_std=s["init_std"], dtype=dt,
        block=OLMoDDPTransformerBlockConfig(
            name=TransformerBlockType.moe_fused_v2,
            attention=AttentionConfig(name=AttentionType.default, n_heads=s["n_heads"],
                                      n_kv_heads=s["n_kv_heads"], bias=False,
                                      rope=RoPEConfig(theta=int(s["rope_theta"])), qk_norm=norm,
                                      use_head_qk_norm=True, dtype=dt),
            routed_experts=RoutedExpertsConfig(d_model=d, hidden_size=s["expert_hidden"],
                                               num_experts=s["num_experts"], bias=False, dtype=dt),
            routed_experts_router=MoERouterConfigV2(d_model=d, num_experts=s["num_experts"],
                                                    top_k=s["top_k"], dtype=dt,
                                                    lb_loss_weight=s["lb_loss_coef"],
                                                    z_loss_weight=s["z_loss_coef"]),
            shared_experts=None, layer_norm=norm),
        lm_head=LMHeadConfig(layer_norm=norm, bias=False, dtype=dt))
    model = cfg.build(init_device=str(device))
    from olmo_core.nn.moe import utils as moe_utils

    if moe_utils.moe_permute is None:  # checked here: the failure inside is a bare TypeError
        raise RuntimeError(
            "OLMo-core 3.0.0's MoE-v2 block on one GPU (no expert parallelism: "
            "olmo_core/nn/moe/v2/no_ep.py) permutes the routed tokens with NVIDIA Transformer "
            "Engine's moe_permute (transformer_engine.pytorch.permutation, imported by "
            "olmo_core/nn/moe/utils.py); transformer_engine is not installed in this Python "
            "(nor on the lent H200 image; its CUDA wheels are not small pure-Python wheels that "
            "could be carried), so the model builds but cannot run a forward pass")
    if device.type != "cuda":
        raise RuntimeError("OLMo-core 3.0.0's MoE-v2 block needs CUDA: no_ep.py runs the shared "
                           "and routed experts on torch.cuda streams (olmo_core.utils.get_or_init_stream)")
    info = {"olmo_core": getattr(olmo_core, "__version__", "?"), "model": type(model).__name__,
            "params_total": cfg.num_params, "params_active": cfg.num_active_params,
            "grouped_mm": hasattr(torch.nn.functional, "grouped_mm")}

    def loss(ids):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        return out.loss if hasattr(out, "loss") else out[1]
    return model, loss, info


MODELS = {"hf": hf_model, "olmo_core": olmo_core_model}


def train(section: str, s: dict, steps: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    stage = "build"
    try:
        model, loss_fn, info = MODELS[section](s, device)
        result.update(info)
        model.train()
        opt = MasterAdamW(model.parameters(), s)
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        batches = [torch.randint(0, s["vocab_size"], (s["batch"], s["seq_len"] + 1), generator=g).to(device)
                   for g in gens]
        losses = []

        def step(i):
            loss = loss_fn(batches[i % len(batches)])
            loss.backward()
            opt.step()
            losses.append(loss.detach())

        stage = "first training step"
        step(0)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        stage = "timed steps"
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            step(i)
        sync()
        elapsed = time.perf_counter() - t0
    except Exception as e:
        result["error"] = f"{section} failed at its {stage}: {type(e).__name__}: {e}"[:3000]
        result["traceback"] = traceback.format_exc()[-6000:]
        return result
    tokens = steps * s["batch"] * s["seq_len"]
    result.update(steps=steps, step_ms=1e3 * elapsed / steps, tokens_per_s=tokens / elapsed,
                  losses=[float(x) for x in losses],
                  peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("section", choices=sorted(MODELS))
    p.add_argument("out")
    p.add_argument("--shape", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    t0 = time.perf_counter()
    res = train(a.section, json.loads(a.shape), a.steps)
    out = {"error": res.pop("error"), "traceback": res.pop("traceback"), "result": res} if "error" in res \
        else {"result": res}
    if "traceback" in out:
        print(out["traceback"], file=sys.stderr, flush=True)
    out["seconds"] = time.perf_counter() - t0
    Path(a.out).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
