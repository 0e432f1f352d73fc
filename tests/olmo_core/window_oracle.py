"""OLMo-core's sliding-window attention as the oracle (run in .venv-oracle, never imported by
the product): `python window_oracle.py IN.npz OUT.npz`.

IN: q [B, T, N, H], k and v [B, T, K, H], probe [B, T, N, H] (float32) and window W. OUT:
`TorchAttentionBackend` (torch SDPA, the backend OLMo-core runs on a CPU) built as
OLMo-core's Attention builds it for window_size W (`window_size=(W - 1, 0)`): its output
and the gradients of sum(sin(out) * probe) in q, k and v."""

import sys

import numpy as np
import torch
from olmo_core.nn.attention.backend import TorchAttentionBackend


def main(in_path: str, out_path: str) -> None:
    arrays = np.load(in_path)
    q, k, v = (torch.from_numpy(arrays[n]).requires_grad_(True) for n in ("q", "k", "v"))
    W = int(arrays["window"])
    backend = TorchAttentionBackend(head_dim=q.shape[-1], n_heads=q.shape[2],
                                    n_kv_heads=k.shape[2], window_size=(W - 1, 0))
    out = backend((q, k, v))
    (torch.sin(out) * torch.from_numpy(arrays["probe"])).sum().backward()
    np.savez(out_path, out=out.detach().numpy(), dq=q.grad.numpy(), dk=k.grad.numpy(),
             dv=v.grad.numpy())


if __name__ == "__main__":
    main(*sys.argv[1:])
