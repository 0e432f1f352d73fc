"""OLMo-core's data pipeline as the oracle (run in .venv-oracle, never imported by the
product): `python data_oracle.py SPECS.json OUT_DIR`, one process for every case (torch
and OLMo-core are imported once).

SPECS: {name: spec}, each spec {"paths": [...], "vocab_size": V, "seq_len": S, "filter":
null | {max_period, min_period, max_count}, "work_dir": DIR}. OUT_DIR/<name>.npz: for that
case, OLMo-core's dtype for V (its
`NumpyFSLDatasetConfig.get_dtype` rule), each instance's `input_ids` [N, S], its
`instance_mask` [N], the labels `get_labels` makes of the whole set [N, S], and the loss
denominator the DDP train module computes for it (labels != -100, plus seq_len - 1 for each
filtered instance)."""

import json
import sys

import numpy as np
import torch
from olmo_core.data.numpy_dataset import (
    InstanceFilterConfig,
    NumpyFSLDataset,
    NumpyFSLDatasetConfig,
)
from olmo_core.data.tokenizer import TokenizerConfig
from olmo_core.data.utils import get_labels


def main(specs_path: str, out_dir: str) -> None:
    for name, spec in json.loads(open(specs_path).read()).items():
        one_case(spec, f"{out_dir}/{name}.npz")


def one_case(spec: dict, out_path: str) -> None:
    tokenizer = TokenizerConfig(vocab_size=spec["vocab_size"], eos_token_id=0, pad_token_id=0)
    dtype = NumpyFSLDatasetConfig(tokenizer=tokenizer, sequence_length=spec["seq_len"]).get_dtype()
    rule = InstanceFilterConfig(**spec["filter"]) if spec["filter"] else None
    dataset = NumpyFSLDataset(*spec["paths"], sequence_length=spec["seq_len"], pad_token_id=0,
                              eos_token_id=0, vocab_size=spec["vocab_size"], dtype=dtype,
                              instance_filter_config=rule)
    dataset.work_dir = spec["work_dir"]
    dataset.prepare()
    items = [dataset[i] for i in range(len(dataset))]
    batch = {"input_ids": torch.stack([item["input_ids"] for item in items])}
    if rule is not None:
        batch["instance_mask"] = torch.tensor([bool(item["instance_mask"]) for item in items])
    labels = get_labels(batch)
    denominator = int((labels != -100).sum())
    if rule is not None:
        denominator += int((~batch["instance_mask"]).sum()) * (labels.shape[1] - 1)
    np.savez(out_path, dtype=np.dtype(dtype).name, input_ids=batch["input_ids"].numpy(),
             instance_mask=batch.get("instance_mask", torch.ones(len(items), dtype=torch.bool)).numpy(),
             labels=labels.numpy(), denominator=denominator)


if __name__ == "__main__":
    main(*sys.argv[1:])
