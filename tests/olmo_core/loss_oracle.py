"""OLMo-core's LM loss as the oracle (run in .venv-oracle): `python loss_oracle.py IN.npz
OUT.npz`. IN: logits [B, S, V], input_ids [B, S], instance_mask [B], z_loss_multiplier.
OUT: the cross-entropy and z-loss OLMo-core's DDP train module computes for that batch:
labels from `get_labels`, `cross_entropy_loss(..., reduction="sum", compute_z_loss=True)`
divided by its denominator (labels != -100, plus seq_len - 1 per filtered instance); and,
given router logits [B, S, E], expert scores [B, S, E] and top-k ids [B, S, k], the router's
`load_balancing_loss` (local_batch) and `router_z_loss` with that denominator as the
`loss_div_factor` the train module passes the model."""

import sys

import numpy as np
import torch
from olmo_core.data.utils import get_labels
from olmo_core.nn.functional.cross_entropy_loss import cross_entropy_loss
from olmo_core.nn.moe import MoELoadBalancingLossGranularity
from olmo_core.nn.moe.loss import load_balancing_loss, router_z_loss


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
    router_logits = torch.from_numpy(given["router_logits"])
    E, k = router_logits.shape[-1], given["expert_ids"].shape[-1]
    counts = torch.bincount(torch.from_numpy(given["expert_ids"]).long().reshape(-1), minlength=E)
    lb = load_balancing_loss(num_experts=E, top_k=k, expert_scores=torch.from_numpy(given["scores"]),
                             batch_size_per_expert=counts, batched_batch_size_per_expert=None,
                             granularity=MoELoadBalancingLossGranularity.local_batch,
                             loss_div_factor=denominator)
    router_z = router_z_loss(expert_logits=router_logits, loss_div_factor=denominator)
    np.savez(out_path, ce=(ce / denominator).double().numpy(), z=(z / denominator).double().numpy(),
             denominator=int(denominator), lb=lb.double().numpy(), router_z=router_z.double().numpy())


if __name__ == "__main__":
    main(*sys.argv[1:])
