"""model.moe.gmm_impl=auto against the best grouped matmul each target accepts, for the
reference configs on H100, H200, B200 and B300 (olmo_jax/planner/gmm_compare.py).

Every number is a planner projection, tokens/s/device "as scheduled": an XLA:GPU roofline
of a deviceless compile of the real train step (no GPU ran it). Each config is planned at
its reference batch on its own mesh (47B, 47B-8e: 8 devices; 1.2T, 2.4T: 512), once per
implementation the target accepts (`auto` is the one it resolves to; `tiled` is not
priced, pallas is refused on Blackwell, blas on every GPU). One plan of the 47B takes
minutes on two loaded cores, a 512-device one up to tens of minutes: pick with --configs
and --kinds.

    .venv/bin/python tools/bench/gmm_auto.py [--configs 47b,47b_8e] [--kinds b300,h200] \
        [--tolerance 0.03] [--json out.json]

Prints one row per (config, kind): auto's implementation and projection, the best's, their
ratio, each implementation's, and whether auto is within the tolerance (exit status 1
where it is not). tests/gpu/test_gmm_auto.py checks the same at the smallest shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CONFIGS = {"47b": ("configs/olmoe3_47b.py", 8), "47b_8e": ("configs/olmoe3_47b_8e.py", 8),
           "1p2t": ("configs/olmoe3_1p2t.py", 512), "2p4t": ("configs/olmoe3_2p4t.py", 512)}
KINDS = ("h100", "h200", "b200", "b300")


def load(path: str):
    import importlib.util

    from olmo_jax import config as config_lib

    spec = importlib.util.spec_from_file_location("cfg", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return config_lib.validate(module.get_config())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from olmo_jax.planner import gmm_compare

    rows, ok = [], True
    print("model.moe.gmm_impl=auto vs the best accepted implementation: tokens/s/device as "
          "scheduled, XLA:GPU rooflines of deviceless compiles (not measurements)")
    for name in args.configs.split(","):
        path, n = CONFIGS[name]
        run = load(path)
        for kind in args.kinds.split(","):
            t0 = time.perf_counter()
            cmp = gmm_compare.compare(run, n, kind)
            j = cmp.to_json()
            j.update(config=path, wall_s=time.perf_counter() - t0)
            rows.append(j)
            good = cmp.auto_vs_best >= 1 - args.tolerance
            ok &= good
            impls = ", ".join(
                f"{i} {v['tokens_per_s_per_device_scheduled']:,.0f}"
                + (" [ERROR: dense over groups]" if v["errors"] else "")
                + ("" if v["compiler"] == "XLA:GPU" else f" [{v['compiler']}]")
                for i, v in j["impls"].items())
            print(f"{name:7} {kind:5} {n:4} devices  auto={cmp.candidates.auto:<10} "
                  f"{cmp.tokens_per_s('auto'):>10,.0f}  best={cmp.best:<10} "
                  f"{cmp.tokens_per_s(cmp.best):>10,.0f}  auto/best {cmp.auto_vs_best:.3f} "
                  f"{'ok' if good else 'SLOWER'}  ({impls}; {j['wall_s']:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
