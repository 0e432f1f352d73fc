"""The pipeline executor: one `lax.scan` over the schedule's ticks, run per device inside
the plan's shard_map (so expert dispatch over `expert` and the loss sums over the batch
axes happen inside each stage), with one `ppermute` each way between neighbouring
stages per tick.

At every tick a device reads its stage's two cells of the schedule table (schedule.py):
the F slot's op, then the B slot's (1F1B's steady state runs one of each per tick):
  FWD (m, v)  runs chunk k = v * P + s on microbatch m through `jax.vjp`: for k = 0 the
              embedding and dense blocks first (their VJP kept in the `prologue`
              buffer); the chunk's MoE blocks run one `jax.vjp` each, in a scan, each
              reading its row of the stage's weights where it runs (no copy of the
              chunk's rows), their residuals stacked into the `stash` slot the table
              names (parameters are not stashed: the backward takes them from the
              stage's weights again; `model.remat` decides what else is kept); for
              k = K - 1 the final norm, LM head and loss run forward and backward at
              once, their cotangent left in this stage's `bwd_in` inbox.
  BWD (m, v)  runs the blocks backwards in a reverse scan: each block's VJP rebuilt from
              the stash, applied to the cotangent (the inbox slot's for the last block),
              its weight gradients added to its row of the stage's float32 sums as it
              goes (no [c, ...] stack of them) and, for k = 0, runs the prologue's VJP
              (embedding and dense-block gradients).
and then sends its latest forward output to stage s + 1 and its latest input cotangent
to stage s - 1 (once per tick, after both slots); arrivals go into the inbox slots the
table names. FWD and BWD each sit in a `lax.cond`: a device runs only its own ops, and
all devices of one stage take the same branches, so the collectives inside stay matched.
The conds sit in named scopes (pipe_fwd, pipe_bwd; pipe_first for chunk 0's prologue,
pipe_last for the head) that the planner reads to count each branch as often as the
schedule runs it (olmo_jax/planner/pipeline_cost.py).
Buffers have the sizes the table needs: for 1F1B at most 2P - 1 microbatches whatever M
is; for GPipe all M.

Each microbatch's tokens, and with document masking its segment ids and per-row RoPE
tables (`Positions`), are computed from its whole rows where a stage runs it
(`objective.token_shard`: a context rank's zig-zag shard of each); a block's VJP keeps
what its backward needs of them in the stash like any residual.

Router statistics travel with the activations: a RouterStats buffer with a row per MoE
block that every chunk fills in; the last chunk computes the losses from the whole buffer
exactly as the single-device step does (`objective.loss_parts`), and the cotangents
of every block's statistics travel back with the activation cotangent, so load-balancing
and z-loss gradients reach each router on the stage that owns it.

The ticks are methods of one object per trace: `_Ticks` holds the scan, the tick and the
FWD op; `_TrainTicks` (make_grad_fn) adds what a training forward keeps and the BWD op;
`_EvalTicks` (make_eval_fn) runs the same ticks forwards only over the `forward_only`
table (no stash), the last chunk summing cross-entropy and tokens; `_RowTicks`
(make_rows_fn, downstream scoring: olmo_jax/evals/score.py) the same, the last chunk
keeping a caller's per-row sums of the logits instead.

Gradients come back in the compute layout: the stage's [V * c] chunk rows for the MoE
blocks, per-device partial sums for everything else (zero outside the first / last
stage), summed over the microbatches in float32 buffers (the weights themselves are the
stage's compute copies, bf16 for a bf16 model: parallel/zero.py; neither the stash nor
the buffers hold weights); `layout.reduce` turns them into the stored placement.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo_jax.kernels.ring_attention import CONTEXT_AXIS
from olmo_jax.kernels.vma import varying_axes
from olmo_jax.model.config import TransformerConfig
from olmo_jax.model.moe.losses import RouterStats
from olmo_jax.model.transformer import block_step, position_tables, run_blocks, window_index
from olmo_jax.objective import (
    LossParts,
    Plan,
    TokenShard,
    head_loss_sums,
    loss_parts,
    token_shard,
    total_loss,
)
from olmo_jax.parallel.mesh import AXES
from olmo_jax.parallel.pipeline import schedule as sched_lib
from olmo_jax.parallel.pipeline.layout import PIPE, STAGE_KEY, Chunking
from olmo_jax.parallel.pipeline.schedule import COL
from olmo_jax.parallel.pipeline.stash import SavedVJP

PROLOGUE_KEYS = ("embedding", "embedding_norm", "dense_blocks")  # weights stage 0 uses before chunk 0
# model.remat = none: what a stashed VJP recomputes instead of keeping (cheap, and the
# values derived from weights alone: casts, the fused qkv concatenation, reshapes).
_RECOMPUTED = frozenset({"convert_element_type", "reshape", "transpose", "concatenate",
                         "broadcast_in_dim", "squeeze", "expand_dims", "slice", "dynamic_slice",
                         "copy", "copy_p"})


def _stash_policy(prim, *_, **__) -> bool:
    return prim.name not in _RECOMPUTED


def _stashable(fn, remat: str):
    """`fn` as its VJP is stashed: with model.remat = none (and mlp, whose feed-forward
    sub-layers checkpoint themselves inside), everything is kept except the cheap ops above
    (so the stash holds activations, not per-microbatch copies of the weights); block /
    attention / dots keep the model's own checkpointing."""
    return jax.checkpoint(fn, policy=_stash_policy) if remat in ("none", "mlp") else fn


# ---- small tree helpers --------------------------------------------------------------------
def _add(acc, g):
    """A gradient added to its float32 buffer."""
    return acc + g.astype(acc.dtype)


def _vary(tree, axes=AXES):
    """Every leaf typed as differing over `axes` (scan carries and cond branches must agree)."""

    def one(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def _own_axes(x) -> tuple[str, ...]:
    """The mesh axes an array (or a ShapeDtypeStruct from eval_shape) varies over."""
    mat = x.manual_axis_type if isinstance(x, jax.ShapeDtypeStruct) else None
    return tuple(sorted(mat.varying if mat is not None else varying_axes(x)))


def _zeros(tree, n=None, axes=AXES, dtype=None):
    """Zeros shaped like `tree` (arrays or ShapeDtypeStructs), with a leading [n] if given,
    varying over `axes` (None: over the axes each leaf varies over; stashed residuals must
    keep their exact type, e.g. for the cotangent sums of hand-written VJPs), in `dtype`
    (None: each leaf's; the gradient buffers are float32, also for a bf16 compute copy:
    parallel/zero.py)."""
    lead = () if n is None else (n,)

    def one(x):
        own = _own_axes(x) if axes is None else axes
        if n is not None:  # written at slots that differ per stage
            own = tuple(sorted(set(own) | {PIPE}))
        return _vary(jnp.zeros(lead + tuple(x.shape), dtype or x.dtype), own)

    return jax.tree.map(one, tree)


def _stage_index():
    """A (zero) microbatch / virtual-stage index typed like one read from the stage's
    table row (varying over pipe), for tracing the tick's pieces ahead of the scan."""
    return _vary(jnp.zeros((), jnp.int32), (PIPE,))


def _read(buf, i):
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False), buf)


def _write(buf, i, value):
    def one(b, x):
        x = _vary(x.astype(b.dtype), _own_axes(b))
        return jax.lax.dynamic_update_index_in_dim(b, x, i, 0)

    return jax.tree.map(one, buf, value)


def _slot(i, n):
    """Slot i, or the scratch slot n for 'none' (NO_SLOT)."""
    return jnp.where(i < 0, n, i)


def _select(state, keys, keep: bool):
    return nnx.State({k: v for k, v in state.items() if (k in keys) == keep})


def _join(*states):
    """States with disjoint top-level keys -> one State."""
    out = {}
    for st in states:
        out.update(dict(st.items()))
    return nnx.State(out)


class Positions(NamedTuple):
    """What a microbatch's attention needs besides its q, k and v: the RoPE tables ([T, H]
    shared by the rows, or per row [B, T, H] with document masking; with a table per window
    choice on axis -3 where the layers' RoPE differs by window, rope.by_window) and the
    segment ids (document masking; None: off)."""

    cos_TH: jax.Array
    sin_TH: jax.Array
    segment_ids_BT: jax.Array | None


class _Carry(NamedTuple):
    stash: list  # per residual array: [slots, ...]
    prologue: list
    fwd_in: tuple  # (x [slots + 1, ...], RouterStats of [slots + 1, ...])
    bwd_in: tuple
    out_fwd: tuple  # the latest forward output (x, stats), sent each tick
    out_bwd: tuple  # the latest input cotangent (dx, dstats), sent each tick
    g_stage: object  # gradients of the stage's chunk rows
    g_prologue: object
    g_head: object
    parts: LossParts  # summed over this stage's microbatches


class StageProgram:
    """The pieces of the model a stage runs, as pure functions of arrays, built per trace
    from the step's (compute-layout) params and model state."""

    def __init__(self, graphdef, cfg: TransformerConfig, chunks: Chunking, params, model_state,
                 ops: Plan):
        self.cfg, self.chunks, self.ops = cfg, chunks, ops
        self.graphdef = graphdef
        P, c = chunks.stages, chunks.slots
        self.P, self.c, self.K = P, c, chunks.chunks
        self.s = jax.lax.axis_index(PIPE)
        self.stage_params = params[STAGE_KEY]
        self.head_keys = ("final_norm", "lm_head") + (("embedding",) if cfg.tie_embeddings else ())
        self.prologue_params = _select(params, [k for k in PROLOGUE_KEYS if k in params], True)
        self.head_params = _select(params, [k for k in self.head_keys if k in params], True)
        self.other_params = _select(params, (STAGE_KEY,), False)
        # Model state (router biases) rows of this stage's chunks; the rest as is.
        self.model_state = model_state
        if STAGE_KEY in model_state:
            mine = jnp.asarray(chunks.rows)[self.s]
            self.stage_state = jax.tree.map(lambda x: jnp.take(x, mine, axis=0),
                                            model_state[STAGE_KEY])
        else:
            self.stage_state = nnx.State({})
        self.blocks_def = nnx.split(nnx.merge(graphdef, params, model_state).moe_blocks)[0]
        self.key_impl = None
        self.keep = jnp.asarray(chunks.keep)[self.s]  # [V * c]
        self.rows = jnp.asarray(chunks.rows)[self.s]
        self.offsets = jnp.asarray(chunks.offsets)
        # Each slot's window (model.window_pattern): the MoE layer in it, read by the stage
        # index like the weights (a layer keeps its own window on whichever stage it runs).
        moe_windows = window_index(cfg, moe=True)
        self.window_rows = None if moe_windows is None else moe_windows[self.rows]  # [V * c]

    # ---- chunk pieces --------------------------------------------------------------------
    def chunk_rows(self, tree, v):
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, v * self.c, self.c, 0), tree)

    def _model(self, params):
        """The Transformer over `params` (any subset merged with the other weights)."""
        full = _join(self.other_params, params, nnx.State({STAGE_KEY: self.stage_params}))
        return nnx.merge(self.graphdef, full, self.model_state)

    def prologue(self, prologue_params, tokens_BT, pos: Positions):
        """Embedding and dense-first blocks (stage 0, before chunk 0)."""
        model = self._model(prologue_params)
        x_BTD = model.embed(tokens_BT)
        if model.dense_blocks is not None:
            x_BTD, _ = run_blocks(model.dense_blocks, x_BTD, pos.cos_TH, pos.sin_TH, self.cfg.remat,
                                  unroll=self.cfg.scan_unroll, segment_ids_BT=pos.segment_ids_BT,
                                  window_index_L=window_index(self.cfg, moe=False))
        return _vary(x_BTD)

    def body(self, chunk_params, x_BTD, v, pos: Positions, key_data):
        """The MoE blocks of this stage's virtual stage v -> (x, RouterStats [c, ...])."""
        blocks = nnx.merge(self.blocks_def, chunk_params, self.chunk_rows(self.stage_state, v))
        keep = jax.lax.dynamic_slice_in_dim(self.keep, v * self.c, self.c)
        keys = None if key_data is None else jax.random.wrap_key_data(key_data, impl=self.key_impl)
        out = run_blocks(blocks, x_BTD, pos.cos_TH, pos.sin_TH, self.cfg.remat,
                         unroll=self.cfg.scan_unroll, keys=keys, keep_L=keep,
                         segment_ids_BT=pos.segment_ids_BT, window_index_L=self.chunk_windows(v))
        return _vary(out)

    def layer_rows(self, tree, row):
        """One MoE block's weights (or state): row `row` of the stage's [V * c] rows."""
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row, 0, keepdims=False), tree)

    def chunk_windows(self, v):
        """The window indices of virtual stage v's c slots (None: one window)."""
        if self.window_rows is None:
            return None
        return jax.lax.dynamic_slice_in_dim(self.window_rows, v * self.c, self.c)

    def layer(self, layer_params, x_BTD, layer_state, key_data, keep, pos: Positions,
              window=None):
        """One MoE block of a chunk (what `body` scans): -> (x, RouterStats of the block).
        `window`: the block's window index (chunk_windows)."""
        graphdef, state = nnx.split(nnx.merge(self.blocks_def, layer_params, layer_state))
        key = None if key_data is None else jax.random.wrap_key_data(key_data, impl=self.key_impl)
        step = block_step(graphdef, pos.cos_TH, pos.sin_TH, self.cfg.remat, pos.segment_ids_BT)
        return _vary(step(x_BTD, (state, key, keep, window)))

    def head_loss(self, head_params, x_BTD, stats: RouterStats, targets_BT, microbatches: int,
                  row_end_B1=None):
        """Final norm, LM head and this microbatch's share of the step's loss (`row_end_B1`:
        the rows' last targets when `targets_BT` is a context shard, objective.labelled)."""
        model = self._model(head_params)
        chunked = self.cfg.lm_loss_chunk  # the loss's sums without the [B, T, V] logits
        sums = head_loss_sums(model, x_BTD, targets_BT, chunked, row_end_B1) if chunked else None
        L = self.chunks.n_layers
        stats = jax.tree.map(lambda a: a[:L], stats)
        parts = loss_parts(None if chunked else model.head(x_BTD), targets_BT, stats, self.cfg,
                           self.ops, row_end_B1, sums=sums)
        return total_loss(parts, self.cfg) / microbatches, parts

    def layer_keys(self, key_m, v):
        """Key data of the chunk's MoE blocks for microbatch key `key_m`, as the
        single-device model draws them (split over all MoE blocks, in order)."""
        if key_m is None:
            return None
        self.key_impl = jax.random.key_impl(key_m)
        all_keys = jax.random.key_data(jax.random.split(key_m, self.chunks.n_layers))
        return all_keys[jax.lax.dynamic_slice_in_dim(self.rows, v * self.c, self.c)]

    def stats_write(self, buf, stats_c, k):
        return jax.tree.map(lambda b, x: jax.lax.dynamic_update_slice_in_dim(b, x, self.offsets[k], 0),
                            buf, stats_c)

    def stats_rows(self, buf, k, v):
        """The chunk's rows of a stats(-cotangent) buffer; padding slots zeroed."""
        keep = jax.lax.dynamic_slice_in_dim(self.keep, v * self.c, self.c)
        return jax.tree.map(
            lambda b: jax.lax.dynamic_slice_in_dim(b, self.offsets[k], self.c, 0)
            * keep.reshape((self.c,) + (1,) * (b.ndim - 1)).astype(b.dtype), buf)

    def stats_clear(self, buf, k):
        return jax.tree.map(lambda b: jax.lax.dynamic_update_slice_in_dim(
            b, jnp.zeros((self.c,) + b.shape[1:], b.dtype), self.offsets[k], 0), buf)


def _stats_buffer_shape(stats_c, n_layers: int, c: int):
    """RouterStats of one chunk ([c, ...]) -> the shapes of the whole-model buffer: one row
    per MoE block plus c rows of overflow for the last chunk's padding slots."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n_layers + c,) + x.shape[1:], x.dtype),
                        stats_c)


def _ring(P: int, step: int):
    return [(i, (i + step) % P) for i in range(P)]


def _skip(carry, _cell):
    """The branch of a tick's op that does not run."""
    return carry


def _kept(state):
    return state


def _fields(carry, names) -> tuple:
    return tuple(getattr(carry, n) for n in names)


class _Ticks:
    """One trace of a schedule over a step's microbatches (rows of batch_BX split in M, in
    order): the scan over the table's ticks, a tick (its stage's op, then the sends to the
    neighbouring stages) and the FWD op, shared by training (_TrainTicks, which
    adds BWD) and evaluation (_EvalTicks). The FWD op runs chunk k = v * P + s: at k = 0 the
    prologue first (`first`), then the chunk (`chunk`), at k = K - 1 the head and loss
    after (`head`); `first` and `head` run in conds over the carry fields FIRST / HEAD,
    and what they keep is the subclass's."""

    BACKWARD = False  # ticks run BWD ops and send cotangents back
    FIRST: tuple[str, ...] = ()
    HEAD: tuple[str, ...] = ()

    def __init__(self, prog: StageProgram, schedule: sched_lib.Schedule, batch_BX):
        """`batch_BX`: token windows [rows, T + 1] (inputs [:, :-1], targets [:, 1:])."""
        cfg = prog.cfg
        self.prog, self.cfg, self.M, self.slots = prog, cfg, schedule.microbatches, schedule.slots
        self.micro = batch_BX.reshape(self.M, -1, batch_BX.shape[-1])
        # Without document masking every microbatch has the same RoPE tables: built once.
        s = self.shard(0)
        self.positions_T = (s.positions_T if s.positions_T is not None
                            else jnp.arange(s.inputs_BT.shape[1]))
        self.shared = None if s.segment_ids_BT is not None else Positions(
            *position_tables(cfg, s.inputs_BT.shape[1], s.positions_T), None)

    def shard(self, m) -> TokenShard:
        """Microbatch m's tokens as the model sees them on this device, computed on the whole
        rows (objective.token_shard: with context parallelism this context rank's zig-zag
        shard; with document masking the segment ids and per-row positions)."""
        return token_shard(self.micro[m], self.cfg)

    def inputs(self, m):
        return self.shard(m).inputs_BT

    def targets(self, m):
        return self.shard(m).targets_BT

    def row_end(self, m):
        """The rows' last targets when `targets` holds a context shard of them."""
        return self.shard(m).row_end_B1

    def positions(self, m) -> Positions:
        """What microbatch m's attention needs besides q, k and v: the shared tables, or
        with document masking its own (per row) and its segment ids."""
        if self.shared is not None:
            return self.shared
        s = self.shard(m)
        return Positions(*position_tables(self.cfg, s.inputs_BT.shape[1], s.positions_T,
                                          s.segment_ids_BT, s.positions_BT), s.segment_ids_BT)

    def run(self, carry, table):
        """The carry after every tick of `table`."""
        carry, _ = jax.lax.scan(self.tick, carry, jnp.asarray(table))
        return carry

    def tick(self, carry, row):
        """row [2, P, fields]: the stage's F slot, then its B slot, then the sends."""
        cell_f, cell_b = row[0, self.prog.s], row[1, self.prog.s]
        with jax.named_scope("pipe_fwd"):
            carry = jax.lax.cond(cell_f[COL["op"]] == sched_lib.FWD, self.fwd, _skip, carry, cell_f)
        if self.BACKWARD:
            with jax.named_scope("pipe_bwd"):
                carry = jax.lax.cond(cell_b[COL["op"]] == sched_lib.BWD, self.bwd, _skip, carry,
                                     cell_b)
        return self.send(carry, cell_b), None

    def send(self, carry, cell):
        """The latest forward output to stage s + 1 (and, training, the latest input
        cotangent to stage s - 1), into the inbox slots the table names (in the B-slot
        `cell`: the end of the tick)."""
        P = self.prog.P
        with jax.named_scope("pipe_send"):
            arrived_f = jax.lax.ppermute(carry.out_fwd, PIPE, _ring(P, 1))
            if self.BACKWARD:
                arrived_b = jax.lax.ppermute(carry.out_bwd, PIPE, _ring(P, -1))
        inboxes = {"fwd_in": _write(carry.fwd_in, _slot(cell[COL["recv_fwd"]], self.slots["fwd_in"]),
                                    arrived_f)}
        if self.BACKWARD:
            inboxes["bwd_in"] = _write(carry.bwd_in, _slot(cell[COL["recv_bwd"]], self.slots["bwd_in"]),
                                       arrived_b)
        return carry._replace(**inboxes)

    def fwd(self, carry, cell):
        m, v = cell[COL["mb"]], cell[COL["virtual"]]
        k = v * self.prog.P + self.prog.s
        x_in, stats_in = _read(carry.fwd_in, cell[COL["fwd_in"]])
        with jax.named_scope("pipe_first"):
            first, x0, stats_in = jax.lax.cond(
                k == 0, functools.partial(self.first, m=m, cell=cell),
                lambda state: (state, x_in, stats_in), _fields(carry, self.FIRST))
        y, stats_c, carry = self.chunk(carry, x0, m, v, cell)
        stats_out = self.prog.stats_write(stats_in, stats_c, k)
        with jax.named_scope("pipe_last"):
            head = jax.lax.cond(
                k == self.prog.K - 1, functools.partial(self.head, y=y, stats=stats_out, m=m, cell=cell),
                _kept, _fields(carry, self.HEAD))
        return carry._replace(**dict(zip(self.FIRST, first, strict=True)),
                              **dict(zip(self.HEAD, head, strict=True)),
                              out_fwd=_vary((y, stats_out)))


class _TrainTicks(_Ticks):
    """Training: FWD through `jax.vjp`, the VJPs' residuals kept in the stash / prologue
    buffers, the head's cotangent left in bwd_in; BWD applies them (module docstring)."""

    BACKWARD = True
    FIRST = ("prologue",)
    HEAD = ("bwd_in", "g_head", "parts")

    def __init__(self, prog: StageProgram, schedule: sched_lib.Schedule, batch_BX, rng):
        super().__init__(prog, schedule, batch_BX)
        self.keys_I = None if rng is None else jax.random.split(rng, self.M)
        self.pro_saver, self.body_saver = SavedVJP(), SavedVJP()

    def key_of(self, m):
        return None if self.keys_I is None else self.keys_I[m]

    # ---- the forward pieces through jax.vjp (used by the probe and the FWD op) ----------
    def prologue_vjp(self, m):
        prog = self.prog
        fn = _stashable(lambda p: prog.prologue(p, self.inputs(m), self.positions(m)),
                        self.cfg.remat)
        x, vjp = jax.vjp(fn, prog.prologue_params)
        return x, self.pro_saver.save(vjp, prog.prologue_params)

    def body_vjp(self, x_BTD, m, v):
        """The chunk's MoE blocks forward, one `jax.vjp` per block in a scan: -> (x,
        RouterStats [c, ...], the blocks' residuals stacked [c, ...]). A block's weights
        are read from the stage's [V * c] rows where it runs (no copy of the chunk's
        rows), and BWD adds each block's weight gradients to its row of the float32 sums
        as it goes (no [c, ...] stack of them)."""
        prog, c = self.prog, self.prog.c
        keys = prog.layer_keys(self.key_of(m), v)
        keep = jax.lax.dynamic_slice_in_dim(prog.keep, v * c, c)
        pos = self.positions(m)

        def step(x, xs):
            i, state_i, key_i, keep_i, window_i = xs
            p_i = prog.layer_rows(prog.stage_params, v * c + i)
            fn = _stashable(lambda p, x: prog.layer(p, x, state_i, key_i, keep_i, pos, window_i),
                            self.cfg.remat)
            (y, stats_i), vjp = jax.vjp(fn, p_i, x)
            return y, (stats_i, self.body_saver.save(vjp, p_i))

        xs = (jnp.arange(c), prog.chunk_rows(prog.stage_state, v), keys, keep,
              prog.chunk_windows(v))
        y, (stats_c, res) = jax.lax.scan(step, x_BTD, xs, unroll=self.cfg.scan_unroll)
        return y, stats_c, res

    def init_carry(self) -> _Carry:
        """Zeros of everything a tick keeps. Their shapes are traced once (nothing
        computed), with inputs typed as in the scan, so the residuals come out exactly as
        there."""
        prog = self.prog
        x_shape, pro_res_shape = jax.eval_shape(lambda: self.prologue_vjp(_stage_index()))
        _, stats_c_shape, body_res_shape = jax.eval_shape(
            lambda: self.body_vjp(_zeros(x_shape), _stage_index(), _stage_index()))
        self.stats_shape = _stats_buffer_shape(stats_c_shape, prog.chunks.n_layers, prog.c)
        parts_shape = jax.eval_shape(
            lambda: prog.head_loss(prog.head_params, jnp.zeros(x_shape.shape, x_shape.dtype),
                                   _zeros(self.stats_shape), self.targets(0), self.M,
                                   self.row_end(0))[1])
        slots = self.slots
        act = (x_shape, self.stats_shape)
        return _Carry(
            stash=_zeros(body_res_shape, slots["stash"], axes=None),
            prologue=_zeros(pro_res_shape, slots["prologue"], axes=None),
            fwd_in=_zeros(act, slots["fwd_in"] + 1),  # + 1: the scratch slot
            bwd_in=_zeros(act, slots["bwd_in"] + 1),
            out_fwd=_zeros(act),
            out_bwd=_zeros(act),
            g_stage=_zeros(prog.stage_params, axes=None, dtype=jnp.float32),
            g_prologue=_zeros(prog.prologue_params, axes=None, dtype=jnp.float32),
            g_head=_zeros(prog.head_params, axes=None, dtype=jnp.float32),
            parts=_zeros(parts_shape, axes=(PIPE,)),
        )

    # ---- FWD -------------------------------------------------------------------------
    def first(self, state, m, cell):
        (bufs,) = state
        x0, res = self.prologue_vjp(m)
        return (_write(bufs, cell[COL["prologue"]], res),), x0, _zeros(self.stats_shape)

    def chunk(self, carry: _Carry, x0, m, v, cell):
        y, stats_c, res = self.body_vjp(x0, m, v)
        return y, stats_c, carry._replace(stash=_write(carry.stash, cell[COL["stash"]], res))

    def head(self, state, y, stats, m, cell):
        """The head and loss forward and backward at once; the cotangent into bwd_in."""
        bwd_in, g_head, parts = state
        prog = self.prog
        (loss, vjp, parts_m) = jax.vjp(
            lambda p, x, st: prog.head_loss(p, x, st, self.targets(m), self.M, self.row_end(m)),
            prog.head_params, y, stats, has_aux=True)
        # d(step loss) / d(this microbatch's share) = 1, typed like the loss
        g, dx, dstats = vjp(_vary(jnp.ones((), loss.dtype), _own_axes(loss)))
        bwd_in = _write(bwd_in, cell[COL["head_out"]], (dx, dstats))
        g_head = jax.tree.map(_add, g_head, g)
        parts = jax.tree.map(jnp.add, parts, _vary(parts_m, (PIPE,)))
        return bwd_in, g_head, parts

    # ---- BWD -------------------------------------------------------------------------
    def bwd(self, carry: _Carry, cell):
        """BWD (m, v): the chunk's VJP, rebuilt from the stash, on the inbox cotangent; its
        weight gradients added to the chunk's rows; for k = 0 the prologue's VJP."""
        prog, c = self.prog, self.prog.c
        v = cell[COL["virtual"]]
        k = v * prog.P + prog.s
        dy, dstats_out = _read(carry.bwd_in, cell[COL["bwd_in"]])

        def step(acc, xs):  # the blocks in reverse order, each VJP rebuilt from the stash
            dy, g_stage = acc
            i, res_i, dstats_i = xs
            row = v * c + i
            vjp = self.body_saver.restore(res_i, prog.layer_rows(prog.stage_params, row))
            d_layer, dx = vjp((dy, dstats_i))
            # The row index through a barrier with the gradients: the float32 row is read
            # where it is added to (in place), not sliced beside the block's weights
            # before its backward (XLA fuses slices that share an index: 9.7 GB held).
            row, d_layer = jax.lax.optimization_barrier((row, d_layer))
            g_stage = jax.tree.map(
                lambda g, d: jax.lax.dynamic_update_index_in_dim(
                    g, _add(jax.lax.dynamic_index_in_dim(g, row, 0, keepdims=False), d), row, 0),
                g_stage, d_layer)
            return (dx, g_stage), None

        xs = (jnp.arange(c), _read(carry.stash, cell[COL["stash"]]), prog.stats_rows(dstats_out, k, v))
        (dx, g_stage), _ = jax.lax.scan(step, (dy, carry.g_stage), xs, reverse=True,
                                        unroll=self.cfg.scan_unroll)
        with jax.named_scope("pipe_first"):
            g_pro = jax.lax.cond(k == 0, functools.partial(self.bwd_first, dx=dx, carry=carry, cell=cell),
                                 _kept, carry.g_prologue)
        return carry._replace(g_stage=g_stage, g_prologue=g_pro,
                              out_bwd=_vary((dx, prog.stats_clear(dstats_out, k))))

    def bwd_first(self, g_pro, dx, carry: _Carry, cell):
        """The prologue's VJP (embedding and dense-block gradients), for chunk 0."""
        pro_vjp = self.pro_saver.restore(_read(carry.prologue, cell[COL["prologue"]]),
                                         self.prog.prologue_params)
        (d_pro,) = pro_vjp(dx)
        return jax.tree.map(_add, g_pro, d_pro)

    # ---- after the last tick ---------------------------------------------------------
    def result(self, carry: _Carry, params):
        """((loss, LossParts), grads) of the step from the final carry."""
        parts = jax.lax.psum(carry.parts, PIPE)  # only the last stage computed losses
        parts = parts._replace(**{f: getattr(parts, f) / self.M
                                  for f in ("lb_loss", "z_loss", "lb_L", "z_L")})
        return (total_loss(parts, self.cfg), parts), _grads(carry, params)


def _grads(carry: _Carry, params):
    """The gradients in the params' tree: the stage's chunk rows, and the prologue's and
    head's (summed where a weight is both: tied embeddings)."""
    grads = {STAGE_KEY: carry.g_stage}
    for key in params.keys():
        if key == STAGE_KEY:
            continue
        pieces = [g[key] for g in (carry.g_prologue, carry.g_head) if key in g]
        grads[key] = pieces[0] if len(pieces) == 1 else jax.tree.map(jnp.add, *pieces)
    # The params' own tree type (subtrees may have come back as dicts).
    return jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(nnx.State(grads)))


class _EvalCarry(NamedTuple):
    fwd_in: tuple  # (x [slots + 1, ...], RouterStats of [slots + 1, ...])
    out_fwd: tuple
    sums: tuple  # (ce_sum, n_tokens) over this stage's microbatches


class _EvalTicks(_Ticks):
    """Evaluation: forwards only, the last chunk summing cross-entropy and tokens."""

    HEAD = ("sums",)

    def prologue(self, m):
        return self.prog.prologue(self.prog.prologue_params, self.inputs(m), self.positions(m))

    def body(self, x, m, v):
        prog = self.prog
        return prog.body(prog.chunk_rows(prog.stage_params, v), x, v, self.positions(m), None)

    def act_shapes(self) -> tuple:
        """The shapes of what a stage sends on, (x, RouterStats buffer), traced once
        (nothing computed); sets `stats_shape`."""
        x_shape = jax.eval_shape(lambda: self.prologue(_stage_index()))
        stats_c_shape = jax.eval_shape(
            lambda: self.body(_zeros(x_shape), _stage_index(), _stage_index()))[1]
        self.stats_shape = _stats_buffer_shape(stats_c_shape, self.prog.chunks.n_layers, self.prog.c)
        return x_shape, self.stats_shape

    def init_carry(self) -> _EvalCarry:
        act = self.act_shapes()
        sums = (jax.ShapeDtypeStruct((), jnp.float32),) * 2
        return _EvalCarry(_zeros(act, self.slots["fwd_in"] + 1), _zeros(act), _zeros(sums, axes=(PIPE,)))

    def first(self, state, m, cell):
        return state, self.prologue(m), _zeros(self.stats_shape)

    def chunk(self, carry: _EvalCarry, x0, m, v, cell):
        y, stats_c = self.body(x0, m, v)
        return y, stats_c, carry

    def head(self, state, y, stats, m, cell):
        (sums,) = state
        parts = self.prog.head_loss(self.prog.head_params, y, stats, self.targets(m), self.M,
                                    self.row_end(m))[1]
        return (jax.tree.map(jnp.add, sums, _vary((parts.ce_sum, parts.n_tokens), (PIPE,))),)


class _RowCarry(NamedTuple):
    fwd_in: tuple  # (x [slots + 1, ...], RouterStats of [slots + 1, ...])
    out_fwd: tuple
    outs: tuple  # row_head's outputs of each microbatch: [M, rows / M, ...]


class _RowTicks(_EvalTicks):
    """Per-row outputs (make_rows_fn): forwards only, as _EvalTicks; the last chunk runs
    the LM head and `row_head` on its microbatch's rows, kept at the microbatch's slot."""

    HEAD = ("outs",)

    def __init__(self, prog: StageProgram, schedule: sched_lib.Schedule, inputs_BT, rows, row_head):
        # token windows whose inputs are the rows: a target column no one reads
        super().__init__(prog, schedule, jnp.pad(inputs_BT, ((0, 0), (0, 1))))
        self.rows = tuple(r.reshape((self.M, -1) + r.shape[1:]) for r in rows)
        self.row_head = row_head

    def head_rows(self, head_params, x_BTD, m):
        logits_BTV = self.prog._model(head_params).head(x_BTD)
        return tuple(self.row_head(logits_BTV, self.positions_T, *_read(self.rows, m)))

    def init_carry(self) -> _RowCarry:
        act = self.act_shapes()
        outs = jax.eval_shape(lambda: self.head_rows(self.prog.head_params, _zeros(act[0]), _stage_index()))
        return _RowCarry(_zeros(act, self.slots["fwd_in"] + 1), _zeros(act), _zeros(outs, self.M))

    def head(self, state, y, stats, m, cell):
        (outs,) = state
        return (_write(outs, m, self.head_rows(self.prog.head_params, y, m)),)


def make_grad_fn(schedule: sched_lib.Schedule, chunks: Chunking, graphdef, cfg: TransformerConfig,
                 ops: Plan):
    """grad_fn(params, model_state, batch_BX, rng) -> ((loss, LossParts), grads): the mean
    over the schedule's M microbatches (rows of batch_BX split in M, in order), like
    M-step gradient accumulation on one device; params / grads in the compute layout."""
    table = np.asarray(schedule.table)

    def grad_fn(params, model_state, batch_BX, rng):
        prog = StageProgram(graphdef, cfg, chunks, params, model_state, ops)
        ticks = _TrainTicks(prog, schedule, batch_BX, rng)
        return ticks.result(ticks.run(ticks.init_carry(), table), params)

    return grad_fn


def make_eval_fn(stages: int, virtual: int, microbatches: int, chunks: Chunking, graphdef,
                 cfg: TransformerConfig, ops: Plan):
    """eval_fn(params, model_state, batch_BX) -> (ce_sum, n_tokens): forwards only, the
    local rows split into `microbatches` when they divide (else one)."""

    def eval_fn(params, model_state, batch_BX):
        rows = batch_BX.shape[0]
        M = microbatches if rows % microbatches == 0 else 1
        schedule = sched_lib.forward_only(stages, virtual, M)
        prog = StageProgram(graphdef, cfg, chunks, params, model_state, ops)
        ticks = _EvalTicks(prog, schedule, batch_BX)
        return jax.lax.psum(ticks.run(ticks.init_carry(), schedule.table).sums, PIPE)

    return eval_fn


def make_rows_fn(stages: int, virtual: int, microbatches: int, chunks: Chunking, graphdef,
                 cfg: TransformerConfig, ops: Plan, row_head):
    """rows_fn(params, model_state, inputs_BT, *rows) -> row_head's per-row outputs for every
    local row: forwards only through the stages (the local rows split into `microbatches`
    when they divide, else one), as eval_fn. On the last chunk, per microbatch,
    `row_head(logits_BTV, positions_T, *rows) -> tuple of [rows, ...]` sees the logits of the
    positions `positions_T` (the whole row, or with context parallelism this rank's zig-zag
    shard: their global indices) and the microbatch's whole `rows`; each output must be a
    sum over those positions, so that the shards' outputs add up to the row's (they are
    summed over `context`, and over `pipe`, where only the last stage holds them). Rows
    are scored without document masking, as the one-device and the non-pipeline scorers
    (evals/score.py) score them."""
    cfg = dataclasses.replace(cfg, doc_mask_eos=-1)

    def rows_fn(params, model_state, inputs_BT, *rows):
        n = inputs_BT.shape[0]
        M = microbatches if n % microbatches == 0 else 1
        schedule = sched_lib.forward_only(stages, virtual, M)
        prog = StageProgram(graphdef, cfg, chunks, params, model_state, ops)
        ticks = _RowTicks(prog, schedule, inputs_BT, rows, row_head)
        outs = jax.lax.psum(ticks.run(ticks.init_carry(), schedule.table).outs, (PIPE, CONTEXT_AXIS))
        return tuple(o.reshape((n,) + o.shape[2:]) for o in outs)

    return rows_fn
