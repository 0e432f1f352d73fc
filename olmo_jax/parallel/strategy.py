"""A run's parallel execution plan, from the config: mesh, strategy (ddp | fsdp), the
MoE dispatcher, where every state leaf lives, how the batch is laid out, and the
shard_map wrappers the train/eval steps run under.

The whole forward and backward pass runs per device inside one `jax.shard_map` over the
mesh, so every collective is explicit: expert dispatch (expert.py backends), the
router-statistics and loss sums (`allsum`), and parameter gather / gradient reduction
(zero.py; for a bf16 model the matmul weights' compute copies are cast before they are
gathered, `with_compute_dtypes`, and gradients reduced in fp32). The optimizer update
runs outside, elementwise on the stored shards; Muon's Newton-Schulz, which is not
elementwise, runs in its own shard_map on whole matrices, each owned by one data-parallel
rank (muon_owners.py, `optimizer_args`).

    plan = build_plan(run.parallel, run.trainer, model_cfg, optim=run.optim)  # checked against the devices
    model_cfg = plan.model_cfg                 # kernels resolved for the mesh (plan.kernels)
    graphdef, state = init_state(model_cfg, tx, seed, dispatcher=plan.dispatcher)
    shardings = plan.state_shardings(state, tx)
    step = plan.jit_train_step(make_train_step(..., parallel=plan), shardings)
    state, metrics = step(state, plan.place_batch(batch_BX))

Batch layout: a global batch [B, T+1] is placed as [grad_accum, B / grad_accum, T+1]
with the middle axis split over data x expert (and replicated over `context`: each
context rank takes its zig-zag shard of the tokens inside the step, objective.py), so microbatch i is the same set of
sequences on any mesh (rows i*B/ga .. (i+1)*B/ga - 1 of the global batch). With a
pipeline (parallel.pipe > 1, `pipeline`: olmo_jax/parallel/pipeline) the leading axis is
grad_accum x parallel.microbatches: every pipeline microbatch is such a row block too.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmo_jax.errors import ConfigError
from olmo_jax.kernels import platform
from olmo_jax.kernels.ring_attention import pairs_possible
from olmo_jax.kernels.select import KernelChoice, resolve_kernels
from olmo_jax.kernels.vma import varying_axes
from olmo_jax.model.abstract import abstract_model
from olmo_jax.model.config import TransformerConfig
from olmo_jax.model.params import compute_copy_dtype, path_name
from olmo_jax.optim.config import OptimConfig
from olmo_jax.parallel import expert as expert_lib
from olmo_jax.parallel import mesh as mesh_lib
from olmo_jax.parallel import muon_owners as muon_lib
from olmo_jax.parallel import rules, zero
from olmo_jax.parallel.config import ParallelConfig
from olmo_jax.parallel.mesh import BATCH_AXES, TOKEN_AXES
from olmo_jax.parallel.pipeline import Pipeline, build_pipeline, check_unpipelined

BATCH_SPEC = rules.logical_to_spec((None, "act_batch", None))  # [microbatch, rows, tokens]


class BatchSettings(Protocol):
    """What a plan reads of the run's `trainer` section (trainer/config.TrainerConfig, a
    row above this package, satisfies it)."""
    global_batch_size: int
    grad_accum: int


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelPlan:
    mesh: Mesh
    strategy: str  # ddp | fsdp
    zero1: bool
    grad_accum: int
    dispatch: str  # the expert-parallel backend, or "local" (no expert parallelism)
    dispatcher: Callable | None  # the MoE layer's dispatcher (None = local_dispatch)
    layouts: object  # tree of zero.ParamLayout, the params' structure
    pipeline: Pipeline | None = None  # parallel.pipe > 1
    muon: muon_lib.Ownership | None = None  # optim.name=muon: who orthogonalizes what
    # The kernels resolved for the mesh's target (olmo_jax/kernels/select.py), and the
    # model config the steps are built with: the one given, with those names in
    # moe.gmm_impl, attention_impl, norm_impl and mxfp8_gemm_impl.
    kernels: KernelChoice | None = None
    model_cfg: TransformerConfig | None = None

    def optimizer_args(self) -> dict:
        """Extra arguments of the optimizer's update on this mesh (Muon's orthogonalize)."""
        if self.muon is None:
            return {}
        return {"orthogonalize": muon_lib.make_orthogonalize(self.muon, self.mesh)}

    @property
    def target(self) -> platform.Target:
        """The platform the steps are traced for: the mesh's devices (abstract GPUs in a
        deviceless compile), not jax.default_backend(); inside platform.cross_lowering()
        (a CPU host lowering for CUDA) an H100."""
        return plan_target(self.mesh)

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per accumulation step (1 without a pipeline)."""
        return 1 if self.pipeline is None else self.pipeline.microbatches

    # ---- placement -------------------------------------------------------------------
    def _specs(self, field: str):
        return jax.tree.map(lambda lay: getattr(lay, field), self.layouts,
                            is_leaf=lambda x: isinstance(x, zero.ParamLayout))

    def storage_specs(self):
        return self._specs("storage")

    def param_shardings(self):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.storage_specs(),
                            is_leaf=rules.is_spec)

    def state_shardings(self, state, tx: optax.GradientTransformation):
        """TrainState of NamedShardings: params and their AdamW moments as stored,
        everything else replicated."""
        return state_shardings(state, tx, self.mesh, self.param_shardings())

    def optimizer_bytes(self, state, tx: optax.GradientTransformation) -> tuple[int, int]:
        """Per-device bytes of the optimizer state as stored, and as they would be with every
        moment replicated over its parameter's data-parallel devices (ZeRO-1 off)."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        compute = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._specs("compute"),
                               is_leaf=rules.is_spec)
        unsharded = optax.tree_utils.tree_map_params(
            tx, _mirror, state.opt_state, compute,
            transform_non_params=lambda _: replicated, is_leaf=_masked,
        )
        stored = self.state_shardings(state, tx).opt_state
        return (zero.per_device_bytes(state.opt_state, stored),
                zero.per_device_bytes(state.opt_state, unsharded))

    def placement(self, state, tx: optax.GradientTransformation) -> list[str]:
        """One line per state leaf: 'path shape spec' (params, then optimizer state)."""
        shardings = self.state_shardings(state, tx)
        lines = []
        for part in ("params", "opt_state"):
            leaves = jax.tree_util.tree_leaves_with_path(getattr(state, part))
            shs = jax.tree.leaves(getattr(shardings, part),
                                  is_leaf=lambda x: isinstance(x, NamedSharding))
            for (path, x), sh in zip(leaves, shs, strict=True):
                shape = "x".join(map(str, x.shape)) or "scalar"
                lines.append(f"{part}/{path_name(path)} {shape} {tuple(sh.spec)}")
        return lines

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, BATCH_SPEC)

    def batch_shape(self, global_batch: int, seq_len: int,
                    grad_accum: int | None = None) -> tuple[int, int, int]:
        """The placed batch's shape [ga x M, B/(ga x M), T+1] (M: pipeline microbatches;
        evaluation passes grad_accum=1 and gets M = 1)."""
        ga = self.grad_accum * self.microbatches if grad_accum is None else grad_accum
        check_batch(global_batch, self.mesh, ga, "the batch")
        return ga, global_batch // ga, seq_len + 1

    def place_batch(self, batch_BX, grad_accum: int | None = None) -> jax.Array:
        """[B, T+1] host (or device) tokens -> `batch_shape` on the mesh."""
        batch_BX = np.asarray(batch_BX)
        B, T1 = batch_BX.shape
        shape = self.batch_shape(B, T1 - 1, grad_accum)
        return jax.device_put(batch_BX.reshape(shape), self.batch_sharding())

    def jit_train_step(self, train_step, state_shardings):
        """train_step(state, batch) -> (state, metrics) jitted for this mesh: state in and
        out with `state_shardings` (donated), batch as `batch_sharding`, metrics replicated."""
        return jax.jit(
            train_step,
            in_shardings=(state_shardings, self.batch_sharding()),
            out_shardings=(state_shardings, NamedSharding(self.mesh, PartitionSpec())),
            donate_argnums=0,
        )

    # ---- inside the shard_map --------------------------------------------------------
    def _for_target(self, fn):
        """fn traced for the mesh's devices: the kernels' lowering parameters (SM count,
        native collectives, the Pallas kernels' platform check) read this target. The
        kernel choice is not made here: it is `kernels`, resolved once by build_plan."""
        target = self.target

        @functools.wraps(fn)
        def traced(*args):
            with platform.targeting(target):
                return fn(*args)

        return traced

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes whose devices hold different tokens: data x expert (the batch's rows),
        and `context` with context parallelism (without it the programs name only the
        batch axes, as before the axis existed)."""
        return TOKEN_AXES if self.mesh.shape[mesh_lib.CONTEXT_AXIS] > 1 else BATCH_AXES

    def _sum_axes(self, x) -> tuple[str, ...]:
        """token_axes, and the size-1 `context` too where x is typed varying over it (the
        pipeline types its values varying over every mesh axis)."""
        axes = self.token_axes
        if mesh_lib.CONTEXT_AXIS not in axes and mesh_lib.CONTEXT_AXIS in varying_axes(x):
            return TOKEN_AXES
        return axes

    def allsum(self, tree):
        """Sum over every device holding a different part of the batch (its rows over
        data x expert, their tokens over context)."""
        leaves = jax.tree.leaves(tree)
        axes = {self._sum_axes(x) for x in leaves}
        with jax.named_scope("loss_allsum"):
            if len(axes) <= 1:  # one (variadic) all-reduce
                return jax.lax.psum(tree, axes.pop() if axes else self.token_axes)
            return jax.tree.map(lambda x: jax.lax.psum(x, self._sum_axes(x)), tree)

    def allgather(self, x):
        """Stack x over the devices holding the batch's parts, in batch order: [shards, ...].
        A psum of each device's slot (not all_gather), so the result is typed replicated."""
        shards = mesh_lib.token_shards(self.mesh)
        with jax.named_scope("metrics_allgather"):
            axes = self._sum_axes(x)
            slot = jax.nn.one_hot(jax.lax.axis_index(axes), shards, dtype=x.dtype)
            return jax.lax.psum(slot.reshape((shards,) + (1,) * x.ndim) * x[None], axes)

    def use_params(self, params):
        """Applied inside each microbatch's loss: FSDP gathers here, ddp already has them."""
        return zero.gather_for_use(params, self.layouts) if self.strategy == "fsdp" else params

    def _outer_gather(self, params):
        if self.pipeline is not None:  # this stage's chunks, gathered
            return self.pipeline.gather(params)
        return zero.gather(params, self.layouts) if self.strategy == "ddp" else params

    def shard_grads(self, grads_and_parts):
        """grads_and_parts(params, model_state, batch_BX, rng) -> (grads, parts), written
        for one device, becomes a function of the global (stored) arrays: grads come back in
        the params' storage placement, parts (already allsum'ed) replicated. Each batch
        shard draws its randomness (router jitter, random routing) from `rng` folded with
        its index."""

        @self._for_target
        def local(params, model_state, batch, rng):
            params = self._outer_gather(params)
            rng = jax.random.fold_in(rng, jax.lax.axis_index(self.token_axes))
            grads, parts = grads_and_parts(params, model_state, batch.reshape(-1, batch.shape[-1]), rng)
            if self.pipeline is not None:
                grads = self.pipeline.reduce(grads)
            elif self.strategy == "ddp":
                grads = zero.reduce(grads, self.layouts)
            return grads, parts

        specs = self.storage_specs()
        return jax.shard_map(
            local, mesh=self.mesh,
            in_specs=(specs, PartitionSpec(), BATCH_SPEC, PartitionSpec()),
            out_specs=(specs, PartitionSpec()),
        )

    def shard_eval(self, eval_step):
        """eval_step(params, model_state, batch_BX) -> replicated sums, on the mesh."""

        @self._for_target
        def local(params, model_state, batch):
            return eval_step(self._outer_gather(params), model_state,
                             batch.reshape(-1, batch.shape[-1]))

        return jax.shard_map(
            local, mesh=self.mesh,
            in_specs=(self.storage_specs(), PartitionSpec(), BATCH_SPEC),
            out_specs=PartitionSpec(),
        )

    def shard_rows(self, row_fn, n_rows: int):
        """row_fn(params, model_state, *rows) -> a tuple of per-row arrays, on the mesh: each
        of the `n_rows` inputs and every output is [1, rows, ...] (rows split like an eval
        batch's, BATCH_SPEC); row_fn sees its device's rows without the leading 1, and the
        parameters as eval_step does (on a pipeline plan the stage's chunks: row_fn is then
        `pipeline.rows_fn`'s); its outputs must not differ over `pipe` or `context`."""

        @self._for_target
        def local(params, model_state, *rows):
            outs = row_fn(self._outer_gather(params), model_state, *(r[0] for r in rows))
            return tuple(o[None] for o in outs)

        return jax.shard_map(
            local, mesh=self.mesh,
            in_specs=(self.storage_specs(), PartitionSpec()) + (BATCH_SPEC,) * n_rows,
            out_specs=BATCH_SPEC,
        )


def _masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _mirror(leaf, sharding):
    """A moment's sharding: its parameter's (optax.partition masks the other group's)."""
    return leaf if _masked(leaf) else sharding


def state_shardings(state, tx: optax.GradientTransformation, mesh: Mesh, param_shardings):
    """A TrainState of NamedShardings: `param_shardings` for the params, the same for the
    optimizer moments that mirror them, everything else replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_utils.tree_map_params(
        tx, _mirror, state.opt_state, param_shardings,
        transform_non_params=lambda _: replicated, is_leaf=_masked,
    )
    return type(state)(
        step=replicated,
        params=param_shardings,
        opt_state=opt_sh,
        model_state=jax.tree.map(lambda _: replicated, state.model_state),
        rng=replicated,
        guard=jax.tree.map(lambda _: replicated, state.guard),  # trainer/guard.py counters
    )


def check_batch(global_batch: int, mesh: Mesh, grad_accum: int,
                what: str = "trainer.global_batch_size", microbatches: int = 1) -> None:
    shards = mesh_lib.batch_shards(mesh)
    if global_batch % (shards * grad_accum * microbatches):
        pipe = " x parallel.microbatches" if microbatches > 1 else ""
        sizes = f" x {microbatches}" if microbatches > 1 else ""
        raise ConfigError(
            f"{what}={global_batch} must be divisible by data x expert x trainer.grad_accum"
            f"{pipe} = {mesh.shape['data']} x {mesh.shape['expert']} x {grad_accum}{sizes} = "
            f"{shards * grad_accum * microbatches}"
        )


def check_model_fits(model_cfg: TransformerConfig, mesh: Mesh, strategy: str, dispatch: str) -> None:
    ep = mesh.shape["expert"]
    E = model_cfg.moe.num_experts
    if strategy == "ddp" and model_cfg.n_moe_layers and E % ep:
        raise ConfigError(
            f"model.moe.num_experts={E} is not divisible by parallel.expert={ep}: every expert "
            f"rank must hold the same number of experts; choose parallel.expert dividing {E}"
        )
    cf = model_cfg.moe.capacity_factor
    if strategy == "ddp" and ep > 1 and dispatch in expert_lib.DROPLESS and cf > 0:
        raise ConfigError(
            f"model.moe.capacity_factor={cf} sizes capacity buffers, but parallel.dispatch="
            f"{dispatch} is dropless; set model.moe.capacity_factor=0 or parallel.dispatch=rowwise"
        )


def check_context(p: ParallelConfig, trainer: BatchSettings, model_cfg: TransformerConfig,
                  pipe: int) -> None:
    """parallel.context > 1: the sequence must split into 2 x context zig-zag chunks, and
    a ring under a pipeline needs a power-of-two context."""
    C = p.context
    if model_cfg.context_parallel not in (1, C):
        raise ConfigError(
            f"model.context_parallel={model_cfg.context_parallel} is set by the plan from "
            f"parallel.context={C}; leave it 1 and set parallel.context")
    if C == 1:
        return
    if pipe != 1 and model_cfg.context_attention == "ring" and not pairs_possible(C):
        # A stage's ops run in conds the other stages skip, and a collective-permute's
        # rendezvous spans every device of the mesh: under a pipeline the ring hops by
        # exchanges inside pairs of context ranks (replica groups inside a stage), which
        # visit every rank for a power-of-two context.
        raise ConfigError(
            f"model.context_attention=ring with parallel.pipe={pipe} needs a power-of-two "
            f"parallel.context, got {C}: choose 2, 4, 8, ... or model.context_attention="
            "allgather")
    if model_cfg.moe.lb_granularity == "instance":
        raise ConfigError(
            f"model.moe.lb_granularity=instance needs each row's router counts on one device, "
            f"but parallel.context={C} splits the rows; use global or local")
    seq_len = getattr(trainer, "seq_len", None)
    if seq_len is not None and seq_len % (2 * C):
        raise ConfigError(
            f"trainer.seq_len={seq_len} must be divisible by 2 x parallel.context = {2 * C} "
            f"(the zig-zag layout's chunks); change trainer.seq_len or parallel.context")


def plan_target(mesh: Mesh) -> platform.Target:
    """The target a plan over `mesh` traces for (ParallelPlan.target)."""
    return platform.cross_lowering_target() or platform.target_of(mesh.devices)


def plan_kernels(model_cfg: TransformerConfig, target: platform.Target) -> KernelChoice:
    """The kernels `model_cfg` runs on `target` (olmo_jax/kernels/select.py), resolved when
    the plan is built: an explicit choice that cannot run there is a ConfigError naming
    the field. Inside platform.interpret() an explicit pallas is allowed on a CPU (tests)."""
    try:
        return resolve_kernels(model_cfg, target, interpret=platform.interpret_params() is not None)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def with_compute_dtypes(layouts, abstract_params, compute_dtype):
    """`layouts` with each weight the model casts at use given `compute_dtype` as its
    compute copy's dtype when that is narrower (model/params.py, zero.py); the rest keep
    None (used as stored)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x, lay: dataclasses.replace(
            lay, dtype=compute_copy_dtype(path, x, compute_dtype)),
        abstract_params, layouts)


def build_plan(parallel: ParallelConfig, trainer: BatchSettings, model_cfg: TransformerConfig,
               *, optim: OptimConfig | None = None, abstract_params=None,
               devices=None) -> ParallelPlan:
    """The plan for a run's validated `parallel` section (its batch from `trainer`:
    global_batch_size, grad_accum; `optim`: Muon's ownership when optim.name=muon). Raises
    ConfigError naming the field for a mesh that does not fit the devices, experts that
    do not divide over `expert`, a batch that does not divide, or a kernel that cannot run
    on the mesh's devices. The model and its steps are built with `plan.model_cfg`
    (`model_cfg` with the kernels resolved, `plan.kernels`)."""
    p = parallel
    mesh = mesh_lib.make_mesh(p, devices)
    if mesh.shape["pipe"] == 1:
        check_unpipelined(p)
    check_context(p, trainer, model_cfg, mesh.shape["pipe"])
    check_model_fits(model_cfg, mesh, p.strategy, p.dispatch)
    kernels = plan_kernels(model_cfg, plan_target(mesh))
    check_batch(trainer.global_batch_size, mesh, trainer.grad_accum,
                microbatches=p.microbatches)
    ep = mesh.shape["expert"]
    if p.strategy == "ddp" and ep > 1:
        dispatcher = expert_lib.make_dispatcher(p.dispatch, model_cfg.moe.capacity_factor)
        dispatch = p.dispatch
    else:
        expert_lib.make_dispatcher(p.dispatch)  # validates the field
        dispatcher, dispatch = None, "local"
    if abstract_params is None:
        abstract_params = abstract_model(model_cfg)[1]
    compute = rules.param_specs(abstract_params, rules.RULES[p.strategy])
    shard = p.zero1 or p.strategy == "fsdp"
    pipeline = None
    if mesh.shape["pipe"] > 1:
        pipeline = build_pipeline(p, model_cfg, mesh, abstract_params, compute, shard)
        layouts = pipeline.layouts
    else:
        layouts = jax.tree.map(
            lambda x, spec: zero.param_layout(x.shape, spec, mesh, shard),
            abstract_params, compute,
        )
    layouts = with_compute_dtypes(layouts, abstract_params, model_cfg.compute_dtype)
    if pipeline is not None:
        pipeline = dataclasses.replace(pipeline, layouts=layouts)
    muon = None
    if optim is not None and optim.name == "muon":
        if pipeline is not None:
            raise ConfigError(
                f"optim.name=muon does not support parallel.pipe={mesh.shape['pipe']} yet: "
                "use parallel.pipe=1 or optim.name=adamw")
        muon = muon_lib.ownership(abstract_params, layouts, mesh)
    # the ring's hops: pair exchanges under a pipeline (check_context)
    hops = "pairs" if mesh.shape["pipe"] > 1 else "permute"
    model_cfg = dataclasses.replace(kernels.apply(model_cfg), context_parallel=p.context,
                                    context_ring_hops=hops)
    return ParallelPlan(mesh, p.strategy, bool(p.zero1), trainer.grad_accum, dispatch,
                        dispatcher, layouts, pipeline, muon, kernels, model_cfg)
