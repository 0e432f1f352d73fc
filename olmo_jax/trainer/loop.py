"""The training loop: build data, mesh, model and optimizer from a config; compile the
step once (ahead of time, checked to fit in memory: preflight.py); train, log, evaluate;
end with a one-screen summary and a text sample.

In a multi-process run (olmo_jax/distributed) every process runs this same loop on its
part of the mesh and reads only its rows of each batch (a grain stream read ahead off this
thread: data/pipeline.py); process 0 alone prints and writes metrics (to the sinks of
trainer.loggers: sinks.py) and config.json; checkpoints, the data iterator state included,
are saved and restored by all together. SIGTERM / SIGINT save and stop (preemption.py); bad
steps are skipped or halt the run (guard.py); trainer.profile_steps traces steps
(profiler.py). Evaluation (the default split and data.eval_sets) is sharded like training."""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import ml_collections
import numpy as np
from rich.console import Console
from rich.table import Table

from olmo_jax import config as config_lib
from olmo_jax import distributed
from olmo_jax import metrics as metrics_lib
from olmo_jax.checkpoint.errors import CheckpointError
from olmo_jax.data import build_data
from olmo_jax.model.abstract import abstract_model
from olmo_jax.model.config import ConfigError
from olmo_jax.optim import build_optimizer
from olmo_jax.parallel.strategy import build_plan
from olmo_jax.trainer import guard as guard_lib
from olmo_jax.trainer import preflight
from olmo_jax.trainer import run_dir as run_dir_lib
from olmo_jax.trainer.checkpoints import RunCheckpoints, truncate_metrics
from olmo_jax.trainer.logger import ProgressBar
from olmo_jax.trainer.preemption import Preemption
from olmo_jax.trainer.profiler import StepProfiler
from olmo_jax.trainer.sample import generate
from olmo_jax.trainer.sinks import build_sinks
from olmo_jax.trainer.state import abstract_train_state, init_state
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


def _placer(plan, seq_len: int):
    """place(loader, step, grad_accum=None) -> the step's global batch laid out as the plan
    wants (`ParallelPlan.batch_shape` on its batch sharding), each process reading only the
    rows its devices hold."""
    def place(loader, step, grad_accum=None):
        shape = plan.batch_shape(loader.global_batch_size, seq_len, grad_accum)
        return distributed.place_batch(lambda rows: loader.batch(step, rows), shape,
                                       plan.batch_sharding())
    return place


def _train_stream(plan, loader, seq_len: int, prefetch: int):
    """(stream, place_rows): this process's rows of each training batch, read ahead by
    grain (data/pipeline.py), and place_rows(rows_RL) -> the global batch on the plan's
    sharding."""
    shape, sharding = plan.batch_shape(loader.global_batch_size, seq_len), plan.batch_sharding()
    row_ids = distributed.local_rows(shape, sharding)
    def place_rows(rows_RL):
        return distributed.place_batch(distributed.rows_reader(row_ids, rows_RL), shape, sharding)
    return loader.stream(row_ids, prefetch), place_rows


def _evaluate(eval_fn, state, data, n_batches, place) -> dict[str, float]:
    """The eval records: eval_loss on the default split, eval/<name>/loss and
    eval/<name>/perplexity on each named set; every batch sharded like training."""
    record = {}
    if data.eval is not None:
        record["eval_loss"] = _eval_loss(eval_fn, state, data.eval, n_batches, place)
    for name, loader in data.eval_sets.items():
        loss = _eval_loss(eval_fn, state, loader, n_batches, place)
        record[f"eval/{name}/loss"] = loss
        record[f"eval/{name}/perplexity"] = float(np.exp(min(loss, 700.0)))
    return record


def _eval_loss(eval_fn, state, loader, n_batches, place) -> float:
    ce, n = 0.0, 0.0
    for i in range(min(n_batches, max(1, loader.steps_per_epoch))):
        batch = place(loader, i, grad_accum=1)
        c, t = eval_fn(state.params, state.model_state, batch)
        ce, n = ce + float(c), n + float(t)
    return ce / max(n, 1.0)


def _with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree` carrying `shardings` (what ahead-of-time lowering takes)."""
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        tree, shardings)


def train(cfg: ml_collections.ConfigDict, console: Console | None = None) -> Summary:
    main = distributed.is_main()
    console = console or Console(quiet=not main)
    config_lib.validate(cfg)
    t_cfg = cfg.trainer
    run_dir = run_dir_lib.prepare(cfg)  # writable; no different run in it (trainer.overwrite)

    data = build_data(cfg.data, t_cfg.seq_len, t_cfg.global_batch_size, t_cfg.seed, t_cfg.cache_dir)
    model_cfg = config_lib.model_config(cfg, data.vocab_size)
    if data.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the data's vocabulary "
            f"({data.vocab_size}); set model.vocab_size >= {data.vocab_size} or 0 (= from the data)"
        )
    plan = build_plan(cfg, model_cfg)  # mesh, strategy, dispatcher (olmo_jax/parallel)
    mesh = plan.mesh

    tx, schedule = build_optimizer(cfg.optim, t_cfg.max_steps)
    guard_cfg = guard_lib.GuardConfig.from_trainer(t_cfg)
    graphdef, abstract = abstract_train_state(model_cfg, tx, dispatcher=plan.dispatcher,
                                              guard_cfg=guard_cfg)
    shardings = plan.state_shardings(abstract, tx)
    opt_bytes, opt_bytes_replicated = plan.optimizer_bytes(abstract, tx)
    metrics_path = run_dir / "metrics.jsonl"
    checkpoints = RunCheckpoints(cfg, run_dir, model_cfg, console)
    checkpoints.verify()  # the checkpoint to start from fits, before compiling
    place = _placer(plan, t_cfg.seq_len)

    step_fn = plan.jit_train_step(
        guard_lib.guarded(make_train_step(
            graphdef, model_cfg, tx, schedule, t_cfg.grad_accum, parallel=plan,
            expert_ranks=mesh.shape["expert"],
        ), guard_cfg),
        shardings,
    )
    eval_fn = jax.jit(make_eval_step(graphdef, model_cfg, parallel=plan))

    # Preflight: compile on the abstract state (nothing allocated yet) and check it fits.
    stop = t_cfg.hard_stop or t_cfg.max_steps
    t0 = time.perf_counter()
    compiled, memory = None, None
    if checkpoints.latest is None or checkpoints.latest < stop:
        batch_spec = jax.ShapeDtypeStruct(
            plan.batch_shape(t_cfg.global_batch_size, t_cfg.seq_len), np.int32,
            sharding=plan.batch_sharding())
        try:
            compiled = step_fn.lower(_with_shardings(abstract, shardings), batch_spec).compile()
            memory = preflight.check(compiled, cfg)
        except BaseException:
            checkpoints.close()
            raise
    compile_s = time.perf_counter() - t0
    if main:
        run_dir_lib.write_config(run_dir, cfg)
        (run_dir / "mesh.json").write_text(json.dumps(dict(mesh.shape)))  # for olmo_jax.report

    # Resumed, or weights from trainer.init_from, or init(); placed on `shardings`.
    state = checkpoints.start(
        abstract, shardings, tx, data.train, metrics_path,
        init=lambda: init_state(model_cfg, tx, t_cfg.seed, dispatcher=plan.dispatcher,
                                guard_cfg=guard_cfg)[1],
    )
    start = int(state.step)
    if start >= stop:  # resumed a finished run: nothing to compile or train
        console.print(f"the run is complete at step {start} (trainer.max_steps / hard_stop)")

    n_dev = mesh.devices.size
    tokens_per_step = t_cfg.global_batch_size * t_cfg.seq_len
    flops_tok = metrics_lib.flops_per_token(model_cfg, t_cfg.seq_len)
    peak = metrics_lib.peak_flops_per_device(model_cfg.dtype)
    mem = "" if memory is None else (
        f"; memory {memory[0].total / 2**20:,.1f} MiB/device of {memory[1] / 2**20:,.0f}")
    procs = f" x {jax.process_count()} processes" if jax.process_count() > 1 else ""
    console.print(
        f"[bold]olmo_jax[/] {model_cfg.n_layers} layers, d_model {model_cfg.d_model}, "
        f"{model_cfg.moe.num_experts} experts top-{model_cfg.moe.top_k}; "
        f"{metrics_lib.param_counts(model_cfg)[0] / 1e6:.2f}M params; mesh "
        f"{dict(mesh.shape)}{procs} {plan.strategy}/{plan.dispatch}; optimizer state "
        f"{opt_bytes / 1e6:.2f} MB/device ({opt_bytes_replicated / 1e6:.2f} replicated); "
        f"{flops_tok / 1e6:.1f} MFLOP/token; compiled in {compile_s:.1f}s{mem}"
    )
    if plan.pipeline is not None:
        s = plan.pipeline.schedule
        console.print(
            f"pipeline {s.kind}: {s.stages} stages x {s.virtual} virtual, {s.microbatches} "
            f"microbatches, {s.ticks} ticks, bubble {100 * s.bubble:.1f}% (logged as pipeline_bubble)")

    console.print(f"eval every {t_cfg.eval_every or t_cfg.max_steps} steps: {data.describe_eval()}")
    if checkpoints.resumed and main:  # like metrics.jsonl: drop what was logged after the checkpoint
        truncate_metrics(run_dir / "expert_counts.jsonl", start)
    counts_every = t_cfg.expert_counts_every
    profiler = StepProfiler(t_cfg.profile_steps, run_dir)
    stream, place_rows = None, None
    try:
        if start < stop:
            stream, place_rows = _train_stream(plan, data.train, t_cfg.seq_len, cfg.data.prefetch)
            if checkpoints.iterator_state is not None:  # resumed: grain's saved iterator state
                stream.set_state(checkpoints.iterator_state)
                if stream.step != start:
                    raise CheckpointError(
                        f"checkpoint step {start}: its data_iter state is at step {stream.step}")
        sinks = build_sinks(cfg, run_dir, model_cfg.n_dense_layers, checkpoints.resumed_from, main)
    except BaseException:
        if stream is not None:
            stream.close()
        checkpoints.close()
        raise
    distributed.set_hint(
        f"the checkpoints in {checkpoints.ckpts.directory} are kept: relaunch every process "
        "with the same command to resume from the last one")

    def halt_if(halt_step, reason) -> None:
        if int(halt_step):
            checkpoints.close()  # the last save, made before the bad step, completes
            raise guard_lib.TrainingHalted(guard_lib.halt_message(
                int(halt_step), int(reason), guard_cfg, checkpoints.last_saved,
                str(checkpoints.ckpts.directory)))

    history: list[dict] = list(checkpoints.previous_records)
    last_eval = next((r["eval_loss"] for r in reversed(history) if "eval_loss" in r), float("nan"))
    last_sets = {name: next((r[f"eval/{name}/loss"] for r in reversed(history)
                             if f"eval/{name}/loss" in r), float("nan")) for name in data.eval_sets}
    t_last, step_last = time.perf_counter(), start
    preempted = None
    try:
        with Preemption() as preempt, ProgressBar(t_cfg.max_steps, start, console) as bar:
            for step in range(start, stop):
                done = step + 1
                batch_step, rows_RL = next(stream)
                assert batch_step == step, (batch_step, step)
                with profiler.step(done):
                    state, m = compiled(state, place_rows(rows_RL))
                profiler.after(done, state)
                if main and counts_every and done % counts_every == 0:
                    counts_LE = np.asarray(m["expert_counts"])  # [MoE blocks, experts]
                    first = model_cfg.n_dense_layers
                    sinks.expert_counts(done, list(range(first, first + len(counts_LE))), counts_LE)
                is_eval = t_cfg.eval_every and done % t_cfg.eval_every == 0
                if done % t_cfg.log_every == 0 or done in (1, t_cfg.max_steps) or is_eval:
                    m = jax.device_get(m)
                    halt_if(m.pop("halted"), state.guard.halt_reason)
                    now = time.perf_counter()
                    tok_s = (done - step_last) * tokens_per_step / (now - t_last)
                    record = {"step": done, **{k: float(v) for k, v in m.items() if v.ndim == 0}}
                    record["tokens_per_s"] = tok_s
                    record["step_time_s"] = (now - t_last) / (done - step_last)
                    record["tflops_per_device"] = flops_tok * tok_s / n_dev / 1e12
                    record["mfu"] = flops_tok * tok_s / n_dev / peak
                    if is_eval or done == t_cfg.max_steps:
                        evals = _evaluate(eval_fn, state, data, t_cfg.eval_batches, place)
                        record.update(evals)
                        last_eval = evals.get("eval_loss", last_eval)
                        last_sets = {n: evals[f"eval/{n}/loss"] for n in data.eval_sets}
                    sinks.scalars(done, record)
                    history.append(record)
                    bar.update(done, record)
                    t_last, step_last = time.perf_counter(), done
                preempt_now = preempt.requested(done)
                force = done == stop or preempt_now
                if checkpoints.due(done, force):  # never save a halted run's state
                    halt_if(state.guard.halt_step, state.guard.halt_reason)
                checkpoints.maybe_save(done, state, data.train, force=force, stream=stream)
                if preempt_now:
                    preempted = (preempt.signal_name, done)
                    break
    finally:
        profiler.stop()
        checkpoints.close()  # waits for the last save
        if stream is not None:
            stream.close()
        sinks.close()

    timed = history[1:] or history  # the first interval includes warm-up
    summary = Summary(
        steps=int(state.step),
        tokens=int(state.step) * tokens_per_step,
        first_loss=history[0]["loss"] if history else float("nan"),
        final_loss=history[-1]["loss"] if history else float("nan"),
        final_eval_loss=last_eval,
        mean_tokens_per_s=float(np.mean([r["tokens_per_s"] for r in timed] or [np.nan])),
        mean_mfu=float(np.mean([r["mfu"] for r in timed] or [np.nan])),
        compile_s=compile_s,
        metrics_path=str(run_dir / "metrics.jsonl"),
        sample="",
        preempted=preempted is not None,
        final_eval_sets=last_sets,
    )
    if preempted is not None:
        console.print(
            f"{preempted[0]}: saved a checkpoint at step {preempted[1]} in "
            f"{checkpoints.ckpts.directory}; run the same command again to resume")
        return summary
    if jax.process_count() == 1:  # sampling runs on one process's devices
        prompt = data.tokenizer.encode(t_cfg.sample_prompt)
        sample_ids = generate(  # single-program sampling: the model with its local dispatch
            abstract_model(model_cfg)[0], state.params, state.model_state, prompt,
            t_cfg.sample_tokens, t_cfg.seq_len, data.tokenizer.pad_id,
            temperature=t_cfg.sample_temperature, seed=t_cfg.seed,
        )
        summary = dataclasses.replace(summary, sample=data.tokenizer.decode(sample_ids))
    print_summary(summary, console)
    return summary


def print_summary(s: Summary, console: Console) -> None:
    table = Table(title="olmo_jax run summary", show_header=False)
    table.add_row("steps / tokens", f"{s.steps:,} / {s.tokens:,}")
    table.add_row("train loss", f"{s.first_loss:.3f} -> {s.final_loss:.3f}")
    table.add_row("validation loss", f"{s.final_eval_loss:.3f}")
    for name, loss in s.final_eval_sets.items():
        table.add_row(f"eval/{name}", f"loss {loss:.3f}, perplexity {np.exp(min(loss, 700.0)):,.2f}")
    table.add_row("throughput", f"{s.mean_tokens_per_s:,.0f} tokens/s, MFU {100 * s.mean_mfu:.1f}%")
    table.add_row("compile", f"{s.compile_s:.1f} s")
    table.add_row("metrics", s.metrics_path)
    console.print(table)
    if s.sample:
        console.print("[bold]sample:[/]")
        console.print(s.sample, markup=False, highlight=False)
