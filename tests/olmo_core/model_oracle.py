"""OLMo-core's own MoE model as the oracle (run in .venv-oracle, never imported by the
product): `python model_oracle.py SPEC.json OUT_DIR`.

For each case of SPEC ({"cases": [{name, d_model, ...}], ...}) it builds a small
`OLMoDDPModel` (OLMo-core's fused MoE-v2 model, `OLMoDDPModelConfig(name=moe_fused_v2)`)
with OLMo-core's own init, then
  - the eval-mode logits of SPEC's tokens,
  - in train mode: the LM loss (`model(..., labels=get_labels(...))`: OLMo-core's labels,
    cross-entropy and denominator) plus the routers' LB and z losses OLMo-core attaches to
    the activations (their weighted sum from its router metrics), backward, the gradients,
    and one `torch.optim.AdamW` step,
  - the weights before and after the step and the gradients, all renamed to Hugging Face
    `olmo3moe` keys by OLMo-core's own `convert_olmo3moe_state_to_hf`;
  - optionally (`export`) the Hugging Face export itself: `config.json` from OLMo-core's
    `_get_olmo3moe_config` and `model.safetensors` from `convert_olmo3moe_state_to_hf`.
Writes OUT_DIR/<name>.npz (and OUT_DIR/<name>-hf/ for exports).

Its fused MoE block has no CPU path: only its CUDA-only primitives are replaced here, with
plain-torch equivalents (`install_cpu_primitives`): CUDA streams and events (no-ops), the
device-to-host copy of the split sizes, Transformer Engine's permute/unpermute (a sort of
the (token, k) assignments by expert, and the probability-weighted sum back) and
grouped_gemm's grouped matmul (one matmul per expert's rows). Its routing, experts, norms,
attention, losses and initialization run unchanged.

A second entry, `python model_oracle.py --router SPEC.json OUT.npz`, runs OLMo-core's
`MoERouterV2` alone on given inputs and weights for every case (gating, routing mode,
normalization, granularity) and writes its weights, indices, LB and z losses and the
router weight's gradient.
"""

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import torch


def install_cpu_primitives() -> None:
    import olmo_core.nn.ddp.block as ddp_block
    import olmo_core.nn.moe.v2.no_ep as no_ep
    import olmo_core.nn.moe.v2.routed_experts as routed

    class _Event:
        def synchronize(self):
            pass

    def async_copy_to_cpu(buf, event=None, return_event=True):
        return buf.cpu(), None, _Event()

    def permute(inp, routing_map, num_out_tokens, map_type="index", **_):
        assert map_type == "index"
        k = routing_map.shape[1]
        order = torch.sort(routing_map.reshape(-1).long(), stable=True).indices
        return inp[order // k], order

    def unpermute(inp, row_id_map, restore_shape, map_type="index", merging_probs=None, **_):
        assert map_type == "index"
        n, k = merging_probs.shape
        rows = torch.empty_like(inp)
        rows[row_id_map] = inp  # back to (token, k) order
        rows = rows.view(n, k, -1) * merging_probs.unsqueeze(-1).to(inp.dtype)
        return rows.sum(dim=1).view(restore_shape)

    def gmm(a, b, batch_sizes, trans_b=False, out=None, input_grad_out=None, **_):
        outs, start = [], 0
        for e, n in enumerate(batch_sizes.tolist()):
            w = b[e].t() if trans_b else b[e]
            outs.append(a[start:start + n] @ w)
            start += n
        return torch.cat(outs, dim=0)

    no_ep.async_copy_to_cpu = async_copy_to_cpu
    no_ep.wait_stream_no_compile = lambda *a, **k: None
    no_ep.requires_host_side_split_sizes = lambda: True
    routed.requires_host_side_split_sizes = lambda: True
    no_ep.moe_permute_no_compile = permute
    no_ep.moe_unpermute_no_compile = unpermute
    routed.gmm = gmm
    ddp_block.OLMoDDPTransformerBlock.get_dense_stream = lambda self, for_x1=False: None
    torch.cuda.current_stream = lambda *a, **k: None
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def router_config(c: dict, d_model: int):
    from olmo_core.nn.moe.loss import MoELoadBalancingLossGranularity
    from olmo_core.nn.moe.router import MoERouterGatingFunction
    from olmo_core.nn.moe.v2.router import MoERouterConfigV2

    return MoERouterConfigV2(
        d_model=d_model, num_experts=c["num_experts"], top_k=c["top_k"],
        gating_function=MoERouterGatingFunction(c.get("gating", "softmax")),
        normalize_expert_weights=c.get("normalize_expert_weights"),
        restore_weight_scale=c.get("restore_weight_scale", False),
        random_expert_assignment=c.get("random", False),
        uniform_expert_assignment=c.get("uniform", False),
        n_group=c.get("n_group"), topk_group=c.get("topk_group"),
        lb_loss_weight=c.get("lb_weight"), z_loss_weight=c.get("z_weight"),
        lb_loss_granularity=MoELoadBalancingLossGranularity(c.get("granularity", "local_batch")),
        dtype=None,
    )


def model_config(c: dict):
    from olmo_core.config import DType
    from olmo_core.nn.attention import AttentionConfig
    from olmo_core.nn.ddp.block import OLMoDDPTransformerBlockConfig
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
    from olmo_core.nn.lm_head import LMHeadConfig
    from olmo_core.nn.moe.v2.routed_experts import RoutedExpertsConfig
    from olmo_core.nn.moe.v2.shared_experts import SharedExpertsConfig
    from olmo_core.nn.rope import RoPEConfig
    from olmo_core.nn.transformer.config import (
        OLMoDDPModelConfig,
        TransformerBlockType,
        TransformerType,
    )

    D = c["d_model"]
    norm = LayerNormConfig(name=LayerNormType.rms, eps=c["eps"], bias=False)
    window = c.get("window")  # (pattern, first, last): SlidingWindowAttentionConfig
    sliding = None
    if window:
        from olmo_core.nn.attention import SlidingWindowAttentionConfig

        sliding = SlidingWindowAttentionConfig(
            pattern=list(window[0]), force_full_attention_on_first_layer=window[1],
            force_full_attention_on_last_layer=window[2])
    attention = AttentionConfig(
        n_heads=c["n_heads"], n_kv_heads=c["n_kv_heads"], bias=False,
        rope=RoPEConfig(theta=c["rope_theta"]), qk_norm=norm,
        use_head_qk_norm=c["head_qk_norm"], sliding_window=sliding)
    layout = dict(use_pre_norm=c["block_norm"] == "pre", use_peri_norm=c["block_norm"] == "peri")
    shared = (SharedExpertsConfig(d_model=D, hidden_size=c["shared_hidden"], num_experts=1,
                                  bias=False, dtype=DType.float32)
              if c.get("shared_hidden") else None)
    moe_block = OLMoDDPTransformerBlockConfig(
        name=TransformerBlockType.moe_fused_v2, sequence_mixer=attention, layer_norm=norm,
        routed_experts=RoutedExpertsConfig(d_model=D, hidden_size=c["expert_hidden"],
                                           num_experts=c["num_experts"], bias=False,
                                           dtype=DType.float32),
        routed_experts_router=router_config(c, D), shared_experts=shared, **layout)
    dense_block = OLMoDDPTransformerBlockConfig(
        name=TransformerBlockType.moe_fused_v2, sequence_mixer=attention, layer_norm=norm,
        shared_experts=SharedExpertsConfig(d_model=D, hidden_size=c["dense_hidden"],
                                           num_experts=1, bias=False, dtype=DType.float32),
        **layout)
    config = OLMoDDPModelConfig(
        name=TransformerType.moe_fused_v2, d_model=D, vocab_size=c["vocab_size"],
        n_layers=c["n_layers"], block=moe_block,
        block_overrides={i: dense_block for i in range(c["n_dense_layers"])} or None,
        lm_head=LMHeadConfig(layer_norm=norm, bias=False), init_std=c["init_std"],
        init_seed=c["seed"], embedding_norm=norm if c["embedding_norm"] else None,
        embed_scale=c["embed_scale"] or None)
    if c.get("yarn"):  # OLMo 3's long-context RoPE: YaRN on the full-attention layers only
        from olmo_core.nn.rope import YaRNRoPEScalingConfig

        y = c["yarn"]
        config = config.with_rope_scaling(
            YaRNRoPEScalingConfig(factor=y["factor"], beta_fast=y["beta_fast"],
                                  beta_slow=y["beta_slow"], old_context_len=y["old_context_len"]),
            full_attn_layers_only=y["full_only"])
    return config


def hf_config(model, c: dict):
    """The model's olmo3moe config. Without dense layers: OLMo-core's own builder
    (`_get_olmo3moe_config`; for pre / peri, which it refuses, with the layout flags
    lifted while it runs and `use_peri_ln` set after, the field its state converter reads).
    For the parity cases (dense layers, which that builder does not take as OLMoDDPModel's
    shared-only blocks; QK-norm over the whole projection, which it refuses) the same
    fields set here, `dense_layers_use_shared_expert` on: only its state converter's
    renaming is used then."""
    from olmo_core.nn.hf.config import Olmo3MoeConfig, _get_olmo3moe_config

    if c["n_dense_layers"] or not c["head_qk_norm"] or not c.get("export"):
        return Olmo3MoeConfig(
            vocab_size=c["vocab_size"], hidden_size=c["d_model"],
            attention_hidden_size=c["d_model"], head_dim=c["d_model"] // c["n_heads"],
            dense_mlp_intermediate_size=c["dense_hidden"],
            moe_intermediate_size=c["expert_hidden"],
            shared_expert_intermediate_size=c.get("shared_hidden") or None,
            n_routed_experts=c["num_experts"], num_experts_per_tok=c["top_k"],
            num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
            num_key_value_heads=c["n_kv_heads"], gating_function=c.get("gating", "softmax"),
            normalize_expert_weights=c.get("normalize_expert_weights"),
            restore_weight_scale=c.get("restore_weight_scale", False),
            rope_theta=c["rope_theta"], rms_norm_eps=c["eps"],
            use_head_qk_norm=c["head_qk_norm"], layer_types=["full_attention"] * c["n_layers"],
            dense_layers_indices=list(range(c["n_dense_layers"])),
            dense_layers_use_shared_expert=True, embed_scale=c["embed_scale"] or 1.0,
            embed_norm=c["embedding_norm"], use_peri_ln=c["block_norm"] == "peri",
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
    blocks = list(model.blocks.values())
    saved = [(b.use_peri_norm, b.use_pre_norm) for b in blocks]
    for b in blocks:  # the builder inspects the layout flags only to refuse peri
        b.use_peri_norm = b.use_pre_norm = False
    try:
        config = _get_olmo3moe_config(model)
    finally:
        for b, (peri, pre) in zip(blocks, saved, strict=True):
            b.use_peri_norm, b.use_pre_norm = peri, pre
    config.use_peri_ln = c["block_norm"] == "peri"
    return config


def to_hf(config, state: dict) -> dict:
    from olmo_core.nn.hf.convert import convert_olmo3moe_state_to_hf

    return {k: v.detach().float().numpy().copy()
            for k, v in convert_olmo3moe_state_to_hf(config, dict(state)).items()}


def run_case(c: dict, out_dir: Path) -> None:
    torch.manual_seed(c["seed"])
    model = model_config(c).build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"), max_seq_len=c["seq_len"])
    # init_weights casts the whole model to bfloat16 (its training dtype); the comparison
    # is in float32, so the same (bfloat16-valued) weights go back to float32.
    model.to(torch.float32)
    tokens = torch.tensor(np.asarray(c["tokens"]), dtype=torch.long)
    config = hf_config(model, c)
    before = to_hf(config, model.state_dict())

    model.eval()
    with torch.no_grad():
        logits = model(tokens).float().numpy()

    model.train()
    from olmo_core.data.utils import get_labels

    labels = get_labels({"input_ids": tokens})  # shifted; the last label ignored
    out = model(tokens, labels=labels, loss_reduction="mean")  # aux losses attach themselves
    ce = out.ce_loss.detach()
    out.loss.backward()
    # Its reported loss is the LM loss; the routers' losses act through the gradients
    # (attach_auxiliary_loss) and are kept as metrics: the total it optimizes is their sum.
    routers = [b.routed_experts_router for b in model.blocks.values()
               if b.routed_experts_router is not None]
    aux = sum(c["lb_weight"] * float(r.load_balancing_loss) + c["z_weight"] * float(r.z_loss)
              for r in routers)
    loss = float(out.loss.detach()) + aux
    grads = to_hf(config, {k: p.grad if p.grad is not None else torch.zeros_like(p)
                           for k, p in model.named_parameters()})
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=(c["b1"], c["b2"]),
                            eps=c["adam_eps"], weight_decay=c["weight_decay"])
    opt.step()
    after = to_hf(config, model.state_dict())
    np.savez(out_dir / f"{c['name']}.npz", logits=logits, ce=float(ce), loss=float(loss),
             **{f"before/{k}": v for k, v in before.items()},
             **{f"grad/{k}": v for k, v in grads.items()},
             **{f"after/{k}": v for k, v in after.items()})
    if c.get("export"):
        from safetensors.torch import save_file

        hf_dir = out_dir / f"{c['name']}-hf"
        hf_dir.mkdir(exist_ok=True)
        config.save_pretrained(hf_dir)
        save_file({k: torch.from_numpy(v).contiguous() for k, v in before.items()},
                  str(hf_dir / "model.safetensors"))


def run_routers(spec: dict, out_path: str) -> None:
    results = {}
    for c in spec["cases"]:
        x = torch.tensor(np.asarray(c["x"], np.float32)).requires_grad_(False)
        router = router_config(c, x.shape[-1]).build()
        with torch.no_grad():
            router.weight.copy_(torch.tensor(np.asarray(c["weight_ED"], np.float32)).reshape(-1))
        router.train()
        torch.manual_seed(c.get("seed", 0))
        weights, idx, counts, info = router(x, False)
        aux = router.compute_aux_loss(*info)
        (weights * torch.tensor(np.asarray(c["probe"], np.float32))).sum().add(
            aux if aux is not None else 0.0).backward()
        name = c["name"]
        results[f"{name}/weights"] = weights.detach().numpy()
        results[f"{name}/idx"] = idx.numpy()
        results[f"{name}/scores"] = info[0].detach().numpy()
        results[f"{name}/lb"] = float(router.load_balancing_loss) if c.get("lb_weight") else 0.0
        results[f"{name}/z"] = float(router.z_loss) if c.get("z_weight") else 0.0
        results[f"{name}/grad_ED"] = router.weight.grad.view(router.num_experts, -1).numpy()
    np.savez(out_path, **results)


def main(argv: list[str]) -> None:
    torch.set_default_dtype(torch.float32)
    if argv[0] == "--router":
        run_routers(json.loads(Path(argv[1]).read_text()), argv[2])
        return
    install_cpu_primitives()
    spec = json.loads(Path(argv[0]).read_text())
    out_dir = Path(argv[1])
    for c in spec["cases"]:
        run_case(c, out_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
