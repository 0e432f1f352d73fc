"""Greedy generation with the KV cache (olmo_jax/model/decode.py) equals transformers'
`generate` token for token: 32 new tokens from prompts of different lengths decoded as
one left-padded batch, on the tiny random OlmoeForCausalLM checkpoints of the parity
cases (tests/checkpoint/conftest.py): multi-head, and grouped-query heads with top-k
renormalization and active QKV clipping. transformers generates each prompt alone."""

import json
import subprocess

import numpy as np
import pytest

from olmo_jax.checkpoint import hf
from olmo_jax.model import decode
from tests.checkpoint.oracle import BASE, ORACLE_PY, ROOT

N_NEW = 32
PROMPTS = [np.random.default_rng(7 + i).integers(0, BASE["vocab_size"], n).tolist()
           for i, n in enumerate((3, 11, 7, 1))]
GEN_CASES = ("base", "loss")


@pytest.fixture(scope="module")
def hf_generated(hf_cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_generate")
    spec = {"dirs": {c: str(hf_cases / c / "hf") for c in GEN_CASES}, "prompts": PROMPTS,
            "n_new": N_NEW}
    (out / "spec.json").write_text(json.dumps(spec))
    res = subprocess.run([str(ORACLE_PY), str(ROOT / "tests/checkpoint/generate_oracle.py"),
                          str(out / "spec.json"), str(out / "out.json")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return json.loads((out / "out.json").read_text())


@pytest.mark.parametrize("case", GEN_CASES)
def test_greedy_decode_equals_transformers_generate(hf_cases, hf_generated, case):
    model = hf.load_model(hf_cases / case / "hf")
    gen = decode.generate(model.config, model.params, model.model_state, PROMPTS, N_NEW)
    assert list(gen.lengths_B) == [N_NEW] * len(PROMPTS)
    for b, theirs in enumerate(hf_generated[case]):
        assert len(theirs) == N_NEW
        assert gen.tokens_BN[b].tolist() == theirs, (case, b)
