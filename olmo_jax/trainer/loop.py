"""The training loop: build data, mesh, model and optimizer from a config; compile the
step once (ahead of time, checked to fit in memory: preflight.py); train, log, evaluate;
end with a one-screen summary and a text sample.

In a multi-process run (olmo_jax/distributed) every process runs this same loop on its
part of the mesh and reads only its rows of each batch (a grain stream read ahead off this
thread: data/stream.py); process 0 alone prints and writes metrics (to the sinks of
trainer.loggers: sinks.py) and config.json; checkpoints, the data iterator state included,
are saved and restored by all together. SIGTERM / SIGINT save and stop (preemption.py); bad
steps are skipped or halt the run (guard.py); trainer.profile_steps traces steps
(profiler.py). Evaluation (the default split and data.eval_sets) is sharded like training
(evaluation.py). The loop itself only runs steps: the periodic side tasks (profiler window,
expert counts, the metrics line with its evaluation, checkpoints and preemption, the halt
check) are hooks run after each step (hooks.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from olmo_jax import config as config_lib
from olmo_jax import distributed, storage
from olmo_jax import metrics as metrics_lib
from olmo_jax.config import RunConfig
from olmo_jax.data import build_data
from olmo_jax.data.build import Data
from olmo_jax.data.mixture import MIXTURE_FILE
from olmo_jax.errors import CheckpointError, ConfigError, DataError
from olmo_jax.evals import score as eval_score
from olmo_jax.evals import tasks as eval_tasks
from olmo_jax.evals.suite import Suite
from olmo_jax.model.config import TransformerConfig
from olmo_jax.optim import build_optimizer
from olmo_jax.optim.schedulers import StepBatches
from olmo_jax.parallel import mesh as mesh_lib
from olmo_jax.parallel.strategy import build_plan, check_batch
from olmo_jax.trainer import guard as guard_lib
from olmo_jax.trainer import preflight
from olmo_jax.trainer import run_dir as run_dir_lib
from olmo_jax.trainer.checkpoints import RunCheckpoints, truncate_metrics
from olmo_jax.trainer.config import TrainerConfig
from olmo_jax.trainer.evaluation import Downstream, Evaluation
from olmo_jax.trainer.hooks import Checkpointing, ExpertCounts, HaltCheck, Hook, MetricsLine, Throughput
from olmo_jax.trainer.logger import ProgressBar
from olmo_jax.trainer.preemption import Preemption
from olmo_jax.trainer.profiler import StepProfiler
from olmo_jax.trainer.sample import generate
from olmo_jax.trainer.sinks import build_sinks
from olmo_jax.trainer.state import abstract_train_state, initializer
from olmo_jax.trainer.step import make_eval_step, make_train_step


@dataclasses.dataclass
class Summary:
    steps: int
    tokens: int
    first_loss: float
    final_loss: float
    final_eval_loss: float  # the default split's (data.eval_fraction)
    mean_tokens_per_s: float
    mean_mfu: float
    compile_s: float
    metrics_path: str
    sample: str
    preempted: bool = False  # stopped by SIGTERM / SIGINT after saving a checkpoint
    final_eval_sets: dict = dataclasses.field(default_factory=dict)  # {name: loss} (data.eval_sets)
    # {downstream/<label>/<metric>: value} (trainer.downstream_evals)
    final_downstream: dict = dataclasses.field(default_factory=dict)


def _placer(plan, seq_len: int):
    """place(loader, step, grad_accum=None) -> the step's global batch laid out as the plan
    wants (`ParallelPlan.batch_shape` on its batch sharding), each process reading only the
    rows its devices hold."""
    def place(loader, step, grad_accum=None):
        shape = plan.batch_shape(loader.global_batch_size, seq_len, grad_accum)
        return distributed.place_batch(lambda rows: loader.batch(step, rows), shape,
                                       plan.batch_sharding())
    return place


def _train_stream(plan, loader, t_cfg: TrainerConfig, prefetch: int):
    """(stream, place_rows): this process's rows of each training batch, read ahead by
    grain (data/stream.py), and place_rows(rows_BX, size) -> the global batch of `size`
    sequences on the plan's sharding (one layout per batch size of the loader)."""
    sharding = plan.batch_sharding()
    shapes = {size: _batch_shape(plan, t_cfg, size) for size in loader.sizes}
    row_ids = {size: distributed.local_rows(shape, sharding) for size, shape in shapes.items()}
    def place_rows(rows_BX, size):
        return distributed.place_batch(distributed.rows_reader(row_ids[size], rows_BX),
                                       shapes[size], sharding)
    return loader.stream(row_ids, prefetch), place_rows


def _batch_shape(plan, t_cfg: TrainerConfig, size: int) -> tuple[int, int, int]:
    """The placed shape of a training batch of `size` sequences: the configured one, or
    for another size of trainer.batch_size_schedule its microbatches (grad_accum_at)."""
    if size == t_cfg.global_batch_size:
        return plan.batch_shape(size, t_cfg.seq_len)
    return plan.batch_shape(size, t_cfg.seq_len, t_cfg.grad_accum_at(size))


def _with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree` carrying `shardings` (what ahead-of-time lowering takes)."""
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        tree, shardings)


@dataclasses.dataclass
class _Run:
    """What train() builds from the config before compiling anything."""
    cfg: RunConfig
    console: Console
    main: bool  # process 0: prints and writes metrics
    run_dir: Path
    data: Data
    model_cfg: TransformerConfig
    plan: object  # ParallelPlan (olmo_jax/parallel)
    tx: object  # optax.GradientTransformation
    guard_cfg: guard_lib.GuardConfig
    abstract: object  # the TrainState's ShapeDtypeStructs
    shardings: object  # the TrainState's shardings
    opt_bytes: tuple[int, int]  # optimizer state per device: stored, replicated
    checkpoints: RunCheckpoints
    step_fn: object  # the jitted, guarded train step (of trainer.global_batch_size)
    eval_fn: object
    downstream: object = None  # evaluation.Downstream (trainer.downstream_evals) or None
    # {batch size: its jitted step} for the sizes of trainer.batch_size_schedule
    step_fns: dict = dataclasses.field(default_factory=dict)

    @property
    def t(self) -> TrainerConfig:
        return self.cfg.trainer

    @property
    def stop(self) -> int:
        return self.t.hard_stop or self.t.total_steps


def _model_config(cfg: RunConfig, data) -> TransformerConfig:
    model_cfg = cfg.model_config(data.vocab_size, data.tokenizer.eos_id)
    if data.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the data's vocabulary "
            f"({data.vocab_size}); set model.vocab_size >= {data.vocab_size} or 0 (= from the data)"
        )
    return model_cfg


def schedule_args(t_cfg: TrainerConfig) -> dict:
    """The run's length as the learning-rate schedule takes it (build_optimizer's
    tokens_per_step, max_tokens, and with trainer.batch_size_schedule `batches`: each
    step's tokens and its rescaled initial lr; max_tokens then only where it ends the run)."""
    schedule = t_cfg.batch_schedule
    if schedule is None:
        return {"tokens_per_step": t_cfg.tokens_per_step, "max_tokens": t_cfg.budget_tokens}
    steps = t_cfg.total_steps
    return {"tokens_per_step": t_cfg.tokens_per_step,
            "max_tokens": t_cfg.max_tokens if t_cfg.binds == "trainer.max_tokens" else 0,
            "batches": StepBatches(schedule.step_sizes(steps) * t_cfg.seq_len,
                                   functools.partial(schedule.initial_lrs, steps=steps))}


def _build(cfg: RunConfig, console: Console, main: bool, run_dir: Path,
           folder: run_dir_lib.RunFolder | None = None) -> _Run:
    """Data, model, plan, optimizer, checkpoints and the (uncompiled) step functions, from
    the validated sections (config.validate), for the run folder `run_dir` (the local copy
    of `folder` when that is in a bucket)."""
    t_cfg = cfg.trainer
    batch_schedule = t_cfg.batch_schedule
    data = build_data(cfg.data, t_cfg.seq_len, t_cfg.global_batch_size,
                      cfg.data.order_seed(t_cfg.seed), t_cfg.cache_dir,
                      run_tokens=t_cfg.tokens_before(t_cfg.total_steps), batch_schedule=batch_schedule)
    config_model_cfg = _model_config(cfg, data)  # as configured: what checkpoints record
    plan = build_plan(cfg.parallel, t_cfg, config_model_cfg, optim=cfg.optim)  # mesh, strategy, dispatcher
    model_cfg = plan.model_cfg  # kernels resolved for the mesh: the model is built with it
    for size in data.train.sizes if batch_schedule is not None else ():  # each fits the mesh
        check_batch(size, plan.mesh, t_cfg.grad_accum_at(size),
                    f"trainer.batch_size_schedule's batch of {size} sequences")
    tx, schedule = build_optimizer(cfg.optim, t_cfg.total_steps, **schedule_args(t_cfg))
    guard_cfg = guard_lib.GuardConfig.from_trainer(t_cfg)
    graphdef, abstract = abstract_train_state(model_cfg, tx, dispatcher=plan.dispatcher,
                                              guard_cfg=guard_cfg)
    shardings = plan.state_shardings(abstract, tx)
    opt_bytes = plan.optimizer_bytes(abstract, tx)
    checkpoints = RunCheckpoints(
        t_cfg, cfg.to_dict(), run_dir, config_model_cfg, console,
        checkpoint_dir=folder.checkpoint_dir if folder and folder.url else None,
        on_save=folder.on_save if folder and folder.url else None)
    checkpoints.verify()  # the checkpoint to start from fits, before compiling
    def jitted(grad_accum):
        return plan.jit_train_step(
            guard_lib.guarded(make_train_step(
                graphdef, model_cfg, tx, schedule, grad_accum, parallel=plan,
                expert_ranks=plan.mesh.shape["expert"],
            ), guard_cfg),
            shardings,
        )
    step_fn = jitted(t_cfg.grad_accum)
    by_accum = {t_cfg.grad_accum: step_fn}
    for size in data.train.sizes:  # one jitted step per microbatch count, compiled per size
        accum = t_cfg.grad_accum_at(size)
        by_accum[accum] = by_accum.get(accum) or jitted(accum)
    step_fns = {size: by_accum[t_cfg.grad_accum_at(size)] for size in data.train.sizes}
    eval_fn = jax.jit(make_eval_step(graphdef, model_cfg, parallel=plan))
    return _Run(cfg, console, main, run_dir, data, model_cfg, plan, tx, guard_cfg, abstract,
                shardings, opt_bytes, checkpoints, step_fn, eval_fn,
                _downstream(t_cfg, data, model_cfg, plan, graphdef), step_fns)


def _downstream(t_cfg: TrainerConfig, data, model_cfg: TransformerConfig, plan, graphdef):
    """trainer.downstream_evals: every task built and checked now, before any compute."""
    labels = t_cfg.downstream_labels
    if not labels:
        return None
    path = getattr(data.tokenizer, "path", None)
    if path is None:
        raise ConfigError("trainer.downstream_evals needs a real tokenizer: set data.tokenizer to the "
                          "tokenizer.json the token files were made with (the byte tokenizer has no olmo_eval twin)")
    shards = mesh_lib.batch_shards(plan.mesh)
    if t_cfg.downstream_batch_size % shards:
        raise ConfigError(f"trainer.downstream_batch_size={t_cfg.downstream_batch_size} must be a multiple of "
                          f"the {shards} devices a batch is split over")
    tok = eval_tasks.Tokenizer(str(path), pad_token_id=data.tokenizer.pad_id, eos_token_id=data.tokenizer.eos_id,
                               bos_token_id=t_cfg.downstream_bos_id if t_cfg.downstream_bos_id >= 0 else None)
    suite = Suite(labels, tok, t_cfg.seq_len, model_cfg.vocab_size, limit_docs=t_cfg.downstream_max_docs or None)
    return Downstream(suite, lambda get_state: eval_score.Scorer(
        eval_score.sharded_run(graphdef, plan, get_state), t_cfg.downstream_batch_size, data.tokenizer.pad_id))


def _preflight(run: _Run):
    """({batch size: compiled step}, memory estimate, compile seconds): one program per
    batch size the remaining steps take (trainer.batch_size_schedule; else the one size),
    compiled on the abstract state (nothing allocated yet) and checked to fit (the estimate
    of the largest); ({}, None, s) when nothing is left to train."""
    t0 = time.perf_counter()
    compiled, memory = {}, None
    latest = run.checkpoints.latest or 0
    if latest < run.stop:
        loader = run.data.train
        sizes = sorted({loader.size(s) for s in _change_steps(loader, latest, run.stop)})
        try:
            for size in sizes:
                batch_spec = jax.ShapeDtypeStruct(_batch_shape(run.plan, run.t, size), np.int32,
                                                  sharding=run.plan.batch_sharding())
                step_fn = run.step_fns.get(size, run.step_fn)
                compiled[size] = step_fn.lower(_with_shardings(run.abstract, run.shardings),
                                               batch_spec).compile()
                estimate = preflight.check(compiled[size], run.cfg)
                if memory is None or estimate[0].total > memory[0].total:
                    memory = estimate
        except BaseException:
            run.checkpoints.close()
            raise
    return compiled, memory, time.perf_counter() - t0


def _change_steps(loader, start: int, stop: int) -> list[int]:
    """Step `start` and the steps in (start, stop) at which the batch size changes."""
    if loader.schedule is None:
        return [start]
    first = loader.schedule.segments.first_step
    return [start] + [int(s) for s in first if start < s < stop]


def _start_state(run: _Run):
    """Resumed, or weights from trainer.init_from, or initialized on the shardings."""
    model_cfg, t_cfg = run.model_cfg, run.t
    return run.checkpoints.start(
        run.abstract, run.shardings, run.tx, run.data.train, run.run_dir / "metrics.jsonl",
        init=initializer(model_cfg, run.tx, t_cfg.seed, dispatcher=run.plan.dispatcher,
                         guard_cfg=run.guard_cfg, shardings=run.shardings),
    )


def _throughput(run: _Run) -> Throughput:
    t_cfg, model_cfg = run.t, run.model_cfg
    return Throughput(
        t_cfg.global_batch_size * t_cfg.seq_len,
        metrics_lib.flops_per_token(model_cfg, t_cfg.seq_len), run.plan.mesh.devices.size,
        metrics_lib.peak_flops_per_device(model_cfg.dtype), tokens_before=t_cfg.tokens_before)


def _print_banner(run: _Run, flops_tok: float, memory, compile_s: float,
                  programs: int = 1) -> None:
    model_cfg, mesh, plan = run.model_cfg, run.plan.mesh, run.plan
    opt_bytes, opt_bytes_replicated = run.opt_bytes
    mem = "" if memory is None else (
        f"; memory {memory[0].total / 2**20:,.1f} MiB/device of {memory[1] / 2**20:,.0f}")
    procs = f" x {jax.process_count()} processes" if jax.process_count() > 1 else ""
    run.console.print(
        f"[bold]olmo_jax[/] {model_cfg.n_layers} layers, d_model {model_cfg.d_model}, "
        f"{model_cfg.moe.num_experts} experts top-{model_cfg.moe.top_k}; "
        f"{metrics_lib.param_counts(model_cfg)[0] / 1e6:.2f}M params; mesh "
        f"{dict(mesh.shape)}{procs} {plan.strategy}/{plan.dispatch}; optimizer state "
        f"{opt_bytes / 1e6:.2f} MB/device ({opt_bytes_replicated / 1e6:.2f} replicated); "
        f"{flops_tok / 1e6:.1f} MFLOP/token; compiled in {compile_s:.1f}s{mem}"
    )
    if plan.pipeline is not None:
        s = plan.pipeline.schedule
        run.console.print(
            f"pipeline {s.kind}: {s.stages} stages x {s.virtual} virtual, {s.microbatches} "
            f"microbatches, {s.ticks} ticks, bubble {100 * s.bubble:.1f}% (logged as pipeline_bubble)")
    if run.data.mixture is not None:
        run.console.print(run.data.mixture.describe() + f" (in {MIXTURE_FILE})",
                          markup=False, highlight=False)
    run.console.print(run.t.duration_line())
    if run.data.train.schedule is not None:
        run.console.print(run.data.train.schedule.describe()
                          + f"; {programs} step program(s) compiled for this launch")
    run.console.print(f"eval every {run.t.eval_every or run.t.total_steps} steps: "
                      f"{run.data.describe_eval()}")
    if run.downstream is not None:
        tasks_ = run.downstream.suite.tasks
        run.console.print("downstream evals (trainer.downstream_evals): " + ", ".join(
            f"{label} ({len(t.samples)} requests, {t.metric_type})" for label, t in tasks_.items()))


def _open_stream_and_sinks(run: _Run, start: int):
    """(stream, place_rows, sinks): the training batches from step `start` (None when the
    run is complete), resumed where the checkpoint's data iterator stopped, and the
    metric sinks of trainer.loggers; on failure the checkpoints are closed."""
    stream, place_rows = None, None
    try:
        if start < run.stop:
            stream, place_rows = _train_stream(run.plan, run.data.train, run.t,
                                               run.cfg.data.prefetch)
            if run.checkpoints.iterator_state is not None:  # resumed: grain's saved state
                stream.set_state(run.checkpoints.iterator_state)
                if stream.step != start:
                    raise CheckpointError(
                        f"checkpoint step {start}: its data_iter state is at step {stream.step}")
        sinks = build_sinks(run.t, run.cfg.to_dict(), run.run_dir, run.model_cfg.n_dense_layers,
                            run.checkpoints.resumed_from, run.main)
    except BaseException:
        if stream is not None:
            stream.close()
        run.checkpoints.close()
        raise
    return stream, place_rows, sinks


def _step_runner(compiled: dict, stream, place_rows, profiler: StepProfiler, loader, seq_len: int):
    """run_step(state, step) -> (state, metrics): the compiled step of the batch's size on
    the stream's next batch (which is step `step`'s), traced when trainer.profile_steps asks.
    With a batch-size schedule the metrics carry the step's `batch_size` in tokens (OLMo-core's
    "train/global batch size")."""
    def run_step(state, step):
        batch_step, rows_BX = next(stream)
        assert batch_step == step, (batch_step, step)
        size = loader.size(step)
        with profiler.step(step + 1):
            state, metrics = compiled[size](state, place_rows(rows_BX, size))
        if loader.schedule is not None:
            metrics = {**metrics, "batch_size": np.asarray(size * seq_len)}
        return state, metrics
    return run_step


@dataclasses.dataclass
class _Hooks:
    """The loop's hooks (hooks.py), in the order they run after each step."""
    profiler: StepProfiler
    counts: ExpertCounts
    log: MetricsLine
    saving: Checkpointing

    def all(self) -> list[Hook]:
        return [self.profiler, self.counts, self.log, self.saving]


def _hooks(run: _Run, start: int, stream, sinks, profiler, throughput, bar, preempt) -> _Hooks:
    t_cfg, model_cfg = run.t, run.model_cfg
    halt = HaltCheck(run.checkpoints, run.guard_cfg)
    history: list[dict] = list(run.checkpoints.previous_records)
    evaluation = Evaluation(run.eval_fn, run.data, t_cfg.eval_batches,
                            _placer(run.plan, t_cfg.seq_len), t_cfg.eval_every, t_cfg.total_steps,
                            history, run.downstream)
    throughput.restart(start)  # the first logged interval starts here
    return _Hooks(
        profiler=profiler,
        counts=ExpertCounts(sinks, t_cfg.expert_counts_every, model_cfg.n_dense_layers, run.main),
        log=MetricsLine(sinks, bar, halt, evaluation, throughput, t_cfg.log_every,
                        t_cfg.total_steps, history),
        saving=Checkpointing(run.checkpoints, halt, preempt, run.data.train, stream, run.stop),
    )


def _train_steps(run: _Run, state, start: int, run_step, hooks: _Hooks, bar, preempt, stream, sinks):
    """Steps start+1 .. run.stop, each followed by the hooks; stops early when the
    checkpointing hook saved for a SIGTERM / SIGINT. -> the last state. Ends, whatever
    happens, with every hook's on_end and the stream and sinks closed."""
    try:
        with preempt, bar:
            for step in range(start, run.stop):
                state, metrics = run_step(state, step)
                for hook in hooks.all():
                    hook.on_step(step + 1, state, metrics)
                if hooks.saving.preempted is not None:
                    break
    finally:
        for hook in hooks.all():
            hook.on_end()  # the profiler stops; the checkpoints wait for the last save
        if stream is not None:
            stream.close()
        sinks.close()
    return state


def _summary(run: _Run, state, hooks: _Hooks, compile_s: float) -> Summary:
    history, evaluation = hooks.log.history, hooks.log.evaluation
    timed = history[1:] or history  # the first interval includes warm-up
    return Summary(
        steps=int(state.step),
        tokens=run.t.tokens_before(int(state.step)),
        first_loss=history[0]["loss"] if history else float("nan"),
        final_loss=history[-1]["loss"] if history else float("nan"),
        final_eval_loss=evaluation.last_loss,
        mean_tokens_per_s=float(np.mean([r["tokens_per_s"] for r in timed] or [np.nan])),
        mean_mfu=float(np.mean([r["mfu"] for r in timed] or [np.nan])),
        compile_s=compile_s,
        metrics_path=(storage.join(run.t.run_dir, "metrics.jsonl") if run.checkpoints.remote
                      else str(run.run_dir / "metrics.jsonl")),
        sample="",
        preempted=hooks.saving.preempted is not None,
        final_eval_sets=evaluation.last_sets,
        final_downstream=evaluation.last_downstream,
    )


def _sample(run: _Run, state) -> str:
    """A text sample from trainer.sample_prompt (single-program sampling with the KV-cache
    decoder: the model with its local dispatch, on one process's devices)."""
    t_cfg, tokenizer = run.t, run.data.tokenizer
    sample_ids = generate(  # outside the step's shard_map: no context parallelism
        dataclasses.replace(run.model_cfg, context_parallel=1), state.params, state.model_state,
        tokenizer.encode(t_cfg.sample_prompt), t_cfg.sample_tokens,
        temperature=t_cfg.sample_temperature, seed=t_cfg.seed, stop_id=tokenizer.eos_id,
    )
    return tokenizer.decode(sample_ids)


def train(cfg: RunConfig, console: Console | None = None) -> Summary:
    """Trains the run of the validated config `cfg` (config.validate of a ConfigDict)."""
    config_lib.check_training(cfg)
    main = distributed.is_main()
    console = console or Console(quiet=not main)
    # Writable, owned by this run (process 0's lock), no different run in it.
    folder = run_dir_lib.RunFolder(cfg, main)
    try:
        run = _build(cfg, console, main, folder.path, folder)
        compiled, memory, compile_s = _preflight(run)
    except BaseException as e:  # refused: what this launch created goes again
        folder.release(refused=isinstance(e, (ConfigError, DataError)))
        raise
    try:
        with run_dir_lib.background_errors_to_log(folder.path):
            return _train(run, compiled, memory, compile_s)
    finally:
        folder.release()


def _train(run: _Run, compiled, memory, compile_s: float) -> Summary:
    cfg, console, main = run.cfg, run.console, run.main
    if main:
        run_dir_lib.write_config(run.run_dir, cfg)
        mesh_json = json.dumps(dict(run.plan.mesh.shape))
        (run.run_dir / "mesh.json").write_text(mesh_json)  # for olmo_jax.report
    state = _start_state(run)  # a checkpoint of another data mixture is refused here
    if main and run.data.mixture is not None:  # OLMo-core's outcome tables, for the record
        (run.run_dir / MIXTURE_FILE).write_text(json.dumps(run.data.mixture.outcome(), indent=1))
    start = int(state.step)
    if start >= run.stop:  # resumed a finished run: nothing to compile or train
        console.print(f"the run is complete at step {start} (trainer.max_steps / max_tokens / hard_stop)")
    throughput = _throughput(run)  # measures the CPU's peak FLOP/s on a CPU run
    _print_banner(run, throughput.flops_tok, memory, compile_s, len(compiled))
    if run.checkpoints.resumed and main:  # like metrics.jsonl: drop what was logged after it
        truncate_metrics(run.run_dir / "expert_counts.jsonl", start)
    profiler = StepProfiler(run.t.profile_steps, run.run_dir)
    stream, place_rows, sinks = _open_stream_and_sinks(run, start)
    distributed.set_hint(
        f"the checkpoints in {run.checkpoints.ckpts.directory} are kept: relaunch every process "
        "with the same command to resume from the last one")
    bar, preempt = ProgressBar(run.t.total_steps, start, console), Preemption()
    hooks = _hooks(run, start, stream, sinks, profiler, throughput, bar, preempt)
    run_step = _step_runner(compiled, stream, place_rows, profiler, run.data.train, run.t.seq_len)
    state = _train_steps(run, state, start, run_step, hooks, bar, preempt, stream, sinks)
    summary = _summary(run, state, hooks, compile_s)
    if summary.preempted:
        signal_name, step = hooks.saving.preempted
        console.print(f"{signal_name}: saved a checkpoint at step {step} in "
                      f"{run.checkpoints.ckpts.directory}; run the same command again to resume")
        return summary
    if jax.process_count() == 1:  # sampling runs on one process's devices
        summary = dataclasses.replace(summary, sample=_sample(run, state))
    print_summary(summary, console)
    return summary


def print_summary(s: Summary, console: Console) -> None:
    table = Table(title="olmo_jax run summary", show_header=False)
    table.add_row("steps / tokens", f"{s.steps:,} / {s.tokens:,}")
    table.add_row("train loss", f"{s.first_loss:.3f} -> {s.final_loss:.3f}")
    table.add_row("validation loss", f"{s.final_eval_loss:.3f}")
    for name, loss in s.final_eval_sets.items():
        table.add_row(f"eval/{name}", f"loss {loss:.3f}, perplexity {np.exp(min(loss, 700.0)):,.2f}")
    for label in dict.fromkeys(k.split("/")[1] for k in s.final_downstream):
        values = {k.split("/")[2]: v for k, v in s.final_downstream.items() if k.split("/")[1] == label}
        table.add_row(f"downstream/{label}", ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
    table.add_row("throughput", f"{s.mean_tokens_per_s:,.0f} tokens/s, MFU {100 * s.mean_mfu:.1f}%")
    table.add_row("compile", f"{s.compile_s:.1f} s")
    table.add_row("metrics", s.metrics_path)
    console.print(table)
    if s.sample:
        console.print("[bold]sample:[/]")
        console.print(s.sample, markup=False, highlight=False)
