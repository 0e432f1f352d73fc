"""OLMo-core's document lengths and intra-document RoPE as the oracle (run in .venv-oracle,
never imported by the product): `python doc_oracle.py SPEC.json IN.npz OUT.npz`.

SPEC: {"paths": [...], "vocab_size": V, "seq_len": S, "eos": E, "head_size": H, "theta":
theta, "work_dir": DIR}. IN: q and k [N, S, heads, H] (float32), one row per instance.
OUT: each instance's `input_ids` [N, S] and `doc_lens` (NumpyFSLDataset with
generate_doc_lengths, zero-padded as its collator pads them) [N, D]; q and k rotated by
`RotaryEmbedding` with the batch's `cu_doc_lens` (positions restarting at each document)."""

import json
import sys

import numpy as np
import torch
from olmo_core.data.numpy_dataset import NumpyFSLDataset, NumpyFSLDatasetConfig
from olmo_core.data.tokenizer import TokenizerConfig
from olmo_core.data.utils import get_cumulative_document_lengths
from olmo_core.nn.rope import RotaryEmbedding


def main(spec_path: str, in_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    tokenizer = TokenizerConfig(vocab_size=spec["vocab_size"], eos_token_id=spec["eos"],
                                pad_token_id=spec["eos"])
    dtype = NumpyFSLDatasetConfig(tokenizer=tokenizer, sequence_length=spec["seq_len"]).get_dtype()
    dataset = NumpyFSLDataset(*spec["paths"], sequence_length=spec["seq_len"],
                              pad_token_id=spec["eos"], eos_token_id=spec["eos"],
                              vocab_size=spec["vocab_size"], dtype=dtype, generate_doc_lengths=True)
    dataset.work_dir = spec["work_dir"]
    dataset.prepare()
    items = [dataset[i] for i in range(len(dataset))]
    width = max(len(item["doc_lens"]) for item in items)
    doc_lens = torch.zeros((len(items), width), dtype=torch.int32)
    for i, item in enumerate(items):
        doc_lens[i, : len(item["doc_lens"])] = item["doc_lens"]
    arrays = np.load(in_path)
    rope = RotaryEmbedding(head_size=spec["head_size"], theta=spec["theta"])
    q, k = rope(torch.from_numpy(arrays["q"]), torch.from_numpy(arrays["k"]), head_first=False,
                cu_doc_lens=get_cumulative_document_lengths(doc_lens))
    np.savez(out_path, input_ids=torch.stack([item["input_ids"] for item in items]).numpy(),
             doc_lens=doc_lens.numpy(), q=q.numpy(), k=k.numpy())


if __name__ == "__main__":
    main(*sys.argv[1:])
