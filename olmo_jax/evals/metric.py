"""olmo_eval's ICLMetric (`olmo_eval/metrics.py`), update and compute, on the continuation
log-likelihood sums score.py computes: per sample, the sum of log p(continuation token) over
the continuation (a list of one per choice for fast-MC samples). The same per-type
normalizations (acc and f1: the raw sum; len_norm, ce_loss, bpb: per character, with bpb
per byte in bits), the first record of a (doc, continuation) kept, a document whose
continuation ids are not 0..n-1 skipped, and compute()'s keys: `<type>_v1` / `<type>_v2`
(both from the leading-space scores, as ICLMetric has it), ce_loss, bpb, soft and soft_log
in v1 (no leading space) and v2; ce_loss / bpb tasks give only their own type's pair, and
f1 tasks only `f1_v1` (the leading-space choices) and `f1_v2` (the others): the F1 of the
per-document choices against the gold ids with continuation 0 the positive class (MRPC's
" yes"), 0.0 when nothing is predicted positive or nothing is positive."""

from __future__ import annotations

import numpy as np

LOG_2_OF_E = 1.44269504089


def records(metric_type: str, samples: list[dict], sums: list) -> list[tuple]:
    """ICLMetric.update's records: (doc_id, cont_id, label_id, loglikelihood,
    loglikelihood_no_leading_space, celoss, celoss_nls, bpb, bpb_nls) per scored choice."""
    out = []
    for s, total in zip(samples, sums, strict=True):
        choices = list(enumerate(total)) if s.get("fast_mc") else [(s["cont_id"], total)]
        for cont_id, lp in choices:
            lp = float(lp)
            ce, ce_nls = -lp / s["cont_str_len"], -lp / s["cont_str_len_no_leading_space"]
            bpb = -lp / s["cont_byte_len"] * LOG_2_OF_E
            bpb_nls = -lp / s["cont_byte_len_no_leading_space"] * LOG_2_OF_E
            if metric_type in ("acc", "f1"):
                ll, ll_nls = lp, lp
            elif metric_type in ("len_norm", "ce_loss", "bpb"):
                ll, ll_nls = lp / s["cont_str_len"], lp / s["cont_str_len_no_leading_space"]
            else:
                raise ValueError(f"metric type {metric_type!r} is not one of acc, f1, len_norm, ce_loss, bpb")
            out.append((s["doc_id"], cont_id, int(s["label_id"]), ll, ll_nls, ce, ce_nls, bpb, bpb_nls))
    return out


def _softmax_at(x: np.ndarray, i: int) -> tuple[float, float]:
    z = x - x.max()
    log_p = z - np.log(np.exp(z).sum())
    return float(np.exp(log_p[i])), float(log_p[i])


def f1_score(labels: list[int], preds: list[int], pos_label: int = 0) -> float:
    """ICLMetric.custom_f1_score: the F1 of `preds` against `labels` for the class
    `pos_label`; 0.0 when no prediction or no label is positive (or both are wrong)."""
    pairs = list(zip(labels, preds, strict=True))
    tp = sum(y == pos_label and p == pos_label for y, p in pairs)
    fp = sum(y != pos_label and p == pos_label for y, p in pairs)
    fn = sum(y == pos_label and p != pos_label for y, p in pairs)
    if tp + fp == 0 or tp + fn == 0:
        return 0.0
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def compute(metric_type: str, recs: list[tuple]) -> dict[str, float]:
    """ICLMetric.compute on update's records."""
    labels: dict[int, int] = {}
    by_doc: dict[int, dict[int, tuple]] = {}
    for doc, cont, label, *vals in recs:
        labels.setdefault(doc, label)
        by_doc.setdefault(doc, {}).setdefault(cont, tuple(vals))
    rows = {k: [] for k in ("correct", "ce", "ce_nls", "bpb", "bpb_nls", "soft", "soft_log", "soft_nls",
                            "soft_log_nls", "gold", "pred", "pred_nls")}
    for doc, conts in by_doc.items():
        n = len(conts)
        if any(c >= n or c < -n for c in conts):  # ICLMetric's IndexError: the document is skipped
            continue
        v = np.empty((6, n))
        v[0], v[1] = -np.inf, -np.inf
        v[2:] = np.inf
        for c, vals in conts.items():
            v[:, c] = vals
        ll, ll_nls, ce, ce_nls, bpb, bpb_nls = v
        if metric_type == "ce_loss":
            rows["ce"].append(ce[0])
            rows["ce_nls"].append(ce_nls[0])
            continue
        if metric_type == "bpb":
            rows["bpb"].append(bpb[0])
            rows["bpb_nls"].append(bpb_nls[0])
            continue
        gold = labels[doc]
        if metric_type == "f1":
            rows["gold"].append(gold)
            rows["pred"].append(int(np.argmax(ll)))
            rows["pred_nls"].append(int(np.argmax(ll_nls)))
            continue
        rows["correct"].append(1.0 if int(np.argmax(ll)) == gold else 0.0)
        rows["ce"].append(ce[gold])
        rows["ce_nls"].append(ce_nls[gold])
        rows["bpb"].append(bpb[gold])
        rows["bpb_nls"].append(bpb_nls[gold])
        for key, x in (("", ll), ("_nls", ll_nls)):
            p, log_p = _softmax_at(x, gold)
            rows["soft" + key].append(p)
            rows["soft_log" + key].append(log_p)

    def mean(key):
        return float(np.mean(rows[key])) if rows[key] else float("nan")

    if metric_type == "ce_loss":
        return {"ce_loss_v1": mean("ce_nls"), "ce_loss_v2": mean("ce")}
    if metric_type == "bpb":
        return {"bpb_v1": mean("bpb_nls"), "bpb_v2": mean("bpb")}
    if metric_type == "f1":  # v1 from the leading-space choices, v2 from the others (ICLMetric's order)
        return {"f1_v1": f1_score(rows["gold"], rows["pred"]), "f1_v2": f1_score(rows["gold"], rows["pred_nls"])}
    return {
        f"{metric_type}_v1": mean("correct"),
        f"{metric_type}_v2": mean("correct"),
        "ce_loss_v1": mean("ce_nls"), "ce_loss_v2": mean("ce"),
        "bpb_v1": mean("bpb_nls"), "bpb_v2": mean("bpb"),
        "soft_v1": mean("soft_nls"), "soft_v2": mean("soft"),
        "soft_log_v1": mean("soft_log_nls"), "soft_log_v2": mean("soft_log"),
    }
