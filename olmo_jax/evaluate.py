"""Downstream evaluation of any checkpoint on olmo_eval's task suite (olmo_jax/evals).

python -m olmo_jax.evaluate --ckpt PATH --tasks LABEL[,LABEL...] [--tokenizer tokenizer.json]
        [--pad-id N] [--eos-id N] [--bos-id N] [--ctx N] [--batch-size 8]
        [--limit-docs N] [--json OUT.json]
        [--pipe N --data N --context N --expert N --microbatches M --dispatch D --strategy S]
    PATH: an olmo_jax run / checkpoints / step folder, a Hugging Face OLMoE folder or an
    OLMo-core olmo3moe export (config.json `model_type` olmoe / olmo3moe). The tokenizer
    defaults to the one the run recorded (its data.tokenizer), else PATH/tokenizer.json;
    --pad-id / --eos-id default to config.json's ids, else the tokenizer's (as the trainer
    finds them); a BOS id is prepended to each context when --bos-id is given or the run
    recorded trainer.downstream_bos_id (olmo_eval's HFTokenizer, as OLMo-core's
    TokenizerConfig passes it). --ctx is the eval context (olmo_eval's model_ctx_len:
    longer queries lose their left end; default the run's trainer.seq_len, else 2048).
    Prints one row per task and metric (ICLMetric's names) with the seconds per task, and
    writes them as JSON.
    The scoring runs on one device (the default backend's first); with --pipe / --data /
    --context / --expert on a mesh of the machine's first pipe x data x context x expert
    devices through the trainer's parallel plan (--dispatch ragged | allgather are dropless,
    rowwise has a capacity; --strategy ddp | fsdp; with --pipe the batches run forwards
    through the stages in --microbatches microbatches, as the trainer's evaluation), the
    batch size a multiple of data x expert x microbatches.
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
    p.add_argument("--tasks", required=True, help="comma-separated olmo_eval labels (olmo_jax.evals.tasks.supported())")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: CKPT/tokenizer.json)")
    p.add_argument("--pad-id", type=int, default=None, help="default: config.json pad_token_id, else the EOS id")
    p.add_argument("--eos-id", type=int, default=None, help="default: config.json eos_token_id")
    p.add_argument("--bos-id", type=int, default=None, help="prepended to every context when given")
    p.add_argument("--ctx", type=int, default=None,
                   help="the eval context (olmo_eval's model_ctx_len; default the run's trainer.seq_len, else 2048)")
    p.add_argument("--batch-size", type=int, default=8, help="queries per compiled batch")
    p.add_argument("--limit-docs", type=int, default=None, help="only the first N documents of each task")
    p.add_argument("--json", default=None, help="write the results here (default: stdout table only)")
    p.add_argument("--pipe", type=int, default=0, help="> 0: pipeline stages of the mesh")
    p.add_argument("--data", type=int, default=0, help="> 0: data-parallel devices of the mesh")
    p.add_argument("--context", type=int, default=0, help="> 0: context-parallel devices of the mesh")
    p.add_argument("--expert", type=int, default=0, help="> 0: expert-parallel devices of the mesh")
    p.add_argument("--microbatches", type=int, default=1, help="pipeline microbatches per batch (--pipe > 1)")
    p.add_argument("--dispatch", default="allgather", help="the mesh's expert dispatch (parallel.dispatch)")
    p.add_argument("--strategy", default="ddp", help="the mesh's parameter layout (parallel.strategy)")
    return p


MESH_FLAGS = "--pipe/--data/--context/--expert/--microbatches/--dispatch/--strategy"


def make_run(model, args):
    """The Scorer's `run`: one device, or the plan of --pipe x --data x --context x --expert
    on the machine's first devices."""
    import dataclasses
    import types

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from olmo_jax.evals import score
    from olmo_jax.kernels.ring_attention import pairs_possible
    from olmo_jax.model.abstract import abstract_model
    from olmo_jax.parallel.config import ParallelConfig
    from olmo_jax.parallel.expert import DROPLESS
    from olmo_jax.parallel.strategy import build_plan

    sizes = {name: getattr(args, name) or 1 for name in ("pipe", "data", "context", "expert")}
    if sizes["pipe"] == 1 and args.microbatches != 1:
        raise ConfigError("--microbatches splits a batch for pipeline stages: it needs --pipe > 1")
    if not (args.pipe or args.data or args.context or args.expert):
        apply = lambda params, ids: model._forward(params, model.model_state, ids)  # noqa: E731
        return score.single_device_run(apply, model.params)
    n, devices = sizes["pipe"] * sizes["data"] * sizes["context"] * sizes["expert"], jax.devices()
    if n > len(devices):
        raise ConfigError(f"--pipe x --data x --context x --expert = {n} devices, and this machine has "
                          f"{len(devices)}: make the mesh smaller")
    rows = sizes["data"] * sizes["expert"] * args.microbatches
    if args.batch_size % rows:
        raise ConfigError(f"--batch-size={args.batch_size} must be a multiple of --data x --expert x --microbatches"
                          f" = {rows}")
    parallel = ParallelConfig(**sizes, dispatch=args.dispatch, strategy=args.strategy,
                              pipeline_schedule="gpipe", microbatches=args.microbatches).validate(MESH_FLAGS)
    model_cfg = model.config
    if args.dispatch in DROPLESS:  # a capacity the checkpoint was trained with does not apply
        model_cfg = dataclasses.replace(model_cfg, moe=dataclasses.replace(model_cfg.moe, capacity_factor=0.0))
    if sizes["pipe"] > 1 and not pairs_possible(sizes["context"]):
        # the ring under a pipeline hops by pair exchanges: a power-of-two context only
        model_cfg = dataclasses.replace(model_cfg, context_attention="allgather")
    plan = build_plan(parallel, types.SimpleNamespace(global_batch_size=args.batch_size, grad_accum=1),
                      model_cfg, devices=devices[:n])
    graphdef = abstract_model(plan.model_cfg, plan.dispatcher)[0]
    params = jax.device_put(model.params, plan.param_shardings())
    model_state = jax.device_put(model.model_state, NamedSharding(plan.mesh, PartitionSpec()))
    return score.sharded_run(graphdef, plan, lambda: (params, model_state))


def load_any(path: Path):
    """(HFModel, config.json dict or None, the run config an olmo_jax checkpoint recorded or
    {}) of a checkpoint of any supported kind."""
    from olmo_jax.checkpoint import hf, manager, olmo3moe

    config = path / "config.json"  # a Hugging Face folder's; a run folder's holds its run config
    hf_config = json.loads(config.read_text()) if config.is_file() else {}
    if isinstance(hf_config, dict) and "model_type" in hf_config:
        kind = hf_config["model_type"]
        if kind == "olmoe":
            return hf.load_model(path), hf_config, {}
        if kind == "olmo3moe":
            return olmo3moe.load_model(path), hf_config, {}
        raise CheckpointError(f"{config}: model_type {kind!r} is neither olmoe nor olmo3moe; --ckpt takes those "
                              "or an olmo_jax checkpoint")
    model = hf.load_checkpoint(path)
    return model, model.hf_config, manager.saved_run_config(path)


def tokenizer_path(arg: str | None, path: Path, run_cfg: dict) -> Path:
    """--tokenizer; else the tokenizer the run recorded (data.tokenizer); else
    PATH/tokenizer.json."""
    if arg:
        tok = Path(arg).expanduser()
        if not tok.is_file():
            raise ConfigError(f"--tokenizer: {tok} is not a file: pass the path of a tokenizer.json")
        return tok
    recorded = str(run_cfg.get("data", {}).get("tokenizer", ""))
    if recorded and recorded != "bytes":
        tok = Path(recorded).expanduser()
        tok = tok / "tokenizer.json" if tok.is_dir() else tok
        if tok.is_file():
            return tok
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if run_cfg and recorded in ("", "bytes"):
        raise ConfigError("--tokenizer: the run was trained with the byte tokenizer (data.tokenizer="
                          f"{recorded!r}), which has no olmo_eval twin: pass --tokenizer PATH/tokenizer.json")
    where = f"the run's data.tokenizer {recorded!r} nor " if recorded else ""
    raise ConfigError(f"--tokenizer: neither {where}{path / 'tokenizer.json'} is a file: "
                      "pass --tokenizer PATH/tokenizer.json")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from olmo_jax.data.tokenizer import load_tokenizer
    from olmo_jax.evals import score, tasks
    from olmo_jax.evals.suite import Suite

    try:
        path = Path(args.ckpt)
        model, hf_config, run_cfg = load_any(path)
        hf_config = hf_config or {}
        tok_path = tokenizer_path(args.tokenizer, path, run_cfg)
        # eos / pad ids: given, the checkpoint's, else the tokenizer's as the trainer finds them
        found = load_tokenizer(str(tok_path), eos_id=_first(args.eos_id, hf_config.get("eos_token_id")))
        eos = found.eos_id
        pad = _first(args.pad_id, hf_config.get("pad_token_id"), found.pad_id)  # only right padding
        recorded_bos = run_cfg.get("trainer", {}).get("downstream_bos_id", -1)
        bos = _first(args.bos_id, recorded_bos if recorded_bos >= 0 else None)
        ctx = _first(args.ctx, run_cfg.get("trainer", {}).get("seq_len"), 2048)
        tok = tasks.Tokenizer(str(tok_path), pad_token_id=pad, eos_token_id=eos, bos_token_id=bos)
        suite = Suite([t for t in args.tasks.split(",") if t], tok, ctx, model.config.vocab_size,
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
        out = {"checkpoint": str(path), "tokenizer": str(tok_path), "ctx": ctx, "results": results,
               "seconds": seconds, "programs": scorer.programs}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def _first(*values):
    """The first value that is not None."""
    return next((v for v in values if v is not None), None)


if __name__ == "__main__":
    sys.exit(main())
