"""trainer.downstream_evals in a real run on 8 fake devices (data 2 x expert 4): the
records of the last step (every sink's `downstream/<label>/<metric>` and
`downstream/<label>/seconds`) and the summary equal a one-device evaluation of the saved
weights, and so does `python -m olmo_jax.evaluate --ckpt RUN_DIR` on pipe 2 x data 2 x
expert 2 with no tokenizer, id or context flags (the run's recorded tokenizer and
trainer.seq_len); a bad label is refused by the config."""

import json

import numpy as np
import pytest

from olmo_jax import config as config_lib
from olmo_jax import evaluate
from olmo_jax.checkpoint import hf
from olmo_jax.data.token_file import write_token_file
from olmo_jax.errors import ConfigError
from olmo_jax.evals import score, tasks
from olmo_jax.evals.suite import Suite
from olmo_jax.trainer.loop import train
from tests.run_config import run_config

LABELS = ("arc_challenge_mc_5shot", "hellaswag_bpb_5shot")
SEQ, DOCS = 128, 2


def test_in_loop_downstream_equals_one_device(tmp_path):
    tok_path = tasks.data_root() / "tokenizers" / "allenai_gpt-neox-olmo-dolma-v1_5.json"
    rng = np.random.default_rng(0)
    write_token_file(tmp_path / "tokens.npy", rng.integers(0, 50000, 40 * (SEQ + 1)), np.uint16)
    cfg = run_config(tmp_path / "run", max_steps=2, seq_len=SEQ, downstream_evals=",".join(LABELS),
                     downstream_max_docs=DOCS, downstream_batch_size=8)
    cfg.parallel.data, cfg.parallel.expert = 2, 4
    cfg.model.n_layers = 2  # a MoE block per stage for the pipeline's evaluation below
    cfg.model.moe.capacity_factor = 4.0  # >= experts / top_k: rowwise dispatch drops nothing, like one device
    cfg.data.paths, cfg.data.tokenizer = str(tmp_path / "tokens.npy"), str(tok_path)
    summary = train(config_lib.validate(cfg))
    last = [json.loads(line) for line in open(summary.metrics_path)][-1]
    got = {k: v for k, v in last.items() if k.startswith("downstream/")}
    assert {k for k in got if k.endswith("/seconds")} == {f"downstream/{x}/seconds" for x in LABELS}
    assert summary.final_downstream == got

    model = hf.load_checkpoint(tmp_path / "run")
    from olmo_jax.data import load_tokenizer

    data_tok = load_tokenizer(str(tok_path))
    tok = tasks.Tokenizer(str(tok_path), pad_token_id=data_tok.pad_id, eos_token_id=data_tok.eos_id)
    suite = Suite(LABELS, tok, SEQ, model.config.vocab_size, limit_docs=DOCS)
    apply = lambda params, ids: model._forward(params, model.model_state, ids)  # noqa: E731
    want, _ = suite.evaluate(score.Scorer(score.single_device_run(apply, model.params), 8, data_tok.pad_id))
    for label, metrics in want.items():
        for k, v in metrics.items():
            assert abs(got[f"downstream/{label}/{k}"] - v) <= 1e-5, (label, k, got[f"downstream/{label}/{k}"], v)

    out = tmp_path / "evals.json"
    assert evaluate.main(["--ckpt", str(tmp_path / "run"), "--tasks", ",".join(LABELS), "--limit-docs", str(DOCS),
                          "--json", str(out), "--pipe", "2", "--data", "2", "--expert", "2",
                          "--microbatches", "2"]) == 0
    cli = json.loads(out.read_text())
    assert cli["tokenizer"] == str(tok_path) and cli["ctx"] == SEQ
    for label, metrics in want.items():
        assert cli["results"][label].keys() == metrics.keys()
        for k, v in metrics.items():
            assert abs(cli["results"][label][k] - v) <= 1e-5, (label, k, cli["results"][label][k], v)


def test_unknown_label_is_refused_by_the_config(tmp_path):
    cfg = run_config(tmp_path / "run", downstream_evals="arc_easy_rc_5shot, mrpc_f1")
    with pytest.raises(ConfigError, match=r"unsupported task\(s\) \['mrpc_f1'\] \(mrpc_f1: not an olmo_eval"):
        config_lib.validate(cfg)
    config_lib.validate(run_config(tmp_path / "ok", downstream_evals="mmlu_stem_val_rc_5shot,piqa,mrpc"))
