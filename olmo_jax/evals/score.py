"""Continuation log-likelihoods of a task's samples, in batches of fixed shapes.

Each query (olmo_eval's `ctx + continuation[:-1]`, already cut to the model's context) is
right-padded to its length bucket: olmo_eval's own rounding, the next multiple of 128 (or
the model's context with fixed_ctx_len), so a task compiles one program per bucket its
queries use (at most model_ctx_len / 128; `Scorer.programs` counts them), every batch
`batch_size` rows (the last one filled with copies of the first row, then dropped). Right
padding does not change a causal model's logits at the real positions. Per row the program
returns the sum of log p(continuation token) over the continuation's positions
(`ctx_len - 1 ... ctx_len + cont_len - 2`, ICLMetric's slice) and, for fast-MC samples, the
log-probabilities at the answer position, from which each choice's token is taken."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from olmo_jax.errors import ConfigError
from olmo_jax.kernels.ring_attention import CONTEXT_AXIS, zigzag_positions, zigzag_shard


def bucket_len(n: int, model_ctx_len: int, fixed_ctx_len: bool = False) -> int:
    return model_ctx_len if fixed_ctx_len else 128 * math.ceil(n / 128)


def row_arrays(sample: dict, T: int, pad_id: int):
    """(ids [T], targets [T], mask [T], answer position) of one sample."""
    q, cont = sample["query"], sample["continuation"]
    ids = np.full(T, pad_id, np.int32)
    ids[: len(q)] = q
    tgt, mask = np.zeros(T, np.int32), np.zeros(T, np.float32)
    start = sample["ctx_len"] - 1
    tgt[start: start + len(cont)] = cont
    mask[start: start + len(cont)] = 1.0
    return ids, tgt, mask, start


def continuation_sums(logits_BTV, positions_T, tgt_BT, mask_BT, pos_B):
    """(sum over masked positions of log p(target) [B], log p at pos [B, V]), float32, over
    the positions `positions_T` the logits are of: the whole row (0 .. T-1), or a
    context-parallel rank's zig-zag shard (their global indices; `tgt_BT`, `mask_BT` and
    `pos_B` are the whole rows'). Both are sums over those positions (log p at pos is zero
    where pos is not one of them), so the shards' results add up to the whole row's."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    # log p = logit - logsumexp: one pass over [B, T, V]; only the picked entries and the
    # answer position's row are read again
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    tgt_BT, mask_BT = jnp.take(tgt_BT, positions_T, axis=1), jnp.take(mask_BT, positions_T, axis=1)
    picked_BT = jnp.take_along_axis(logits_BTV, tgt_BT[..., None], axis=-1)[..., 0] - lse_BT
    at_BT = positions_T[None, :] == pos_B[:, None]
    at_B = jnp.argmax(at_BT, axis=1)  # pos's index among the positions (0 where absent)
    row_BV = jnp.take_along_axis(logits_BTV, at_B[:, None, None], axis=1)[:, 0]
    lse_B = jnp.take_along_axis(lse_BT, at_B[:, None], axis=1)[:, 0]
    at_pos_BV = jnp.where(jnp.any(at_BT, axis=1)[:, None], row_BV - lse_B[:, None], 0.0)
    return jnp.sum(jnp.where(mask_BT > 0, picked_BT, 0.0), axis=-1), at_pos_BV


class Scorer:
    """scorer(task) -> one log-likelihood sum per sample (a list per choice for fast-MC).

    `run(ids_BT, tgt_BT, mask_BT, pos_B) -> (sums_B, logp_BV)` is the compiled scoring
    program (jit caches one per input shape); `batch_size` rows per call."""

    def __init__(self, run, batch_size: int, pad_id: int, fixed_ctx_len: bool = False):
        if batch_size < 1:
            raise ConfigError(f"the downstream eval batch size must be >= 1, not {batch_size}")
        self.run, self.batch_size, self.pad_id, self.fixed_ctx_len = run, batch_size, pad_id, fixed_ctx_len
        self.shapes: set[tuple[int, int]] = set()

    @property
    def programs(self) -> int:
        """Distinct (batch, length) shapes scored so far: the compiled programs."""
        return len(self.shapes)

    def __call__(self, task) -> list:
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(task.samples):
            groups.setdefault(bucket_len(len(s["query"]), task.model_ctx_len, self.fixed_ctx_len), []).append(i)
        out: list = [None] * len(task.samples)
        B = self.batch_size
        for T, idx in sorted(groups.items()):
            self.shapes.add((B, T))
            for b in range(0, len(idx), B):
                rows = idx[b: b + B]
                arrays = [row_arrays(task.samples[i], T, self.pad_id) for i in rows]
                arrays += [arrays[0]] * (B - len(rows))
                ids, tgt, mask, pos = (np.stack(a) for a in zip(*arrays, strict=True))
                sums, logp = self.run(ids, tgt, mask, pos.astype(np.int32))
                sums, logp = np.asarray(sums), None if not task.fast_mc else np.asarray(logp)
                for j, i in enumerate(rows):
                    s = task.samples[i]
                    out[i] = [float(logp[j, c]) for c in s["choices"]] if task.fast_mc else float(sums[j])
        return out


def single_device_run(apply, params):
    """A Scorer's `run` from `apply(params, ids_BT) -> logits_BTV` (one jit; the params are
    an argument, not baked-in constants)."""
    fn = jax.jit(lambda p, ids, tgt, mask, pos: continuation_sums(apply(p, ids), jnp.arange(ids.shape[1]),
                                                                  tgt, mask, pos))
    return lambda ids, tgt, mask, pos: fn(params, ids, tgt, mask, pos)



def _row_head(logits_BTV, positions_T, tgt_BT, mask_BT, pos_B1):
    """continuation_sums as a plan's per-row outputs ([rows, 1], [rows, V])."""
    sums_B, logp_BV = continuation_sums(logits_BTV, positions_T, tgt_BT, mask_BT, pos_B1[:, 0])
    return sums_B[:, None], logp_BV


def forward_rows(graphdef, plan, row_head):
    """rows(params, model_state, ids_BT, *rows) -> row_head's per-row outputs, on one device of
    a plan without a pipeline (inside its shard_map): the model forward on the device's rows;
    with context parallelism each context rank runs its zig-zag shard of the positions (RoPE
    at their global indices) and row_head's sums (over the positions it is given, as
    Pipeline.rows_fn asks) are added over `context`."""
    from flax import nnx

    C = plan.model_cfg.context_parallel

    def rows(params, model_state, ids_BT, *rest):
        model = nnx.merge(graphdef, plan.use_params(params), model_state)
        T = ids_BT.shape[1]
        if C == 1:
            return row_head(model(ids_BT).logits_BTV, jnp.arange(T), *rest)
        rank = jax.lax.axis_index(CONTEXT_AXIS)
        positions_T = zigzag_positions(T, C, rank)
        logits_BTV = model(zigzag_shard(ids_BT, C, rank), positions_T=positions_T).logits_BTV
        return jax.lax.psum(tuple(row_head(logits_BTV, positions_T, *rest)), CONTEXT_AXIS)

    return rows


def sharded_run(graphdef, plan, get_state):
    """A Scorer's `run` on a parallel plan's mesh: `get_state() -> (params, model_state)` as
    the trainer stores them (FSDP / ZeRO gathers included), read at each call; the rows of
    each batch split over the batch's devices as an eval batch's are (the plan's
    BATCH_SPEC), each device scoring its rows: through the model (`forward_rows`), or on a
    pipeline plan forwards through the stages as the trainer's evaluation runs
    (`Pipeline.rows_fn`: the local rows in parallel.microbatches microbatches when they
    divide); with parallel.context > 1 each context rank scores its zig-zag shard of the
    positions and the sums are added. One jit: a program per (batch, length) shape. The
    batch size must be a multiple of the batch shards (data x expert)."""
    C = plan.model_cfg.context_parallel

    def check_len(T):
        if T % (2 * C):
            raise ConfigError(f"a scoring length of {T} tokens does not split into the 2 x parallel.context = "
                              f"{2 * C} zig-zag chunks: use length buckets (multiples of 128) or a context "
                              "length divisible by it")

    if plan.pipeline is not None:
        rows = plan.pipeline.rows_fn(graphdef, plan.model_cfg, plan, _row_head)
    else:
        rows = forward_rows(graphdef, plan, _row_head)
    fn = jax.jit(plan.shard_rows(rows, 4))
    sharding = plan.batch_sharding()

    def run(ids, tgt, mask, pos):
        check_len(np.shape(ids)[1])
        placed = [jax.device_put(np.asarray(x)[None], sharding) for x in (ids, tgt, mask, pos[:, None])]
        sums, logp = fn(*get_state(), *placed)
        return sums[0, :, 0], logp[0]

    return run
