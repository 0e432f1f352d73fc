"""OLMo-core's and Hugging Face's RoPE scaling as the oracle (run in .venv-oracle):
`python rope_oracle.py IN.json OUT.npz OUT.json`. IN: {"T": positions, "cases": [{"name",
"head_dim", "theta", "kind" (abf | pi | stepwise | yarn), "olmo_core": the scaling config's
fields, "hf": a Hugging Face OLMoE config.json}]}. OUT.npz, per case: OLMo-core's inverse
frequencies and factor (`compute_scaled_inv_freq`) and its `RotaryEmbedding` sin / cos
tables for positions 0..T-1; and Hugging Face's (`OlmoeRotaryEmbedding` of the given
config.json) inverse frequencies and attention scaling. OUT.json: each case's
`to_hf_config()` (the rope_scaling OLMo-core's export writes; none for ABF)."""

import json
import sys

import numpy as np
import torch
from olmo_core.nn import rope
from transformers import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeRotaryEmbedding

KINDS = {"abf": rope.ABFRoPEScalingConfig, "pi": rope.PIRoPEScalingConfig,
         "stepwise": rope.StepwiseRoPEScalingConfig, "yarn": rope.YaRNRoPEScalingConfig}


def main(in_path: str, npz_path: str, json_path: str) -> None:
    given = json.loads(open(in_path).read())
    cpu, arrays, exported = torch.device("cpu"), {}, {}
    for case in given["cases"]:
        name, scaling = case["name"], KINDS[case["kind"]](**case["olmo_core"])
        inv, factor = scaling.compute_scaled_inv_freq(case["theta"], case["head_dim"], cpu)
        emb = rope.RotaryEmbedding(head_size=case["head_dim"], theta=case["theta"], scaling=scaling)
        sin, cos = emb._get_rotary_embedding(given["T"], cpu)
        hf = OlmoeRotaryEmbedding(OlmoeConfig(**case["hf"]))
        arrays.update({f"{name}/inv": inv.numpy(), f"{name}/factor": np.float64(factor),
                       f"{name}/sin": sin.numpy(), f"{name}/cos": cos.numpy(),
                       f"{name}/hf_inv": hf.inv_freq.numpy(),
                       f"{name}/hf_factor": np.float64(hf.attention_scaling)})
        exported[name] = None if case["kind"] == "abf" else scaling.to_hf_config()
    np.savez(npz_path, **arrays)
    open(json_path, "w").write(json.dumps(exported))


if __name__ == "__main__":
    main(*sys.argv[1:])
