"""Runs in .venv-oracle (torch + transformers): trains a Hugging Face OlmoeForCausalLM of a
given shape with AdamW and reports per-step wall times, on command, so the benchmark can
interleave it with the JAX side in one run.

Protocol (JSON lines): the first stdin line is the shape; then each "steps N" line runs N
training steps and answers {"times": [...], "loss": x}; "quit" ends."""

import json
import sys
import time

import torch
import transformers


def main() -> None:
    shape = json.loads(sys.stdin.readline())
    torch.manual_seed(0)
    cfg = transformers.OlmoeConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["d_model"],
        intermediate_size=shape["expert_hidden"], num_hidden_layers=shape["n_layers"],
        num_attention_heads=shape["n_heads"], num_key_value_heads=shape["n_heads"],
        num_experts=shape["num_experts"], num_experts_per_tok=shape["top_k"],
        max_position_embeddings=shape["seq_len"], pad_token_id=None, eos_token_id=None,
        bos_token_id=None, router_aux_loss_coef=0.01, output_router_logits=True,
    )
    model = transformers.OlmoeForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq_len"]), generator=gen)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads(),
                      "attn": model.config._attn_implementation}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        times, loss = [], float("nan")
        for _ in range(int(cmd[1])):
            t = time.perf_counter()
            out = model(input_ids=batch, labels=batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
            loss = float(out.loss.detach())
        print(json.dumps({"times": times, "loss": loss}), flush=True)


if __name__ == "__main__":
    main()
