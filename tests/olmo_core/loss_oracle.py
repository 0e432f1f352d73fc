"""OLMo-core's LM loss as the oracle (run in .venv-oracle): `python loss_oracle.py IN.npz
OUT.npz`. IN: logits [B, S, V], input_ids [B, S], instance_mask [B], z_loss_multiplier.
OUT: the cross-entropy and z-loss OLMo-core's DDP train module computes for that batch:
labels from `get_labels`, `cross_entropy_loss(..., reduction="sum", compute_z_loss=True)`
divided by its denominator (labels != -100, plus seq_len - 1 per filtered instance)."""

import sys

import numpy as np
import torch
from olmo_core.data.utils import get_labels
from olmo_core.nn.functional.cross_entropy_loss import cross_entropy_loss


def main(in_path: str, out_path: str) -> None:
    given = np.load(in_path)
    batch = {"input_ids": torch.from_numpy(given["input_ids"]).long(),
             "instance_mask": torch.from_numpy(given["instance_mask"])}
    labels = get_labels(batch)
    denominator = (labels != -100).sum() + (~batch["instance_mask"]).sum() * (labels.shape[1] - 1)
    logits = torch.from_numpy(given["logits"])
    ce, z = cross_entropy_loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               reduction="sum", compute_z_loss=True,
                               z_loss_multiplier=float(given["z_loss_multiplier"]))
    np.savez(out_path, ce=(ce / denominator).double().numpy(), z=(z / denominator).double().numpy(),
             denominator=int(denominator))


if __name__ == "__main__":
    main(*sys.argv[1:])
