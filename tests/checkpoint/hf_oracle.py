"""The Hugging Face side of the parity tests. Runs in .venv-oracle (torch + transformers),
never imported by olmo_jax or pytest; inputs and outputs are files.

    python hf_oracle.py SPEC.json OUT
Builds a tiny random OlmoeForCausalLM per case in SPEC["cases"]:
    OUT/<case>/hf (save_pretrained; `packed` cases rewritten with gate_up_proj),
    OUT/<case>/logits.npy (float32 [B, T, V], the model re-read from that folder),
    and for cases with a `batch`: OUT/<case>/loss.json (loss, lm_loss, aux_loss) and
    OUT/<case>/grads.safetensors (d loss / d parameter, HF names, packed experts).
Then loads each folder in SPEC["dirs"] (olmo_jax exports) with from_pretrained:
    OUT/loaded/<name>/logits.npy and OUT/loaded/<name>/info.json (missing / unexpected /
    mismatched keys and every warning transformers logged while loading).
Models: eager attention, eager experts, float32, norm weights perturbed away from 1.
"""

import json
import logging
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch
from transformers import OlmoeConfig, OlmoeForCausalLM
from transformers.utils import logging as hf_logging

EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}


def pack_experts(folder: Path, n_layers: int, n_experts: int) -> None:
    """Rewrites the per-expert tensors save_pretrained wrote as packed gate_up_proj / down_proj."""
    path = folder / "model.safetensors"
    sd = load_file(path)
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    for layer in range(n_layers):
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = np.stack(
            [
                np.concatenate([sd[p + f"{e}.gate_proj.weight"], sd[p + f"{e}.up_proj.weight"]], 0)
                for e in range(n_experts)
            ]
        )
        out[p + "down_proj"] = np.stack([sd[p + f"{e}.down_proj.weight"] for e in range(n_experts)])
    save_file(out, path, metadata={"format": "pt"})


def load(folder) -> tuple[OlmoeForCausalLM, dict, list[str]]:
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Capture(level=logging.WARNING)
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = OlmoeForCausalLM.from_pretrained(
                folder, output_loading_info=True, dtype=torch.float32, **EAGER
            )
        records += [str(w.message) for w in caught]
    finally:
        hf_logger.removeHandler(handler)
    model.eval()
    info = {k: sorted(map(str, v)) for k, v in info.items()}
    return model, info, records


def build(spec: dict, out: Path) -> None:
    ids = torch.tensor(np.asarray(spec["input_ids"], np.int64))
    for name, case in spec["cases"].items():
        cfg = OlmoeConfig(**case["config"])
        torch.manual_seed(case["seed"])
        model = OlmoeForCausalLM(cfg)
        gen = torch.Generator().manual_seed(case["seed"] + 1000)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        folder = out / name / "hf"
        model.save_pretrained(folder)
        if case.get("packed"):
            pack_experts(folder, cfg.num_hidden_layers, cfg.num_experts)
        model, info, records = load(folder)
        assert not any(info.values()), (name, info)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        np.save(out / name / "logits.npy", logits.float().numpy())
        if "batch" in case:
            loss_case(model, case, out / name)


def loss_case(model: OlmoeForCausalLM, case: dict, out: Path) -> None:
    """HF's training loss: labels (next-token CE) + output_router_logits (its aux loss)."""
    batch = torch.tensor(np.asarray(case["batch"], np.int64))
    inputs, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    res = model(input_ids=inputs, labels=targets, shift_labels=targets, output_router_logits=True)
    lm = torch.nn.functional.cross_entropy(
        res.logits.reshape(-1, res.logits.shape[-1]), targets.reshape(-1)
    )
    expected = lm + model.config.router_aux_loss_coef * res.aux_loss
    assert torch.allclose(res.loss, expected, rtol=1e-6), (res.loss, expected)
    res.loss.backward()
    grads = {n: p.grad.detach().contiguous() for n, p in model.named_parameters()}
    save_torch(grads, out / "grads.safetensors")
    (out / "loss.json").write_text(
        json.dumps(
            {
                "loss": res.loss.item(),
                "lm_loss": lm.item(),
                "aux_loss": res.aux_loss.item(),
            }
        )
    )


def load_dirs(spec: dict, out: Path) -> None:
    ids = torch.tensor(np.asarray(spec["input_ids"], np.int64))
    for name, folder in spec.get("dirs", {}).items():
        (out / name).mkdir(parents=True, exist_ok=True)
        model, info, records = load(folder)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        np.save(out / name / "logits.npy", logits.float().numpy())
        (out / name / "info.json").write_text(json.dumps({**info, "warnings": records}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    spec_path, out_dir = sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    build(spec, Path(out_dir))
    load_dirs(spec, Path(out_dir) / "loaded")
