"""The training loop: build data, mesh, model and optimizer from a config; compile the
step once; train, log, evaluate; end with a one-screen summary and a text sample."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
from rich.console import Console
from rich.table import Table

from olmo_jax import config as config_lib
from olmo_jax import metrics as metrics_lib
from olmo_jax.checkpoint.run import RunCheckpoints, truncate_metrics
from olmo_jax.data import build_data
from olmo_jax.model.config import ConfigError
from olmo_jax.optim import build_optimizer
from olmo_jax.parallel.strategy import build_plan
from olmo_jax.trainer.logger import ExpertCountsLog, MetricsLog, ProgressBar
from olmo_jax.trainer.sample import generate
from olmo_jax.trainer.state import abstract_model, abstract_train_state, init_state
from olmo_jax.trainer.step import make_eval_step, make_train_step


@dataclasses.dataclass
class Summary:
    steps: int
    tokens: int
    first_loss: float
    final_loss: float
    final_eval_loss: float
    mean_tokens_per_s: float
    mean_mfu: float
    compile_s: float
    metrics_path: str
    sample: str


def _eval_loss(eval_fn, state, loader, n_batches, place) -> float:
    ce, n = 0.0, 0.0
    for i in range(min(n_batches, max(1, loader.steps_per_epoch))):
        batch = place(loader.batch(i))
        c, t = eval_fn(state.params, state.model_state, batch)
        ce, n = ce + float(c), n + float(t)
    return ce / max(n, 1.0)


def train(cfg: ml_collections.ConfigDict, console: Console | None = None) -> Summary:
    console = console or Console()
    config_lib.validate(cfg)
    t_cfg = cfg.trainer
    run_dir = Path(t_cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    data = build_data(cfg.data, t_cfg.seq_len, t_cfg.global_batch_size, t_cfg.seed, t_cfg.cache_dir)
    model_cfg = config_lib.model_config(cfg, data.vocab_size)
    if data.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the data's vocabulary "
            f"({data.vocab_size}); set model.vocab_size >= {data.vocab_size} or 0 (= from the data)"
        )
    plan = build_plan(cfg, model_cfg)  # mesh, strategy, dispatcher (olmo_jax/parallel)
    mesh = plan.mesh
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
    (run_dir / "mesh.json").write_text(json.dumps(dict(mesh.shape)))  # for olmo_jax.report

    tx, schedule = build_optimizer(cfg.optim, t_cfg.max_steps)
    graphdef, abstract = abstract_train_state(model_cfg, tx, dispatcher=plan.dispatcher)
    shardings = plan.state_shardings(abstract, tx)
    opt_bytes, opt_bytes_replicated = plan.optimizer_bytes(abstract, tx)
    metrics_path = run_dir / "metrics.jsonl"
    checkpoints = RunCheckpoints(cfg, run_dir, model_cfg, console)
    # Resumed, or weights from trainer.init_from, or init(); placed on `shardings`.
    state = checkpoints.start(
        abstract, shardings, tx, data.train, metrics_path,
        init=lambda: init_state(model_cfg, tx, t_cfg.seed, dispatcher=plan.dispatcher)[1],
    )

    step_fn = plan.jit_train_step(
        make_train_step(graphdef, model_cfg, tx, schedule, t_cfg.grad_accum, parallel=plan,
                        expert_ranks=mesh.shape["expert"]),
        shardings,
    )
    eval_fn = jax.jit(make_eval_step(graphdef, model_cfg, parallel=plan))

    t0 = time.perf_counter()
    first_batch = plan.place_batch(data.train.batch(0))
    start, stop = int(state.step), t_cfg.hard_stop or t_cfg.max_steps
    if start >= stop:  # resumed a finished run: nothing to compile or train
        console.print(f"the run is complete at step {start} (trainer.max_steps / hard_stop)")
    compiled = step_fn.lower(state, first_batch).compile() if start < stop else None
    compile_s = time.perf_counter() - t0

    n_dev = mesh.devices.size
    tokens_per_step = t_cfg.global_batch_size * t_cfg.seq_len
    flops_tok = metrics_lib.flops_per_token(model_cfg, t_cfg.seq_len)
    peak = metrics_lib.peak_flops_per_device(model_cfg.dtype)
    console.print(
        f"[bold]olmo_jax[/] {model_cfg.n_layers} layers, d_model {model_cfg.d_model}, "
        f"{model_cfg.moe.num_experts} experts top-{model_cfg.moe.top_k}; "
        f"{metrics_lib.param_counts(model_cfg)[0] / 1e6:.2f}M params; mesh "
        f"{dict(mesh.shape)} {plan.strategy}/{plan.dispatch}; optimizer state "
        f"{opt_bytes / 1e6:.2f} MB/device ({opt_bytes_replicated / 1e6:.2f} replicated); "
        f"{flops_tok / 1e6:.1f} MFLOP/token; compiled in {compile_s:.1f}s"
    )

    log = MetricsLog(metrics_path, append=checkpoints.resumed)
    if checkpoints.resumed:  # like metrics.jsonl: drop what was logged after the checkpoint
        truncate_metrics(run_dir / "expert_counts.jsonl", start)
    counts_log = ExpertCountsLog(
        run_dir, t_cfg.expert_counts_every, model_cfg.n_dense_layers, append=checkpoints.resumed
    )
    history: list[dict] = list(checkpoints.previous_records)
    last_eval = next((r["eval_loss"] for r in reversed(history) if "eval_loss" in r), float("nan"))
    t_last, step_last = time.perf_counter(), start
    with ProgressBar(t_cfg.max_steps, start, console) as bar:
        for step in range(start, stop):
            batch = first_batch if step == 0 else plan.place_batch(data.train.batch(step))
            state, m = compiled(state, batch)
            done = step + 1
            counts_log.maybe_write(done, m)
            is_eval = t_cfg.eval_every and done % t_cfg.eval_every == 0
            if done % t_cfg.log_every == 0 or done in (1, t_cfg.max_steps) or is_eval:
                m = jax.device_get(m)
                now = time.perf_counter()
                tok_s = (done - step_last) * tokens_per_step / (now - t_last)
                record = {"step": done, **{k: float(v) for k, v in m.items() if v.ndim == 0}}
                record["tokens_per_s"] = tok_s
                record["tflops_per_device"] = flops_tok * tok_s / n_dev / 1e12
                record["mfu"] = flops_tok * tok_s / n_dev / peak
                if is_eval or done == t_cfg.max_steps:
                    last_eval = _eval_loss(eval_fn, state, data.eval, t_cfg.eval_batches,
                                           lambda b: plan.place_batch(b, grad_accum=1))
                    record["eval_loss"] = last_eval
                log.write(record)
                history.append(record)
                bar.update(done, record)
                t_last, step_last = time.perf_counter(), done
            checkpoints.maybe_save(done, state, data.train, force=done == stop)
    checkpoints.close()
    log.close()
    counts_log.close()

    prompt = data.tokenizer.encode(t_cfg.sample_prompt)
    sample_ids = generate(  # single-program sampling: the model with its local dispatch
        abstract_model(model_cfg)[0], state.params, state.model_state, prompt, t_cfg.sample_tokens,
        t_cfg.seq_len, data.tokenizer.pad_id, seed=t_cfg.seed,
    )
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
        sample=data.tokenizer.decode(sample_ids),
    )
    print_summary(summary, console)
    return summary


def print_summary(s: Summary, console: Console) -> None:
    table = Table(title="olmo_jax run summary", show_header=False)
    table.add_row("steps / tokens", f"{s.steps:,} / {s.tokens:,}")
    table.add_row("train loss", f"{s.first_loss:.3f} -> {s.final_loss:.3f}")
    table.add_row("validation loss", f"{s.final_eval_loss:.3f}")
    table.add_row("throughput", f"{s.mean_tokens_per_s:,.0f} tokens/s, MFU {100 * s.mean_mfu:.1f}%")
    table.add_row("compile", f"{s.compile_s:.1f} s")
    table.add_row("metrics", s.metrics_path)
    console.print(table)
    console.print("[bold]sample:[/]")
    console.print(s.sample, markup=False, highlight=False)
