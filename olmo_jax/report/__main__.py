"""python -m olmo_jax.report: one self-contained HTML page of a run or a plan.

    python -m olmo_jax.report RUN_DIR [--out=PATH] [--devices=N]
    python -m olmo_jax.report --config=configs/X.py [--config.parallel.expert=4 ...] [--out=PATH] [--devices=N]
        [--device-kind=b300|b200|h200|h100|cpu]

A run folder gives its mesh and placement, one token's dispatch route, the pipeline
schedule, the loss / tokens/s / MFU curves and the expert-load heatmap with the imbalance
and dropped-fraction curves; a config (plan mode) gives the mesh, route and schedule, and
the memory per device and bytes per collective. The page is written to
RUN_DIR/report.html (plan mode: reports/<config name>.html) or --out, and its path printed.
RUN_DIR may be in a bucket (`s3://`): its config, metrics, expert counts and mesh are
read from there and report.html is uploaded next to them (or written to --out).
The mesh is built from fake CPU devices (nothing is allocated); --devices sets how many
(default: the run's mesh.json, else parallel.pipe x data x expert when none is -1, else
the local device count).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from absl import flags

from olmo_jax import cli, storage
from olmo_jax import config as config_lib
from olmo_jax.errors import ConfigError, DataError
from olmo_jax.planner import hardware
from olmo_jax.report import page, sources

FLAGS = flags.FlagValues()
_CONFIG = cli.define_config_flag(
    FLAGS, "Plan mode: a config file (configs/*.py), with --config.a.b=c overrides.")
_OUT = flags.DEFINE_string("out", "", "Output HTML path.", flag_values=FLAGS)
_DEVICES = flags.DEFINE_integer("devices", 0, "Devices of the mesh (0 = see above).", flag_values=FLAGS)
_KIND = flags.DEFINE_string("device-kind", "b300", "Plan mode: the device (b300 | b200 | h200 | h100 | "
                            "cpu) the step is compiled for (a GPU: by XLA:GPU where the planner "
                            "can, olmo_jax/planner/xla_gpu.py) and whose HBM the peak memory is "
                            "compared to.", flag_values=FLAGS)


def _use_devices(n: int) -> None:
    """Fake CPU devices for the mesh: set before jax touches a backend."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    if n > 0:
        jax.config.update("jax_num_cpu_devices", n)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help", "-help") for a in argv[1:]):
        print(__doc__)
        print(FLAGS.main_module_help() if hasattr(FLAGS, "main_module_help") else "")
        return 0
    try:
        rest = cli.parse(argv, FLAGS)[1:]
    except cli.UsageError as e:
        return cli.error(str(e))
    cfg = _CONFIG.value
    if (cfg is None) == (len(rest) != 1):
        return cli.error("pass either one run folder (python -m olmo_jax.report RUN_DIR) or "
                     "--config=configs/<name>.py (plan mode), not both"
                     if cfg is not None else
                     "pass one run folder (python -m olmo_jax.report RUN_DIR) or --config=configs/<name>.py")
    if _KIND.value not in hardware.KINDS:
        return cli.error(f"--device-kind={_KIND.value}: choose one of {', '.join(hardware.KINDS)}")
    if _DEVICES.value < 0:
        return cli.error(f"--devices={_DEVICES.value} must be > 0 (or 0: from the run or config)")
    if cfg is not None:
        try:
            cfg = config_lib.parse(cfg)  # the typed sections; checked by sources.model_config
        except ConfigError as e:
            return cli.error(str(e))
    tmp = tempfile.mkdtemp(prefix="olmo_jax_report_") if cfg is None and storage.is_remote(rest[0]) else None
    try:
        return _report(cfg, rest, tmp)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _report(cfg, rest: list[str], tmp: str | None) -> int:
    """The page of run folder rest[0] (`tmp`: the local folder its bucket's files go to)
    or of config `cfg`."""
    n = 0
    try:
        if cfg is None:
            run = sources.load_run(sources.fetch_run(rest[0], Path(tmp)) if tmp else rest[0])
            n = sources.device_count(run.cfg, run.mesh_shape, _DEVICES.value)
            _use_devices(n)
            model_cfg = sources.model_config(run.cfg)
            data = page.run_page(run, model_cfg)
            out = Path(_OUT.value or run.path / "report.html")
        else:
            n = sources.device_count(cfg, None, _DEVICES.value)
            _use_devices(n)
            model_cfg = sources.model_config(cfg)
            config_path = cli.config_filename(FLAGS)
            data = page.plan_page(cfg, model_cfg, config_path, _KIND.value)
            out = Path(_OUT.value or Path("reports") / f"{Path(config_path).stem}.html")
    except (ConfigError, DataError, sources.ReportError) as e:
        if isinstance(e, ConfigError) and n == 0:  # a -1 axis filled whatever devices there were
            import jax

            return cli.error(f"{e} (the mesh was filled from {jax.device_count()} local device(s); "
                         f"pass --devices=N to size it)")
        return cli.error(str(e))
    written = page.write(data, out)
    if tmp and not _OUT.value:  # a run folder in a bucket: the page goes next to its files
        url = storage.join(rest[0], "report.html")
        try:
            storage.write_bytes(url, written.read_bytes())
        except OSError as e:
            return cli.error(storage.storage_error(url, e, "writing"))
        print(url)
        return 0
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
