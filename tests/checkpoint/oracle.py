"""The Hugging Face oracle as the tests call it (a subprocess in .venv-oracle running
hf_oracle.py, inputs and outputs as files), the parity cases, and random olmo_jax
models of the same architectures."""

import json
import subprocess
from pathlib import Path

import numpy as np

from olmo_jax.checkpoint import hf
from olmo_jax.checkpoint.hf_config import from_hf_config
from olmo_jax.checkpoint.tree import flatten_named, nest
from olmo_jax.model.abstract import abstract_model

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
ORACLE_SCRIPT = Path(__file__).with_name("hf_oracle.py")

BASE = dict(
    vocab_size=384,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_experts=6,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    initializer_range=0.1,
    pad_token_id=None,
    eos_token_id=None,
    bos_token_id=None,
)
# name -> (config overrides, seed, extra). The base case has rope_theta 10000 (HF's default),
# which differs from olmo_jax's default, so it checks the theta mapping too.
CASES = {
    "base": ({}, 0, {}),
    "packed": ({}, 0, {"packed": True}),  # the base model, experts stored as gate_up_proj
    "gqa": ({"num_key_value_heads": 2}, 1, {}),
    "norm_topk": ({"norm_topk_prob": True}, 2, {}),
    "tied": ({"tie_word_embeddings": True}, 3, {}),
    "rope_theta_eps": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}, "rms_norm_eps": 1e-3},
        4,
        {},
    ),
    "clip_qkv": ({"clip_qkv": 0.3}, 5, {}),
    # YaRN RoPE scaling past its original 8 positions (16 are run): the ramp, the blended
    # frequencies and the attention factor on the cos / sin tables, as transformers has them.
    "yarn": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "original_max_position_embeddings": 8}},
        7,
        {},
    ),
    # The loss / gradient case combines GQA, top-k renormalization and clipping.
    "loss": (
        {
            "num_key_value_heads": 2,
            "norm_topk_prob": True,
            "clip_qkv": 0.5,
            "router_aux_loss_coef": 0.02,
        },
        6,
        {},
    ),
}
# olmo_jax-initialized models exported with orbax-to-hf and loaded by transformers:
# name -> the case whose architecture they share.
JAX_BORN = {"jax_born": "loss", "jax_born_tied": "tied"}
LOSS_CASE = "loss"
INPUT_IDS = np.random.default_rng(0).integers(0, BASE["vocab_size"], (2, 16)).tolist()
LOSS_BATCH = np.random.default_rng(1).integers(0, BASE["vocab_size"], (4, 17)).tolist()


def run_oracle(spec: dict, out: Path) -> None:
    """One launch of hf_oracle.py in .venv-oracle (several seconds: torch + transformers)."""
    if not ORACLE_PY.exists():
        raise RuntimeError(
            f"{ORACLE_PY} is missing: run `make oracle` (the transformers test oracle)"
        )
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    res = subprocess.run(
        [str(ORACLE_PY), str(ORACLE_SCRIPT), str(spec_path), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


def case_config(case: str):
    """The olmo_jax config of a case (as converting its config.json gives)."""
    return from_hf_config({**BASE, **CASES[case][0], "model_type": "olmoe"})


def jax_born_model(case: str, seed: int) -> hf.HFModel:
    """Random olmo_jax parameters (std 0.1, norm weights 1 + 0.2 N(0, 1)) for the
    architecture of `case`."""
    cfg = case_config(case)
    rng = np.random.default_rng(seed)
    params = {
        name: (
            1.0 + 0.2 * rng.standard_normal(x.shape)
            if name.endswith("norm/weight")
            else 0.1 * rng.standard_normal(x.shape)
        ).astype(np.float32)
        for name, x in flatten_named(abstract_model(cfg)[1]).items()
    }
    return hf.HFModel.from_params(cfg, nest(params))
