"""Entry point: python -m olmo_jax.train --config=configs/X.py --config.a.b=c

Overrides are type-checked against the config file's fields (`lock_config=True`); an
override of a field that does not exist fails before anything runs, naming the field and
the nearest existing ones.

Multi-process runs (one process per host): add --coordinator HOST:PORT --num_processes N
--process_id I, or the OLMO_JAX_* variables, or start it with `srun` (olmo_jax/distributed).

Exit codes: 0 done or preempted (a checkpoint saved; rerun to resume), 1 training halted
on bad steps (trainer.nan_policy), 2 bad input (config, data, checkpoint, run_dir,
memory, a run folder another trainer owns), 74 a storage failure (a checkpoint write
failed, e.g. a full disk; free space and rerun to resume), 75 a lost process in a
multi-process run (relaunch to resume).
"""

from __future__ import annotations

import errno
import os
import sys
import traceback

import jax
from absl import app, flags, logging

from olmo_jax import cli, distributed, host_memory
from olmo_jax import config as config_lib
from olmo_jax.errors import ConfigError, DataError, StorageError

# A write that failed for the storage's sake (exit cli.EXIT_STORAGE, not a traceback).
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS}

# A multi-process launch (olmo_jax/distributed/launch.py): flags, else OLMO_JAX_* / SLURM.
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "HOST:PORT of process 0 (multi-process runs; env OLMO_JAX_COORDINATOR)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes in the run (env OLMO_JAX_NUM_PROCESSES)."
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's id in 0..num_processes-1 (env OLMO_JAX_PROCESS_ID)."
)


def run_training(cfg) -> int:
    """Trains the run config `cfg` (a ConfigDict, validated here into its typed sections)
    as the command line does; returns the exit code. A user's error (bad config, data,
    checkpoint, run_dir, memory) or a halted run prints one `error:` line, no traceback;
    in a multi-process run the other processes are told and stop too."""
    from olmo_jax.trainer.guard import TrainingHalted
    from olmo_jax.trainer.loop import train

    try:
        train(config_lib.validate(cfg))
    except (ConfigError, DataError) as e:
        return distributed.report_error(str(e), cli.EXIT_BAD_INPUT)
    except TrainingHalted as e:
        return distributed.report_error(str(e), 1)
    except StorageError as e:
        return distributed.report_error(str(e), cli.EXIT_STORAGE)
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:
            raise
        return distributed.report_error(
            f"cannot write {e.filename or 'a file of the run'}: {e.strerror}; free space (or fix "
            "the storage), then run the same command again to resume from the last checkpoint",
            cli.EXIT_STORAGE)
    except BaseException as e:
        if jax.process_count() == 1 or isinstance(e, SystemExit):
            raise
        # Several processes: a crash here must not leave the others waiting in a collective.
        traceback.print_exc()
        if isinstance(e, jax.errors.JaxRuntimeError):  # e.g. a collective whose peer died
            distributed.await_lost_peer()
        return distributed.report_error(f"{type(e).__name__}: {e}", 1)
    distributed.finish()
    return 0


def main(argv: list[str]) -> None:
    cfg = cli.required_config(argv)
    logging.set_verbosity(logging.WARNING)  # jax's backend-probing INFO lines
    try:
        trainer = config_lib.parse(cfg).trainer  # run_training validates every section
        host_memory.configure(trainer.host_malloc)  # before JAX starts its backend
        launch = distributed.detect({"coordinator": _COORDINATOR.value,
                                     "num_processes": _NUM_PROCESSES.value,
                                     "process_id": _PROCESS_ID.value})
        distributed.initialize(launch, trainer.peer_timeout_s)
    except ConfigError as e:
        cli.fail(str(e))
    code = run_training(cfg)
    if code == cli.EXIT_STORAGE:  # orbax's failed writer threads would delay and litter the exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run() -> None:
    app.run(main, flags_parser=cli.parse_flags)


if __name__ == "__main__":
    run()
