"""Report section "route": where tokens' assignments go in rowwise expert-parallel
dispatch, on a small example, computed with the real plan functions.

Each of `ep` sender ranks holds S tokens routed top-k over E experts (an example routing
drawn from a seeded key, skewed towards low expert ids so that capacity drops show).
`olmo_jax.parallel.expert.rowwise` decides, on the sender, every assignment's row
(r * El + j) * C + c of the [ep, El, C] send buffer (`rowwise_plan`; r = destination
rank, j = local expert, c = slot) or drops it; the all_to_all over `expert` swaps the
rank dimension, so the assignment lands in row (s * El + j) * C + c of rank r's
[ep, El, C] receive buffer (s = sender), where local expert j owns slot j of every
sender; the expert's output travels back by the mirror all_to_all to the same send-buffer
row, where the sender's combine gathers it and applies the router weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from olmo_jax.model.moe import sizing
from olmo_jax.parallel.expert.rowwise import rowwise_plan

TOKENS_PER_SENDER = 8
ILLUSTRATION_EP = 4  # expert ranks shown when the mesh has none (expert = 1)
SKEW = 1.5  # logit bonus of expert 0 over expert E-1 in the example routing


def example_routing(ep: int, n_tokens: int, num_experts: int, top_k: int, seed: int) -> np.ndarray:
    """idx [ep, S, k]: each token's top-k experts under random logits, skewed (linearly in
    the expert id) so that low experts are popular."""
    logits = jax.random.normal(jax.random.key(seed), (ep, n_tokens, num_experts))
    logits = logits + jnp.linspace(SKEW, 0.0, num_experts)
    return np.asarray(jax.lax.top_k(logits, top_k)[1])


def illustration_ep(num_experts: int, mesh_ep: int) -> int:
    """The mesh's expert ranks, or (expert = 1) the largest divisor of E up to
    ILLUSTRATION_EP, so the exchange has more than one rank to show."""
    if mesh_ep > 1:
        return mesh_ep
    return max(d for d in range(1, min(ILLUSTRATION_EP, num_experts) + 1) if num_experts % d == 0)


def route_section(moe_cfg, mesh_ep: int, dispatch: str, capacity_factor: float, seed: int = 0,
                  n_tokens: int = TOKENS_PER_SENDER) -> dict:
    E, k = moe_cfg.num_experts, moe_cfg.top_k
    ep = illustration_ep(E, mesh_ep)
    El = E // ep
    C = sizing.capacity(n_tokens, k, E, capacity_factor)
    idx = example_routing(ep, n_tokens, E, k, seed)
    senders = []
    for s in range(ep):
        plan = rowwise_plan(jnp.asarray(idx[s]), E, C)
        row = np.asarray(plan.row_Sk)
        keep = np.asarray(plan.keep_Sk)
        assignments = []
        for t in range(n_tokens):
            for c in range(k):
                expert = int(idx[s, t, c])
                rank, local = divmod(expert, El)
                a = {"token": t, "choice": c, "expert": expert, "rank": rank,
                     "local": local, "kept": bool(keep[t, c])}
                if a["kept"]:  # send row (r * El + j) * C + slot; received at (s * El + j) * C + slot
                    send_row = int(row[t, c])
                    slot = send_row - expert * C
                    a.update(send_row=send_row, slot=slot, recv_row=(s * El + local) * C + slot)
                assignments.append(a)
        senders.append({"assignments": assignments, "dropped": int((~keep).sum())})
    return {
        "num_experts": E, "top_k": k, "ep": ep, "mesh_ep": mesh_ep, "local_experts": El,
        "tokens": n_tokens, "capacity": C, "capacity_factor": capacity_factor,
        "dispatch": dispatch, "senders": senders,
    }
