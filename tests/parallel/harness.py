"""Shared pieces of the parallel tests: one tiny MoE config (and a deeper variant with a
dense-first block for the pipeline tests), its parameters initialized once on the host,
deterministic batches, and runners cached per configuration so each
mesh/strategy/backend/pipeline compiles exactly one program (the trainer's jitted train
step) per test session.

The optimizer is the config's AdamW preceded by a pass-through that keeps the gradients
it receives in its state (`recording`), so one compiled train step yields both the
gradients of the first batch and the loss curve. Programs are compiled with XLA's backend
optimization level 0: the same HLO and collectives, less LLVM time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from olmo_jax.config import default_config, model_config
from olmo_jax.model.abstract import abstract_model
from olmo_jax.optim import build_optimizer
from olmo_jax.trainer.state import init_state
from olmo_jax.trainer.step import make_train_step
from tests.sections import plan_for

FAST_COMPILE = {"xla_backend_optimization_level": 0}
VOCAB, BATCH, SEQ, STEPS = 64, 8, 16, 5
DOC_EOS = 1  # the EOS id of the packed-document batches (`batches(docs=True)`)
# Where a packed row's documents end (EOS input positions, shifted by the row's index):
# documents of 2-4 tokens whose ends straddle the zig-zag chunks of context 2 (chunks of
# 4 inputs) and 4 (chunks of 2), so most documents cross a shard boundary.
DOC_ENDS = (2, 6, 9, 13)
NO_DROP_CF = 4.0  # >= num_experts / top_k: rowwise can never drop


class Pipe(NamedTuple):
    """parallel.pipe and its schedule fields (pipe=1: no pipeline)."""
    pipe: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1


NO_PIPE = Pipe()


def make_cfg(data=1, expert=1, dispatch="rowwise", strategy="ddp", zero1=True, grad_accum=1,
             capacity_factor=NO_DROP_CF, lb_granularity="global", batch=BATCH, seq=SEQ,
             layers=(2, 0), pipe: Pipe = NO_PIPE, width=32, optim="adamw", context=1):
    """`layers`: (model.n_layers, model.n_dense_layers); `width`: model.d_model and
    model.moe.expert_hidden (64 for the Pallas kernels' tiles); `optim`: optim.name."""
    c = default_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_heads = VOCAB, width, 2
    m.n_layers, m.n_dense_layers = layers
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 8, 2, width
    m.moe.lb_granularity = lb_granularity
    # 3e-3: the default OLMo-core layout (post-norm) of the 10-block pipeline model trains
    # unstably at 1e-2, where float rounding grows ~20x a step (curves 1e-3 apart after 5
    # steps on every correct plan); at 3e-3 the curves of every plan agree to 5e-7.
    c.optim.lr, c.optim.warmup_steps, c.optim.name = 3e-3, 1, optim
    p = c.parallel
    p.data, p.expert, p.dispatch, p.strategy = data, expert, dispatch, strategy
    p.zero1, p.context = zero1, context
    # The capacity of rowwise dispatch's receive slots; every other dispatch stays dropless.
    rowwise = strategy == "ddp" and expert > 1 and dispatch == "rowwise"
    m.moe.capacity_factor = capacity_factor if rowwise else 0.0
    p.pipe, p.pipeline_schedule, p.microbatches, p.virtual_stages = pipe
    t = c.trainer
    t.global_batch_size, t.seq_len, t.grad_accum, t.max_steps = batch, seq, grad_accum, 20
    return c


def with_capacity(model_cfg, cfg):
    """`model_cfg` (e.g. host_state's) with the capacity factor `make_cfg` gave `cfg`: the
    rowwise receive slots of an expert-parallel plan (0 elsewhere, as host_state's)."""
    moe = dataclasses.replace(model_cfg.moe, capacity_factor=cfg.model.moe.capacity_factor)
    return dataclasses.replace(model_cfg, moe=moe)


def recording(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """tx preceded by a pass-through whose state is the last gradients it saw."""
    keep = optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (grads, grads),
    )
    return optax.chain(keep, tx)


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


@functools.cache
def host_state(lb_granularity="global", layers=(2, 0), moe=(), width=32, optim="adamw",
               dtype="float32"):
    """(model_cfg, tx, schedule, graphdef, state): built once; the state as numpy. `moe`:
    (field, value) pairs replacing model.moe fields that change no parameter (gmm_impl,
    precision), so every variant starts from the same weights; `dtype`: model.dtype (the
    params stay float32)."""
    cfg = make_cfg(lb_granularity=lb_granularity, layers=layers, width=width, optim=optim)
    model_cfg = model_config(cfg)
    model_cfg = dataclasses.replace(model_cfg, moe=dataclasses.replace(model_cfg.moe, **dict(moe)),
                                    dtype=dtype)
    tx, schedule = build_optimizer(cfg.optim, cfg.trainer.max_steps)
    tx = recording(tx)
    graphdef, state = init_state(model_cfg, tx, cfg.trainer.seed)
    # Host copies: every run places its own (donated) device buffers.
    return model_cfg, tx, schedule, graphdef, to_numpy(state)


def batches(steps=STEPS, batch=BATCH, seq=SEQ, seed=0, docs=False) -> np.ndarray:
    """[steps, batch, seq + 1] int32 token windows: counting sequences (next = this + 1 mod
    VOCAB) from random starts with 10% random tokens, so a few steps visibly learn. `docs`:
    packed documents, DOC_EOS ending each at the DOC_ENDS positions (+ the row's index, mod
    seq; every fourth row is one document)."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, (steps, batch, 1))
    tokens = (start + np.arange(seq + 1)) % VOCAB
    noise = rng.random(tokens.shape) < 0.1
    tokens = np.where(noise, rng.integers(0, VOCAB, tokens.shape), tokens).astype(np.int32)
    if docs:
        tokens[tokens == DOC_EOS] = DOC_EOS + 1  # EOS only where a document ends
        for b in range(batch):
            if b % 4 != 3:
                tokens[:, b, [(e + b) % seq for e in DOC_ENDS]] = DOC_EOS
    return tokens


@dataclasses.dataclass(frozen=True)
class Run:
    metrics: list  # per step: the train step's metrics (numpy)
    grads: object  # gradients of the first batch (numpy, the params' structure)
    step: object  # the compiled train step
    state: object  # the state after STEPS steps (on the device(s))
    batch: object  # the last batch, placed as the step expects it
    lowered_step: object  # the step as JAX lowered it (jax.stages.Lowered)

    @property
    def curve(self) -> np.ndarray:
        return np.array([m["loss"] for m in self.metrics])

    @functools.cached_property
    def hlo(self) -> str:
        """The compiled train step (HLO text)."""
        return self.step.as_text()

    @functools.cached_property
    def lowered(self) -> str:
        """The step as JAX lowered it (HLO text, before XLA's passes): converted only for
        the tests that read it (~0.5 s a program)."""
        return self.lowered_step.as_text(dialect="hlo")


def _abstract(tree):
    """ShapeDtypeStructs (with the arrays' shardings) of a tree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _execute(step, state, placed_batches, abstract=False) -> Run:
    """`abstract`: compile from ShapeDtypeStructs (nothing allocated), then run."""
    args = (state, placed_batches[0])
    lowered = step.lower(*(_abstract(args) if abstract else args))
    compiled = lowered.compile(FAST_COMPILE)
    metrics, grads = [], None
    for b in placed_batches:
        state, m = compiled(state, b)
        metrics.append(to_numpy(m))
        grads = to_numpy(state.opt_state[0]) if grads is None else grads
    return Run(metrics, grads, compiled, state, placed_batches[-1], lowered)


def with_docs(model_cfg, docs: bool, doc_mask: bool):
    """`model_cfg` masking the documents of `batches(docs=True)` (model.doc_mask_eos) when
    `doc_mask` (the weights do not change)."""
    if doc_mask and not docs:
        raise ValueError("doc_mask=True needs the packed-document batches (docs=True)")
    return dataclasses.replace(model_cfg, doc_mask_eos=DOC_EOS) if doc_mask else model_cfg


def with_windows(model_cfg, windows: tuple[int, ...]):
    """`model_cfg` with sliding windows: model.window_pattern `windows` cycled over the
    layers from layer 0, no layer forced full, and OLMo 3's long-context RoPE: YaRN (x2
    from 8 tokens) on the full-attention layers only, so the layers' RoPE tables differ by
    window (the weights do not change)."""
    if not windows:
        return model_cfg
    return dataclasses.replace(model_cfg, window_pattern=windows, window_full_first=False,
                               window_full_last=False, rope_scaling="yarn",
                               rope_scaling_factor=2.0, rope_old_context_len=8,
                               rope_scaling_layers="full")


@functools.cache
def reference_run(grad_accum=1, batch=BATCH, layers=(2, 0), moe=(), width=32,
                  optim="adamw", dtype="float32", docs=False, doc_mask=False,
                  windows=()) -> Run:
    """One device, the model's local dispatch, no parallel plan. `docs`: the
    packed-document batches; `doc_mask`: masked from each other (data.doc_mask);
    `windows`: sliding windows (`with_windows`)."""
    model_cfg, tx, schedule, graphdef, state = host_state(layers=layers, moe=moe, width=width,
                                                          optim=optim, dtype=dtype)
    model_cfg = with_windows(with_docs(model_cfg, docs, doc_mask), windows)
    graphdef = abstract_model(model_cfg)[0] if doc_mask or windows else graphdef
    dev = jax.devices()[0]
    step = jax.jit(make_train_step(graphdef, model_cfg, tx, schedule, grad_accum))
    placed = [jax.device_put(b, dev) for b in batches(batch=batch, docs=docs)]
    return _execute(step, jax.device_put(state, dev), placed)


@functools.cache
def plan_run(data, expert, dispatch="rowwise", strategy="ddp", zero1=True, grad_accum=1,
             batch=BATCH, capacity_factor=NO_DROP_CF, layers=(2, 0), pipe: Pipe = NO_PIPE,
             remat="none", abstract=False, moe=(), width=32, optim="adamw",
             dtype="float32", steps=STEPS, lm_loss_chunk=0, context=1,
             context_attention="ring", docs=False, doc_mask=False, windows=()) -> Run:
    """The same on a pipe x data x expert mesh through the trainer's ParallelPlan and
    its jitted step (state shardings, donation). `remat`, `lm_loss_chunk`: model.remat,
    model.lm_loss_chunk (same weights);
    `abstract`: compile from ShapeDtypeStructs; `moe`, `dtype`: as host_state; `optim`:
    optim.name; `steps`: the first `steps` of the reference's batches (fewer for slow paths);
    `context`, `context_attention`: parallel.context (on data x context x expert devices
    of the 8) and model.context_attention; `docs`, `doc_mask`, `windows`: as reference_run."""
    model_cfg, tx, schedule, _, state = host_state(layers=layers, moe=moe, width=width,
                                                   optim=optim, dtype=dtype)
    cfg = make_cfg(data, expert, dispatch, strategy, zero1, grad_accum, capacity_factor,
                   batch=batch, layers=layers, pipe=pipe, width=width, optim=optim,
                   context=context)
    model_cfg = with_capacity(dataclasses.replace(model_cfg, remat=remat, lm_loss_chunk=lm_loss_chunk,
                                                  context_attention=context_attention), cfg)
    model_cfg = with_windows(with_docs(model_cfg, docs, doc_mask), windows)
    n = pipe.pipe * data * expert * context
    plan = plan_for(cfg, model_cfg, devices=jax.devices()[:n] if n < jax.device_count() else None)
    model_cfg = plan.model_cfg  # kernels resolved for the mesh
    graphdef = abstract_model(model_cfg, plan.dispatcher)[0]
    shardings = plan.state_shardings(state, tx)
    step = plan.jit_train_step(
        make_train_step(graphdef, model_cfg, tx, schedule, grad_accum, parallel=plan), shardings)
    placed = [plan.place_batch(b) for b in batches(batch=batch, docs=docs)[:steps]]
    return _execute(step, jax.device_put(state, shardings), placed, abstract)


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (0 when both are all zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / scale) if scale > 0 else float(np.max(np.abs(a)))
