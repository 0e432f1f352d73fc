"""Entry point: what a run costs, from its compiled program, before renting the devices.

    python -m olmo_jax.plan --config=configs/olmoe3_47b.py [--config.parallel.expert=8 ...]
        [--devices 8] [--device-kind b300|h200|h100|cpu] [--compare-strategies] [--json out.json]

Sets up `--devices` fake CPU devices (default: the config's fixed mesh sizes multiplied),
AOT-compiles the trainer's real train step on abstract inputs and prints parameters,
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
from olmo_jax.data.errors import DataError
from olmo_jax.model.config import ConfigError

_DEVICES = flags.DEFINE_integer(
    "devices", None, "fake CPU devices of the mesh (default: the config's fixed parallel.* "
    "sizes multiplied)")
_KIND = flags.DEFINE_string("device-kind", "b300", "b300 | h200 | h100 | cpu: the roofline's "
                            "device")
_COMPARE = flags.DEFINE_bool("compare-strategies", False, "also plan ddp + EP and fsdp side "
                             "by side")
_JSON = flags.DEFINE_string("json", None, "write the plan's numbers to this JSON file")


def default_devices(parallel) -> int:
    sizes = (parallel.pipe, parallel.data, parallel.expert)
    return math.prod(s for s in sizes if s > 0)


def main(argv: list[str]) -> None:
    cfg = cli.required_config(argv)
    logging.set_verbosity(logging.WARNING)
    n = _DEVICES.value or default_devices(cfg.parallel)
    if n < 1:
        cli.fail(f"--devices={n} must be >= 1")
    from olmo_jax.planner import hardware
    from olmo_jax.planner.cli import run  # jax's backend starts inside run, with n devices

    if _KIND.value not in hardware.KINDS:
        cli.fail(f"--device-kind={_KIND.value}: choose one of {', '.join(hardware.KINDS)}")
    path = cli.config_filename()
    try:
        out = run(cfg, n, _KIND.value, _COMPARE.value, path)
    except (ConfigError, DataError) as e:
        cli.fail(str(e))
    print(out["text"])
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(out["json"], f, indent=1, default=str)
        print(f"\nnumbers written to {_JSON.value}", file=sys.stderr)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
