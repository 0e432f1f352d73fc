"""The GPU check's training section: configs/gpu_check_1b.py (~1B active) trained on one
GPU through the trainer's own plan, with one `model.moe.gmm_impl`:

    python tools/gpu_check/jax_train.py train OUT.json --gmm-impl pallas|ragged_dot|einsum [--steps 30] [--dry-run]

As olmo_jax/trainer/loop.py builds a run: the plan (`build_plan`: mesh, strategy,
dispatch, kernel checks), the abstract state and its shardings from the plan, the
guarded train step jitted by `plan.jit_train_step` with donated state, compiled ahead of
time and checked to fit (`preflight.check`), the state initialized and placed on the
plan's shardings. The batches are random tokens (the same for every gmm_impl: the seeds
are fixed), placed as `plan.batch_shape` / `plan.batch_sharding` lay them out, so no
data pipeline is timed. One warm-up step, then `--steps` timed steps; the loss of every
step is recorded (the driver checks the three runs agree), tokens/s, TFLOP/s and MFU
(metrics.flops_per_token: OLMo-core's formula; peak from metrics.PEAK_FLOPS)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402


def train(gmm_impl: str, steps: int, dry: bool) -> dict:
    """One run; --dry-run with pallas runs inside Pallas' GPU interpret mode."""
    from olmo_jax.kernels import platform

    with platform.interpret() if dry and gmm_impl == "pallas" else common.nullcontext():
        return _train(gmm_impl, steps, dry)


def _train(gmm_impl: str, steps: int, dry: bool) -> dict:
    from olmo_jax import config as config_lib
    from olmo_jax import metrics
    from olmo_jax.optim import build_optimizer
    from olmo_jax.parallel.strategy import build_plan
    from olmo_jax.trainer import guard as guard_lib
    from olmo_jax.trainer import preflight
    from olmo_jax.trainer.state import abstract_train_state, initializer
    from olmo_jax.trainer.step import make_train_step

    cfg = common.config(dry)
    cfg.model.moe.gmm_impl = gmm_impl
    cfg.trainer.max_steps = steps + 1
    run = config_lib.validate(cfg)
    t = run.trainer
    plan = build_plan(run.parallel, t, run.model_config(), optim=run.optim, devices=jax.devices()[:1])
    model_cfg = plan.model_cfg  # gmm_impl resolved for the GPU (plan.kernels)
    tx, schedule = build_optimizer(run.optim, t.max_steps)
    guard_cfg = guard_lib.GuardConfig.from_trainer(t)
    graphdef, abstract = abstract_train_state(model_cfg, tx, dispatcher=plan.dispatcher, guard_cfg=guard_cfg)
    shardings = plan.state_shardings(abstract, tx)
    step_fn = plan.jit_train_step(
        guard_lib.guarded(make_train_step(graphdef, model_cfg, tx, schedule, t.grad_accum, parallel=plan,
                                          expert_ranks=plan.mesh.shape["expert"]), guard_cfg),
        shardings)
    batch_shape = plan.batch_shape(t.global_batch_size, t.seq_len)
    specs = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), abstract, shardings)
    t0 = time.perf_counter()
    compiled = step_fn.lower(specs, jax.ShapeDtypeStruct(batch_shape, np.int32,
                                                          sharding=plan.batch_sharding())).compile()
    compile_s = time.perf_counter() - t0
    memory = preflight.check(compiled, run)
    state = initializer(model_cfg, tx, t.seed, dispatcher=plan.dispatcher, guard_cfg=guard_cfg,
                        shardings=shardings)()
    batches = [jax.device_put(np.random.default_rng(i).integers(0, model_cfg.vocab_size, batch_shape,
                                                                dtype=np.int32), plan.batch_sharding())
               for i in range(4)]
    state, m = compiled(state, batches[0])  # warm-up
    losses = [m["loss"]]
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        state, m = compiled(state, batches[i % len(batches)])
        losses.append(m["loss"])
    jax.block_until_ready(m)
    elapsed = time.perf_counter() - t0
    tok_s = steps * t.global_batch_size * t.seq_len / elapsed
    flops_tok = metrics.flops_per_token(model_cfg, t.seq_len)
    total, active = metrics.param_counts(model_cfg)
    return {
        "gmm_impl": gmm_impl,
        "resolved_gmm_impl": plan.kernels.gmm,
        "mesh": dict(plan.mesh.shape), "strategy": plan.strategy, "dispatch": plan.dispatch,
        "params_total": total, "params_active": active, "tokens_per_step": t.global_batch_size * t.seq_len,
        "steps": steps, "compile_s": compile_s,
        "memory_gib": None if memory is None else memory[0].total / 2**30,
        "step_ms": 1e3 * elapsed / steps, "tokens_per_s": tok_s, "flops_per_token": flops_tok,
        "tflops_per_s": flops_tok * tok_s / 1e12,
        "mfu": flops_tok * tok_s / metrics.peak_flops_per_device(model_cfg.dtype),
        "losses": [float(x) for x in jax.device_get(losses)],
    }


if __name__ == "__main__":
    args = common.section_args({"train": train})
    common.run_section(args, lambda: train(args.gmm_impl, args.steps, args.dry_run))
