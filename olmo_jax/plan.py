"""Entry point: what a run costs, from its compiled program, before renting the devices.

    python -m olmo_jax.plan --config=configs/olmoe3_47b.py [--config.parallel.expert=8 ...]
        [--devices 8] [--device-kind b300|b200|h200|h100|cpu] [--compiler auto|xla_gpu|xla_cpu]
        [--compare-strategies] [--json out.json]

For a GPU `--device-kind` (h100 | h200 | b200 | b300) the step is compiled by XLA:GPU for
`--devices` abstract GPUs of that kind, in the GPU compile venv (.venv-gpu) when this
interpreter has no CUDA plugin; without one, and with `--compiler=xla_cpu`, by XLA:CPU
for fake CPU devices, labelled as the fallback (olmo_jax/planner/xla_gpu.py). `--devices`
defaults to the config's fixed mesh sizes multiplied. The planner AOT-compiles the
trainer's real train step on abstract inputs and prints parameters,
FLOPs per token (formula and compiled HLO), memory per device, collectives per step and the
projected step time on the device kind (olmo_jax/planner). `--compare-strategies` also
plans ddp + expert parallelism and fsdp side by side.
"""

from __future__ import annotations

import json
import math
import sys

from absl import app, flags, logging

from olmo_jax import cli
from olmo_jax import config as config_lib
from olmo_jax.errors import ConfigError, DataError

_DEVICES = flags.DEFINE_integer(
    "devices", None, "devices of the mesh: abstract GPUs of --device-kind, or fake CPU devices "
    "(default: the config's fixed parallel.* sizes multiplied)")
_KIND = flags.DEFINE_string("device-kind", "b300", "b300 | b200 | h200 | h100 | cpu: the "
                            "roofline's device (a GPU: compiled by XLA:GPU, see --compiler)")
_COMPARE = flags.DEFINE_bool("compare-strategies", False, "also plan ddp + EP and fsdp side "
                             "by side")
_JSON = flags.DEFINE_string("json", None, "write the plan's numbers to this JSON file")
_COMPILER = flags.DEFINE_enum("compiler", "auto", ["auto", "xla_gpu", "xla_cpu"],
                              "auto: XLA:GPU for a GPU --device-kind where a GPU compile venv "
                              "exists, else the XLA:CPU fallback (labelled); xla_gpu: refuse "
                              "the fallback; xla_cpu: the XLA:CPU program")


def default_devices(parallel) -> int:
    sizes = (parallel.pipe, parallel.data, parallel.expert)
    return math.prod(s for s in sizes if s > 0)


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)
    try:
        run_cfg = config_lib.validate(cli.required_config(argv))
    except ConfigError as e:
        cli.fail(str(e))
    n = _DEVICES.value or default_devices(run_cfg.parallel)
    if n < 1:
        cli.fail(f"--devices={n} must be >= 1")
    from olmo_jax.planner import hardware
    from olmo_jax.planner.api import plan_config  # jax's backend starts inside it, with n devices

    if _KIND.value not in hardware.KINDS:
        cli.fail(f"--device-kind={_KIND.value}: choose one of {', '.join(hardware.KINDS)}")
    path = cli.config_filename()
    try:
        out = plan_config(run_cfg, n, _KIND.value, compare=_COMPARE.value, compiler=_COMPILER.value,
                          config_path=path)
    except (ConfigError, DataError, RuntimeError) as e:  # RuntimeError: the XLA:GPU worker's
        cli.fail(str(e))
    print(out["text"])
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(out["json"], f, indent=1, default=str)
        print(f"\nnumbers written to {_JSON.value}", file=sys.stderr)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
