"""Where the step time goes when a config grows its experts: two configs' train steps
compiled by XLA:GPU for abstract GPUs (the planner's compile, deviceless), their per-operation
rooflines summed by (model scope, kind of fusion) and the difference, largest first; then
the tokens/s as scheduled, their ratio and the extra time per token, against a measured
pair (`--reference`) and a goal ratio (`--goal`).

    .venv-gpu/bin/python tools/experiments/expert_scaling.py                 # 47B vs 47B-8e, 8 B300s
    .venv-gpu/bin/python tools/experiments/expert_scaling.py --rows 25 \\
        --big configs/olmoe3_47b.py --small configs/olmoe3_47b_8e.py --kind b200

Rooflines, not measurements: each operation's max(FLOPs / matmul rate, HBM bytes / HBM
bandwidth) on the device's datasheet (olmo_jax/planner/roofline.py). `--reference`
compares the extra time per token with OLMo-core's measured pair (tokens/s/GPU of the
small and the big config)."""

from __future__ import annotations

import argparse
import collections
import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from olmo_jax import targets  # noqa: E402
from olmo_jax.config import validate  # noqa: E402
from olmo_jax.planner import hardware, hlo_cost, plan_build, roofline  # noqa: E402
from olmo_jax.planner.compile import compile_train_step  # noqa: E402

# OLMo-core 3 on 8 B300s (its 47B-8e and 47B benchmark runs): tokens/s/GPU.
OLMO_CORE = (54_500.0, 52_000.0)


def step_rooflines(config: str, kind: str, n: int):
    """({(scope, fusion kind): [roofline s, HBM bytes]}, the Plan) of `config`'s step."""
    run = validate(runpy.run_path(str(ROOT / config))["get_config"]())
    step = compile_train_step(run, targets.abstract_devices(kind, n), kind=kind)
    spec = hardware.device_spec(kind, n)
    plan = plan_build.build(step, spec)
    acc = roofline.Accounting.for_program(True, plan.attention_impl == "cudnn")
    parts = collections.defaultdict(lambda: [0.0, 0.0])
    for op in hlo_cost.program_cost(step.module).ops:
        key = (op.scope, re.sub(r"[.\d]+$", "", op.name))
        parts[key][0] += op.count * roofline.op_seconds(op, spec, run.model.dtype, acc)[1]
        parts[key][1] += op.count * roofline.hbm_bytes(op, acc)
    return parts, plan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big", default="configs/olmoe3_47b.py")
    ap.add_argument("--small", default="configs/olmoe3_47b_8e.py")
    ap.add_argument("--kind", default="b300")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--reference", type=float, nargs=2, default=OLMO_CORE,
                    metavar=("SMALL", "BIG"), help="measured tokens/s/GPU to compare with")
    ap.add_argument("--goal", type=float, default=0.95, help="the big / small ratio sought")
    args = ap.parse_args(argv)
    big, big_plan = step_rooflines(args.big, args.kind, args.devices)
    small, small_plan = step_rooflines(args.small, args.kind, args.devices)
    print(f"per-operation rooflines, {args.devices} {args.kind.upper()}s: {args.big} minus {args.small}")
    print(f"{'diff s':>8} {'big s':>8} {'small s':>8} {'diff HBM TB':>12}  scope, fusion kind")
    keys = sorted(set(big) | set(small),
                  key=lambda k: -(big.get(k, [0, 0])[0] - small.get(k, [0, 0])[0]))
    for k in keys[:args.rows]:
        b, s = big.get(k, [0.0, 0.0]), small.get(k, [0.0, 0.0])
        print(f"{b[0] - s[0]:8.3f} {b[0]:8.3f} {s[0]:8.3f} {(b[1] - s[1]) / 1e12:12.3f}  {k[0]}, {k[1]}")
    tb, ts = (sum(v[0] for v in d.values()) for d in (big, small))
    print(f"{tb - ts:8.3f} {tb:8.3f} {ts:8.3f}  total roofline")
    rate = [p.projection.tokens_per_s(overlap="scheduled") for p in (small_plan, big_plan)]
    extra = 1e6 * (1 / rate[1] - 1 / rate[0])
    ref = args.reference
    ref_extra = 1e6 * (1 / ref[1] - 1 / ref[0])
    print(f"as scheduled: {rate[0]:,.0f} -> {rate[1]:,.0f} tokens/s/GPU, ratio {rate[1] / rate[0]:.3f}, "
          f"{extra:.3f} us more per token")
    print(f"reference: {ref[0]:,.0f} -> {ref[1]:,.0f} tokens/s/GPU, ratio {ref[1] / ref[0]:.3f}, "
          f"{ref_extra:.3f} us more per token; at the reference's extra time per token this "
          f"plan's ratio would be {1 / (1 + ref_extra * 1e-6 * rate[0]):.3f}; a ratio of "
          f"{args.goal} needs at most {1e6 * (1 / args.goal - 1) / rate[0]:.3f} us")


if __name__ == "__main__":
    main()
