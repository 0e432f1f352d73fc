"""The olmo_eval side of tests/evals (runs in .venv-oracle, never imported by olmo_jax or
pytest; inputs and outputs are files).

    python eval_oracle.py SPEC.json OUT
Builds each SPEC["tasks"] label with olmo_eval.build_task (its HFTokenizer on
SPEC["tokenizer"], model_ctx_len SPEC["ctx_len"]) and writes OUT/requests.json: the first
SPEC["n_requests"] samples' token ids and lengths per label; the SPEC["row_limited"] labels
see only the first SPEC["max_rows"] rows of their arrow files (olmo_eval's loader cut, so
the whole task is built quickly). Then a tiny random
OlmoeForCausalLM (SPEC["model"], seed SPEC["seed"]) is saved to OUT/hf, and the samples of
the first SPEC["n_docs"] documents (SPEC["n_docs_by_label"][label] where given) of each
SPEC["scored"] label (default: all) are scored with olmo_eval's ICLMetric on
transformers' logits (collate_fn batches, as OLMo-core's DownstreamEvaluator feeds them):
OUT/metrics.json has per label the metric dict and each scored sample's log-likelihood;
OUT/labels.json every label's task class and metric type, and OUT/mmlu.json each MMLU label's
arguments (its map kwargs). OUT/icl_cases.json: ICLMetric(metric_type).compute() on each
SPEC["icl_cases"] entry's records, (doc_id, cont_id, label_id, loglikelihood,
loglikelihood_no_leading_space, celoss, celoss_nls, bpb, bpb_nls) each, put in its state
lists as update() puts them (the f1 cases a tiny random model does not reach).
"""

import json
import sys
from pathlib import Path

import olmo_eval.tasks
import torch
from olmo_eval import HFTokenizer, ICLMetric, build_task
from olmo_eval.tasks import LABEL_TO_TASK_MAP, MMLU
from transformers import OlmoeConfig, OlmoeForCausalLM

FIELDS = ("doc_id", "cont_id", "ctx", "continuation", "ctx_len", "dc_len", "cont_len",
          "cont_str_len", "cont_byte_len", "cont_str_len_no_leading_space",
          "cont_byte_len_no_leading_space", "query", "dc_query", "label_id")


def main(spec: dict, out: Path) -> None:
    torch.set_num_threads(1)
    tok = HFTokenizer(spec["tokenizer"], **spec["special"])
    torch.manual_seed(spec["seed"])
    model = OlmoeForCausalLM(OlmoeConfig(**spec["model"]))
    model.save_pretrained(out / "hf")
    model = OlmoeForCausalLM.from_pretrained(out / "hf", dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager").eval()
    requests, metrics = {}, {}
    load = olmo_eval.tasks.load_hf_dataset
    for label in spec["tasks"]:
        if label in spec.get("row_limited", ()):
            def first_rows(*args):
                ds = load(*args)
                return ds.select(range(min(spec["max_rows"], len(ds))))
            olmo_eval.tasks.load_hf_dataset = first_rows
        try:
            task = build_task(label, tok, model_ctx_len=spec["ctx_len"])
        finally:
            olmo_eval.tasks.load_hf_dataset = load
        samples = task.samples
        requests[label] = {
            "metric_type": task.metric_type,
            "n_samples": len(samples),
            "samples": [{k: s[k] for k in FIELDS} | ({"choices": s["choices"]} if "choices" in s else {})
                        for s in samples[: spec["n_requests"]]],
        }
        if label not in spec.get("scored", spec["tasks"]):
            continue
        docs = sorted({s["doc_id"] for s in samples})[: spec.get("n_docs_by_label", {}).get(label, spec["n_docs"])]
        chosen = [s for s in samples if s["doc_id"] in set(docs)]
        metric = ICLMetric(metric_type=task.metric_type)
        for i in range(0, len(chosen), spec["batch"]):
            batch = task.collate_fn(chosen[i: i + spec["batch"]])
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"]).logits
            metric.update(batch, logits)
        metrics[label] = {
            "metric": {k: float(v) for k, v in metric.compute().items()},
            "loglikelihoods": [list(t) for t in metric.loglikelihoods],
            "n_scored": len(chosen),
            "max_sequence_length": task.max_sequence_length,
        }
    (out / "requests.json").write_text(json.dumps(requests))
    (out / "metrics.json").write_text(json.dumps(metrics))
    (out / "labels.json").write_text(json.dumps(labels()))
    (out / "icl_cases.json").write_text(json.dumps([icl_compute(c["metric_type"], c["records"])
                                                     for c in spec.get("icl_cases", ())]))
    (out / "mmlu.json").write_text(json.dumps({label: entry[1] for label, entry in LABEL_TO_TASK_MAP.items()
                                               if isinstance(entry, tuple) and entry[0] is MMLU}))


def icl_compute(metric_type: str, records: list) -> dict:
    """ICLMetric.compute() with its state lists holding `records`."""
    metric = ICLMetric(metric_type=metric_type)
    states = ("loglikelihoods", "loglikelihoods_no_leading_space", "celosses", "celosses_no_leading_space",
              "bpbs", "bpbs_no_leading_space")
    for doc, cont, label, *vals in records:
        metric.labels.append((doc, cont, label))
        for name, v in zip(states, vals, strict=True):
            getattr(metric, name).append((doc, cont, v))
    return {k: float(v) for k, v in metric.compute().items()}


def labels() -> dict:
    """Every label olmo_eval builds: [its task class, the metric type its ICLMetric gets]
    (the map's metric_type, else the class's)."""
    out = {}
    for label, entry in LABEL_TO_TASK_MAP.items():
        cls, kwargs = entry if isinstance(entry, tuple) else (entry, {})
        out[label] = [cls.__name__, kwargs.get("metric_type") or cls.metric_type]
    return out


if __name__ == "__main__":
    spec_path, out_dir = sys.argv[1:3]
    main(json.loads(Path(spec_path).read_text()), Path(out_dir))
