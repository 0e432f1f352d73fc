"""Downstream evals without the oracle (fast tier): bad input refused before any compute,
the scorer's length buckets against a plain per-request numpy reference, ICLMetric's
rules that the parity tasks do not reach (a document with a gap in its continuation ids
is skipped; bpb tasks report bpb only), MMLU's and two classic tasks' prompt forms
written out, and the arrow reader (shard order, its errors)."""

import json

import numpy as np
import pytest

from olmo_jax.errors import ConfigError, DataError
from olmo_jax.evals import arrow, classic, metric, mmlu, score, tasks
from olmo_jax.evals.suite import Suite

SPECIAL = {"pad_token_id": 1, "eos_token_id": 50279}


@pytest.fixture(scope="module")
def tok():
    return tasks.Tokenizer(str(tasks.data_root() / "tokenizers" / "allenai_gpt-neox-olmo-dolma-v1_5.json"), **SPECIAL)


def test_bad_input_is_refused_before_compute(tok):
    with pytest.raises(ConfigError, match=r"unsupported task\(s\) \['mrpc_f1'\].*arc_easy_rc_5shot.*mmlu_stem_val_rc"):
        Suite(["arc_easy_rc_5shot", "mrpc_f1"], tok, 1024, 50304)
    with pytest.raises(ConfigError, match=r"--tasks: unsupported task\(s\) \['mmlu_x_bpb', 'nope'\] \("
                       r"mmlu_x_bpb: not an olmo_eval 0.9.0 label; nope: not an olmo_eval 0.9.0 label\)"):
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
    # f1 (MRPC), class 0 positive: tp = fp = fn = 1; no positive label or no positive prediction: 0.0
    assert metric.f1_score([0, 0, 1, 1], [0, 1, 0, 1]) == 0.5
    assert metric.f1_score([1, 1], [0, 1]) == metric.f1_score([0, 1], [1, 1]) == metric.f1_score([], []) == 0.0
    f1 = metric.compute("f1", metric.records("f1", samples, [-3.0, -1.0, -2.0, -9.0]))
    assert f1 == {"f1_v1": 0.0, "f1_v2": 0.0}  # doc 0: gold 1 (not positive), chosen 1


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


def test_mmlu_prompts():
    """MMLU's prompt forms (olmo_eval's MMLU.doc_to_text / doc_to_continuations), written out:
    the plain question, the instruction with k answered dev examples, the letter form."""
    doc = {"question": " 2+2? ", "subject": "high_school_mathematics", "choices": ["3", "4", "5", "6"], "answer": 1}
    dev = [{"question": "1+1?", "subject": "high_school_mathematics", "choices": ["2", "1", "0", "3"], "answer": 0},
           {"question": "0+1?", "subject": "high_school_mathematics", "choices": ["2", "1", "0", "3"], "answer": 1}]
    assert mmlu.doc_to_text(doc, None, False, dev) == "Question: 2+2?\nAnswer:"
    inst = "The following are multiple choice questions (with answers) about high school mathematics:\n\n"
    assert mmlu.doc_to_text(doc, "inst", False, dev) == inst + "Question: 2+2?\nAnswer:"
    assert mmlu.doc_to_text(doc, "inst+5", False, dev) == (
        inst + "Question: 1+1?\nAnswer: 2\n\nQuestion: 0+1?\nAnswer: 1\n\nQuestion: 2+2?\nAnswer:")
    letters = "A. 2\nB. 1\nC. 0\nD. 3\n"
    assert mmlu.doc_to_text(doc, "inst+1", True, dev) == (
        inst + "1+1?\n" + letters + "Answer: A\n\n2+2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:")
    assert mmlu.doc_to_continuations(doc, False, False) == [" 3", " 4", " 5", " 6"]
    assert mmlu.doc_to_continuations(doc, True, False) == [" A", " B", " C", " D"]
    assert mmlu.doc_to_continuations(doc, True, True) == [" B"]
    assert mmlu.subjects("stem")[:4] == ["astronomy", "college_physics", "conceptual_physics", "high_school_physics"]
    reqs = mmlu.requests(mmlu.LABELS["mmlu_stem_var_bpb"], tasks.data_root() / "hf_datasets", max_docs=8)
    assert [(r["doc_id"], r["cont_id"], r["label_id"]) for r in reqs] == [(i, 0, 0) for i in range(8)]
    assert reqs[0]["context"].startswith("Question: ") and reqs[1]["context"].startswith(inst[:40])


def test_classic_prompts():
    """Two of olmo_eval's original tasks written out: HellaSwag's cleaning and domain
    conditional, WinoGrande's one context per option and the shared continuation."""
    doc = {"activity_label": "Roof", "ctx_a": "A man [header] sits.", "ctx_b": "", "label": "1",
           "endings": [" is up [title] there", "falls"]}
    items, label = classic.LABELS["hellaswag"].build(doc)
    assert (items, label) == ([("Roof: A man sits.", " is up. there", "sits."), ("Roof: A man sits.", " falls",
                                                                                   "sits.")], 1)
    doc = {"sentence": "Ann met _ at noon.", "option1": "Bo", "option2": "Cy", "answer": "2"}
    assert classic.LABELS["winogrande"].build(doc) == ([("Ann met Bo", " at noon.", "Bo"),
                                                        ("Ann met Cy", " at noon.", "Cy")], 1)


def test_arrow_reader(tmp_path, monkeypatch):
    """A saved dataset's shards are read in state.json's order (as datasets.load_from_disk
    concatenates them); a folder that is not one, and a missing pyarrow, are named."""
    import pyarrow as pa

    shards = [[{"q": "a", "choices": ["x"], "answer": 0}], [{"q": "b", "choices": ["y", "z"], "answer": 1}]]
    for i, rows in reversed(list(enumerate(shards))):
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(str(tmp_path / f"data-{i:05d}-of-00002.arrow"), table.schema) as w:
            w.write_table(table)
    (tmp_path / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": f"data-{i:05d}-of-00002.arrow"} for i in range(2)], "_split": "x"}))
    assert arrow.read_rows(tmp_path) == shards[0] + shards[1]
    with pytest.raises(DataError, match="not a saved Hugging Face dataset"):
        arrow.read_rows(tmp_path / "nowhere")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(DataError, match=r"need the pyarrow package.*pip install 'olmo-jax\[eval\]'"):
        arrow.read_rows(tmp_path)
