"""OLMo-core's zig-zag load balancer as the oracle (run in .venv-oracle):
`python zigzag_oracle.py IN.npz OUT.npz`. IN: x [B, T, D], ids [B, T], cp [context sizes].
OUT: for each context size C and rank r, `RingAttentionZigZagLoadBalancer(cp_rank=r,
cp_world_size=C).batch_shard(inputs=[x, ids], seq_dims=[1, 1])` as x_C_r and ids_C_r."""

import sys

import numpy as np
import torch
from olmo_core.nn.attention.ring import RingAttentionZigZagLoadBalancer


def main(in_path: str, out_path: str) -> None:
    given = np.load(in_path)
    x, ids = torch.from_numpy(given["x"]), torch.from_numpy(given["ids"])
    out = {}
    for C in given["cp"].tolist():
        for r in range(C):
            lb = RingAttentionZigZagLoadBalancer(cp_rank=r, cp_world_size=C)
            xs, idss = lb.batch_shard(inputs=[x, ids], seq_dims=[1, 1])
            out[f"x_{C}_{r}"], out[f"ids_{C}_{r}"] = xs.numpy(), idss.numpy()
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
