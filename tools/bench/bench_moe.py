"""MoE benchmarks on this CPU, as ratios measured side by side in ONE run (timings are
interleaved round by round, so machine noise hits every variant alike), with the goals of
issue 17 printed next to them:

1. MoE block scaling (the reference's headline: 8 -> 128 experts cost it < 5%): one MoE
   block (router, dispatch, experts, combine; forward + backward, no optimizer; gmm_impl
   auto, and tiled for comparison) at 8 and 128 experts with the same active parameters,
   top-4, 8192 tokens (each of 128 experts gets ~256 rows); the ratio 128 / 8 (goal >= 0.9).
2. Expert scaling, full train step: the same small MoE (top-4, same active parameters)
   at 8, 32 and 128 experts, the trainer's step on one device; tokens/s, the ratio to 8
   experts, and the optimizer's share of the step (AdamW over 16x the parameters at 128
   experts, timed on its own in the same rounds).
3. Expert-matmul efficiency at 8 and 128 experts: the routed SwiGLU FFN (dispatch, expert
   matmuls, combine; forward + backward, `routed_experts`) per implementation, its
   achieved FLOP/s (useful FLOPs: 3 x 6 x tokens x k x d x h) as a fraction of one dense
   matmul of exactly those FLOPs ([tokens x k, d] x [d, 9h]; also shown: a dense SwiGLU,
   forward + backward, of the same rows through one expert's weights), and the compiled
   program's matmul FLOPs per useful FLOP (for the tiled loop, whose trip counts are the
   routing's: its rows, padding included, per routed row): the FFI call into OpenBLAS
   (blas, auto on CPU in float32; goal >= 0.8 of dense), the tiled per-expert XLA loop,
   the blocked dropless einsum, capacity buffers (capacity_factor 1.25), and
   jax.lax.ragged_dot (a dense masked product over every expert on CPU: only at <= 8
   experts). Pallas (interpret mode) is excluded.
4. Dispatch backends under expert parallelism on 8 fake CPU devices: tools/bench/bench_parallel
   (tokens/s and collective bytes per step, from the compiled HLO), in a child process;
   --no-dispatch skips it. Sections 1-3 run on one CPU device in this process, with the
   trainer's host malloc policy for one (trainer.host_malloc=auto: retain).

    .venv/bin/python tools/bench/bench_moe.py [--rounds 3] [--out bench_results.json]

Prints Markdown tables, the matmul ceiling measured in the same run, and writes every
number to the JSON file. On a busy machine the ratios are the numbers to read.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from olmo_jax import host_memory, metrics  # noqa: E402
from olmo_jax.config import default_config, model_config  # noqa: E402
from olmo_jax.model import MoEConfig  # noqa: E402
from olmo_jax.model.config import TransformerConfig  # noqa: E402
from olmo_jax.model.mlp import swiglu  # noqa: E402
from olmo_jax.model.moe.layer import MoELayer, routed_experts  # noqa: E402
from olmo_jax.model.moe.router import Routing  # noqa: E402
from olmo_jax.model.moe.tiled import TILE_MULTIPLE  # noqa: E402
from olmo_jax.optim import build_optimizer  # noqa: E402
from olmo_jax.planner import comms, hlo, hlo_cost  # noqa: E402
from olmo_jax.trainer.state import init_state  # noqa: E402
from olmo_jax.trainer.step import make_train_step  # noqa: E402


def interleaved(fns: dict, rounds: int, calls: int | None = None,
                round_s: float = 1.0) -> dict[str, float]:
    """Median seconds per call of each fn() (compiled and warm), timed round by round;
    `calls` per fn per round, or (None) as many as fill about `round_s` seconds. One
    untimed round goes first: a round's calls are in flight together, and until each fn
    has run a whole round the allocator is still growing its heap for their buffers
    (host_malloc=retain; glibc's defaults map fresh pages on every call anyway)."""
    n = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        n[name] = calls or max(1, round(round_s / (time.perf_counter() - t0)))
    times = {k: [] for k in fns}
    for r in range(rounds + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(n[name]):
                out = fn()
            jax.block_until_ready(out)
            if r:
                times[name].append((time.perf_counter() - t0) / n[name])
    return {k: statistics.median(v) for k, v in times.items()}


# ---- 2. expert scaling, full train step ------------------------------------------------

def scaling_config(num_experts: int, args):
    c = default_config()
    m = c.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads = 256, args.d_model, 2, 4
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = num_experts, 4, args.hidden
    m.moe.routing_mode = "random"  # a system benchmark: balanced on average, like the reference's
    c.trainer.global_batch_size, c.trainer.seq_len = args.batch, args.seq
    return c


def expert_scaling(args) -> list[dict]:
    device = jax.devices()[0]
    fns, rows = {}, []
    for E in args.experts:
        cfg = scaling_config(E, args)
        model_cfg = model_config(cfg)
        tx, schedule = build_optimizer(cfg.optim, 1000)
        graphdef, state = init_state(model_cfg, tx, 0)
        state = jax.device_put(state, device)
        batch = jax.device_put(np.random.default_rng(0).integers(
            0, 256, (args.batch, args.seq + 1)).astype(np.int32), device)
        step = jax.jit(make_train_step(graphdef, model_cfg, tx, schedule), donate_argnums=0)
        holder = {"state": state}

        def run(step=step, holder=holder, batch=batch):
            holder["state"], m = step(holder["state"], batch)
            return m["loss"]

        # The optimizer's share: the step's AdamW update (clipping included) on its own,
        # over gradients of the parameters' shapes.
        grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), state.params)
        update = jax.jit(lambda g, o, p, tx=tx: optax.apply_updates(p, tx.update(g, o, p)[0]))
        opt_args = jax.tree.map(jnp.copy, (grads, state.opt_state, state.params))  # the step donates

        run()
        run()
        jax.block_until_ready(update(*opt_args))
        fns[f"step{E}"] = run
        fns[f"opt{E}"] = lambda u=update, a=opt_args: u(*a)
        total, active = metrics.param_counts(model_cfg)
        rows.append({"experts": E, "total_params": total, "active_params": active,
                     "flops_per_token": metrics.flops_per_token(model_cfg, args.seq)})
        print(f"compiled the {E}-expert step", file=sys.stderr)
    secs = interleaved(fns, args.rounds, args.steps)
    tokens = args.batch * args.seq
    base = tokens / secs[f"step{args.experts[0]}"]
    for r in rows:
        E = r["experts"]
        r["tokens_per_s"] = tokens / secs[f"step{E}"]
        r["vs_first"] = r["tokens_per_s"] / base
        r["optimizer_share"] = secs[f"opt{E}"] / secs[f"step{E}"]
        r["vs_first_without_optimizer"] = ((secs[f"step{args.experts[0]}"]
                                            - secs[f"opt{args.experts[0]}"])
                                           / (secs[f"step{E}"] - secs[f"opt{E}"]))
    return rows


# ---- 1. the MoE block at 8 and 128 experts ---------------------------------------------

def moe_block(args) -> list[dict]:
    """Router + dispatch + experts + combine, forward + backward (gradients of the block's
    parameters and input), no optimizer; same active parameters at every expert count."""
    S, D, F, k = args.block_tokens, args.d_model, args.hidden, 4
    x = jax.random.normal(jax.random.key(0), (1, S, D), jnp.float32)
    fns, rows = {}, []
    for impl, E in [(i, E) for i in args.block_impls for E in args.block_experts]:
        moe = MoEConfig(E, k, F, routing_mode="random", gmm_impl=impl)
        cfg = TransformerConfig(d_model=D, n_heads=4, moe=moe)
        graphdef, params, rest = nnx.split(MoELayer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

        def loss(params, x, graphdef=graphdef, rest=rest):
            y, stats = nnx.merge(graphdef, params, rest)(x, jax.random.key(1))
            return jnp.sum(y * y)

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        jax.block_until_ready(fn(params, x))
        fns[impl, E] = lambda fn=fn, p=params: fn(p, x)
        rows.append({"gmm_impl": impl, "experts": E, "tokens": S, "top_k": k, "d_model": D,
                     "expert_hidden": F, "useful_gflop": 3 * 6 * S * k * D * F / 1e9})
        print(f"compiled the {E}-expert MoE block ({impl})", file=sys.stderr)
    secs = interleaved(fns, args.rounds)
    for r in rows:
        r["seconds"] = secs[r["gmm_impl"], r["experts"]]
        r["tokens_per_s"] = S / r["seconds"]
        r["vs_first"] = secs[r["gmm_impl"], args.block_experts[0]] / r["seconds"]
        r["expert_gflop_per_s"] = r["useful_gflop"] / r["seconds"]
    return rows


# ---- 3. expert-matmul efficiency -------------------------------------------------------

class _Weights:
    """The `experts` argument of routed_experts: weights(dtype) -> (gate, up, down)."""

    def __init__(self, w):
        self.w = w

    def weights(self, dtype):
        return tuple(a.astype(dtype) for a in self.w)


def random_routing(key, S: int, E: int, k: int) -> Routing:
    """k distinct experts per token, uniformly at random, softmax-like weights."""
    k1, k2 = jax.random.split(key)
    idx_Sk = jnp.argsort(jax.random.uniform(k1, (S, E)), axis=-1)[:, :k].astype(jnp.int32)
    weights_Sk = jax.nn.softmax(jax.random.normal(k2, (S, k)), axis=-1)
    zeros = jnp.zeros((S, E), jnp.float32)
    return Routing(zeros, zeros, weights_Sk, idx_Sk)


def efficiency(args) -> list[dict]:
    rows = []
    for E in args.eff_experts:
        rows += efficiency_at(args, E)
    return rows


def efficiency_at(args, E: int) -> list[dict]:
    S, D, F, k = args.eff_tokens, args.d_model, args.hidden, 4
    keys = jax.random.split(jax.random.key(0), 8)
    x = jax.random.normal(keys[0], (S, D), jnp.float32)
    x_rows = jax.random.normal(keys[6], (S * k, D), jnp.float32)  # the dense reference's
    ct_rows = jax.random.normal(keys[7], (S * k, D), jnp.float32)
    w_dense = jax.random.normal(keys[1], (D, 9 * F), jnp.float32) * 0.02
    w = tuple(jax.random.normal(kk, shape, jnp.float32) * 0.02 for kk, shape in
              zip(keys[1:4], [(E, D, F), (E, D, F), (E, F, D)], strict=True))
    routing = random_routing(keys[4], S, E, k)
    ct = jax.random.normal(keys[5], (S, D), jnp.float32)
    useful = 3 * 6 * S * k * D * F  # forward + backward of the routed assignments

    def moe_loss(cfg):
        def loss(x, w, routing, ct):
            y, _ = routed_experts(x, routing, _Weights(w), cfg, jnp.float32)
            return jnp.sum(y * ct)
        return loss

    def dense_matmul(x, w, routing, ct):  # one matmul of the same FLOPs: [S k, D] x [D, 9F]
        return x @ w

    def dense_loss(x, w, routing, ct):  # the same FLOPs: S x k rows through one expert
        return jnp.sum(swiglu(x, w[0][0], w[1][0], w[2][0]) * ct)

    impls = {
        "dense matmul, same FLOPs (reference)": dense_matmul,
        "dense SwiGLU, same rows, one expert": dense_loss,
        "blas: OpenBLAS SGEMM per expert, FFI (auto on CPU)": moe_loss(
            MoEConfig(E, k, F, gmm_impl="blas")),
        "tiled per-expert XLA loop": moe_loss(MoEConfig(E, k, F, gmm_impl="tiled")),
        "batched einsum, blocked dropless layout": moe_loss(MoEConfig(E, k, F, gmm_impl="einsum")),
        "batched einsum, capacity buffers (cf 1.25)": moe_loss(
            MoEConfig(E, k, F, gmm_impl="einsum", capacity_factor=1.25)),
    }
    if E <= args.ragged_dot_max_experts:  # E times the FLOPs on CPU
        impls["ragged_dot"] = moe_loss(MoEConfig(E, k, F, gmm_impl="ragged_dot"))
    fns, rows = {}, []
    for name, loss in impls.items():
        if loss is dense_matmul:
            args_, fn = (x_rows, w_dense, routing, ct), jax.jit(dense_matmul)
        else:
            args_ = (x_rows, w, routing, ct_rows) if loss is dense_loss else (x, w, routing, ct)
            # value_and_grad: the loss value needs the forward's last matmul too (with grad
            # alone XLA drops it, the loss being linear in the FFN's output).
            fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        compiled = fn.lower(*args_).compile()
        hlo_dots = hlo_cost.program_cost(hlo.parse_module(compiled)).total_dot_flops
        compiled(*args_)
        fns[name] = lambda c=compiled, a=args_: c(*a)
        if name.startswith("tiled"):  # its loops run the routing's trip counts: count rows
            counts = np.bincount(np.asarray(routing.idx_Sk).ravel(), minlength=E)
            hlo_dots = useful * np.sum(-(-counts // TILE_MULTIPLE) * TILE_MULTIPLE) / (S * k)
        if name.startswith("blas"):  # GEMMs outside the HLO, over exactly the routed rows
            hlo_dots = useful
        rows.append({"experts": E, "implementation": name,
                     "hlo_dot_flops_per_useful": hlo_dots / useful})
        print(f"compiled {name} at {E} experts", file=sys.stderr)
    secs = interleaved(fns, args.rounds)
    dense = useful / secs[rows[0]["implementation"]]
    for r in rows:
        r["gflop_per_s"] = useful / secs[r["implementation"]] / 1e9
        r["fraction_of_dense"] = useful / secs[r["implementation"]] / dense
    return rows


# ---- 4. dispatch backends under EP (tools/bench/bench_parallel) ------------------------------

def dispatch_backends(args) -> tuple[list[dict], dict]:
    """The EP backends on 8 fake CPU devices, in a child process: this one runs sections 1-3
    on one CPU device, with the host malloc policy the trainer's one-device CPU run takes
    (olmo_jax/host_memory.py), which a mesh of fake devices must not take."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "dispatch.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--dispatch-child", out,
                        "--rounds", str(args.rounds), "--ep-steps", str(args.ep_steps)],
                       env=dict(os.environ, XLA_FLAGS=flags.strip()), check=True)
        with open(out) as f:
            res = json.load(f)
    return res["rows"], res["args"]


def dispatch_here(args) -> tuple[list[dict], dict]:
    import bench_parallel  # sets 8 fake devices where XLA_FLAGS has no count

    pargs = bench_parallel.parser().parse_args(
        ["--rounds", str(args.rounds), "--steps", str(args.ep_steps)])
    runs = bench_parallel.measure(pargs)
    base = runs["ddp+rowwise"]["tokens_per_s"]
    rows = []
    for name, r in runs.items():
        rows.append({"variant": name, "tokens_per_s": r["tokens_per_s"],
                     "vs_rowwise": r["tokens_per_s"] / base,
                     "collective_mb_per_device_step": comms.total_bytes(r["colls"]) / 1e6,
                     "all_to_all_mb": comms.total_bytes(r["colls"], "all-to-all") / 1e6,
                     "dropped_frac": r["dropped"]})
    return rows, vars(pargs)


# ---- report ----------------------------------------------------------------------------

def markdown(results: dict, args) -> str:
    peak = results["cpu_matmul_peak_gflops"]
    out = [f"Matmul ceiling measured in this run: {peak:,.0f} GFLOP/s (dense f32 1024^3, "
           "one CPU device)", ""]
    blk = results["moe_block"]
    out += [f"## MoE block: router + dispatch + experts + combine, forward + backward, "
            f"{args.block_tokens} tokens, top-4, d_model {args.d_model}, expert hidden "
            f"{args.hidden}, float32", "",
            "| gmm_impl | experts | tokens/s | expert GFLOP/s (useful) | of ceiling | vs first |",
            "|---|---:|---:|---:|---:|---:|"]
    for r in blk:
        out.append(f"| {r['gmm_impl']} | {r['experts']} | {r['tokens_per_s']:,.0f} | "
                   f"{r['expert_gflop_per_s']:,.1f} | {r['expert_gflop_per_s'] / peak:.0%} | "
                   f"{r['vs_first']:.2f} |")
    for impl in args.block_impls:
        mine = [r for r in blk if r["gmm_impl"] == impl]
        if mine:
            out += ["", f"goal: MoE block ({impl}) at {mine[-1]['experts']} / "
                    f"{mine[0]['experts']} experts >= 0.9: **{mine[-1]['vs_first']:.2f}**"]
    out += ["", f"## Expert scaling: top-4, d_model {args.d_model}, expert hidden {args.hidden}, "
            f"2 MoE blocks, {args.batch} x {args.seq} tokens/step, float32, one CPU device, "
            "full train step",
            "", "| experts | total params | active params | tokens/s | vs first | "
            "optimizer share | vs first, step minus optimizer |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["expert_scaling"]:
        out.append(f"| {r['experts']} | {r['total_params'] / 1e6:.1f}M | "
                   f"{r['active_params'] / 1e6:.2f}M | {r['tokens_per_s']:,.0f} | "
                   f"{r['vs_first']:.2f} | {r['optimizer_share']:.0%} | "
                   f"{r['vs_first_without_optimizer']:.2f} |")
    out += ["", f"## Expert-matmul efficiency: routed SwiGLU FFN, forward + backward, "
            f"{args.eff_tokens} tokens, top-4, d {args.d_model}, h {args.hidden}, float32",
            "", "| experts | implementation | GFLOP/s (useful) | of ceiling | of dense | "
            "compiled matmul FLOPs / useful |", "|---:|---|---:|---:|---:|---:|"]
    for r in results["efficiency"]:
        out.append(f"| {r['experts']} | {r['implementation']} | {r['gflop_per_s']:,.1f} | "
                   f"{r['gflop_per_s'] / peak:.0%} | {r['fraction_of_dense']:.2f} | "
                   f"{r['hlo_dot_flops_per_useful']:.2f} |")
    for impl in ("blas", "tiled"):
        mine = [r for r in results["efficiency"] if r["implementation"].startswith(impl)]
        out += ["", f"goal: routed FFN ({impl}) >= 0.8 of the dense matmul: " + ", ".join(
            f"**{r['fraction_of_dense']:.2f}** at {r['experts']} experts" for r in mine)]
    if results.get("dispatch"):
        p = results["dispatch_args"]
        out += ["", f"## Dispatch backends under EP: 8 fake CPU devices (data={p['data']} x "
                f"expert={p['expert']}), tools/bench/bench_parallel.py defaults", "",
                "| variant | tokens/s | vs rowwise | collective MB/device/step | all-to-all MB | "
                "dropped |", "|---|---:|---:|---:|---:|---:|"]
        for r in results["dispatch"]:
            out.append(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['vs_rowwise']:.2f} | "
                       f"{r['collective_mb_per_device_step']:.2f} | {r['all_to_all_mb']:.2f} | "
                       f"{r['dropped_frac']:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="train steps per round (scaling)")
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256, help="expert hidden size")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=8192, help="MoE block benchmark")
    ap.add_argument("--block-experts", type=int, nargs="+", default=[8, 128])
    ap.add_argument("--block-impls", nargs="+", default=["auto", "tiled"],
                    help="gmm_impl values for the MoE block (auto = blas on CPU in float32; "
                         "tiled: the XLA loop auto chose before)")
    ap.add_argument("--eff-tokens", type=int, default=8192)
    ap.add_argument("--eff-experts", type=int, nargs="+", default=[8, 128])
    ap.add_argument("--ragged-dot-max-experts", type=int, default=8,
                    help="run ragged_dot (E x the FLOPs on CPU) only up to this many experts")
    ap.add_argument("--ep-steps", type=int, default=5, help="steps per round (dispatch)")
    ap.add_argument("--no-dispatch", action="store_true", help="skip the EP backends")
    ap.add_argument("--only", nargs="+", choices=["block", "scaling", "efficiency"],
                    default=["block", "scaling", "efficiency"])
    ap.add_argument("--out", default="bench_results.json")
    ap.add_argument("--dispatch-child", default="", help=argparse.SUPPRESS)  # JSON out path
    args = ap.parse_args()
    if args.dispatch_child:
        rows, pargs = dispatch_here(args)
        with open(args.dispatch_child, "w") as f:
            json.dump({"rows": rows, "args": pargs}, f, default=str)
        return

    t0 = time.perf_counter()
    host_memory.configure("auto")  # the trainer's default (one CPU device: retain), before JAX starts
    results = {"cpu_matmul_peak_gflops": metrics.measured_cpu_peak() / 1e9}
    results["moe_block"] = moe_block(args) if "block" in args.only else []
    results["expert_scaling"] = expert_scaling(args) if "scaling" in args.only else []
    results["efficiency"] = efficiency(args) if "efficiency" in args.only else []
    if not args.no_dispatch:
        results["dispatch"], results["dispatch_args"] = dispatch_backends(args)
    results["args"] = vars(args)
    results["seconds"] = time.perf_counter() - t0
    print(markdown(results, args))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=lambda o: dataclasses.asdict(o)
                  if dataclasses.is_dataclass(o) else str(o))
    print(f"\n{results['seconds']:.0f} s; numbers in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
