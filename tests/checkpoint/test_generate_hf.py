"""Greedy generation with the KV cache (olmo_jax/model/decode.py) equals transformers'
`generate` token for token: 32 new tokens from prompts of different lengths decoded as
one left-padded batch, on the tiny random OlmoeForCausalLM checkpoints of the parity
cases (tests/checkpoint/conftest.py): multi-head, and grouped-query heads with top-k
renormalization and active QKV clipping. transformers generates each prompt alone."""

import json
import subprocess

import numpy as np
import pytest

from olmo_jax import generate as generate_cli
from olmo_jax.checkpoint import hf
from olmo_jax.data.tokenizer import ByteTokenizer
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
        assert gen.tokens_BT[b].tolist() == theirs, (case, b)


def test_generate_command_on_orbax_and_hf_folders_of_the_same_weights(hf_cases, tmp_path, capsys):
    """`python -m olmo_jax.generate` (its main) reads an orbax checkpoint and its Hugging Face
    export alike, and writes the tokens decode.generate gives."""
    outs = {}
    for kind in ("orbax", "hf"):
        out = tmp_path / f"{kind}.json"
        argv = ["--model", str(hf_cases / "jax_born" / kind), "--tokenizer", "bytes",
                "--prompt", "def f(x):", "--prompt", "ab", "--max-new-tokens", "5",
                "--no-stop", "--json", str(out)]
        assert generate_cli.main(argv) == 0
        outs[kind] = json.loads(out.read_text())
    assert outs["orbax"]["token_ids"] == outs["hf"]["token_ids"]
    model = hf.load_model(hf_cases / "jax_born" / "hf")
    tok = ByteTokenizer()
    gen = decode.generate(model.config, model.params, model.model_state,
                          [tok.encode("def f(x):").tolist(), tok.encode("ab").tolist()], 5)
    assert outs["hf"]["token_ids"] == gen.tokens_BT.tolist()
    assert "tokens/s" in capsys.readouterr().out


def test_generate_command_refuses_a_tokenizer_larger_than_the_vocabulary(hf_cases, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(BASE["vocab_size"] + 16)}
    vocab["<|endoftext|>"] = len(vocab)
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    argv = ["--model", str(hf_cases / "base" / "hf"), "--tokenizer", str(tmp_path),
            "--prompt", "w1"]
    assert generate_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "the tokenizer has 401 tokens but the model's vocabulary is 384" in err
    assert generate_cli.main(["--model", str(hf_cases / "base" / "hf"), "--prompt", "x"]) == 2
    assert "no tokenizer.json in" in capsys.readouterr().err
