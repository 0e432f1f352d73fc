"""transformers' greedy `generate` for the generation parity test. Runs in .venv-oracle
(torch + transformers), never imported by olmo_jax or pytest; inputs and outputs are files.

    python generate_oracle.py SPEC.json OUT.json
SPEC: {"dirs": {name: HF folder}, "prompts": [[ids], ...], "n_new": N}. Each prompt is
generated alone (no padding): OUT {name: [[N new ids] per prompt]}, float32, eager
attention and experts, no stop token.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import OlmoeForCausalLM

if __name__ == "__main__":
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = {}
    for name, folder in spec["dirs"].items():
        model = OlmoeForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="eager",
                                                 experts_implementation="eager").eval()
        rows = []
        for prompt in spec["prompts"]:
            ids = torch.tensor([prompt], dtype=torch.long)
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=spec["n_new"], min_new_tokens=spec["n_new"],
                                     pad_token_id=0, eos_token_id=None)
            rows.append(gen[0, len(prompt):].tolist())
        out[name] = rows
    Path(sys.argv[2]).write_text(json.dumps(out))
