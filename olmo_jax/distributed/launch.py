"""Which process of which run this is: the launch, from flags, environment or SLURM.

Each setting is taken from the first source that has it:
  1. flags        --coordinator HOST:PORT --num_processes N --process_id I
  2. environment  OLMO_JAX_COORDINATOR, OLMO_JAX_NUM_PROCESSES, OLMO_JAX_PROCESS_ID
  3. SLURM        inside `srun` with SLURM_NTASKS > 1: SLURM_NTASKS, SLURM_PROCID, and the
                  coordinator on the step's first node (port from the job id, as JAX's own
                  SLURM detection; OLMO_JAX_COORDINATOR overrides it)
With none of them the run is one process. A partial launch (say a process id but no
coordinator) is refused, naming what is missing.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from olmo_jax.errors import ConfigError

ENV = {
    "coordinator": "OLMO_JAX_COORDINATOR",
    "num_processes": "OLMO_JAX_NUM_PROCESSES",
    "process_id": "OLMO_JAX_PROCESS_ID",
}
_FLAG = {"coordinator": "--coordinator", "num_processes": "--num_processes",
         "process_id": "--process_id"}


@dataclasses.dataclass(frozen=True)
class Launch:
    """A multi-process launch (`num_processes` > 1), or None for a single process."""

    coordinator: str  # HOST:PORT where process 0 serves JAX's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None  # None = every local device
    source: str = "flags"  # where it came from: flags / environment / slurm (for messages)


def _slurm(environ: Mapping[str, str]) -> dict | None:
    """The SLURM task's launch when inside a multi-task `srun` step, else None."""
    needed = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if not all(k in environ for k in needed) or int(environ["SLURM_NTASKS"]) <= 1:
        return None
    from jax._src.clusters.slurm_cluster import SlurmCluster  # the node-list parsing of JAX

    saved = {k: os.environ.get(k) for k in needed}
    os.environ.update({k: environ[k] for k in needed})
    try:
        coordinator = SlurmCluster.get_coordinator_address(None, environ.get("JAX_COORDINATOR_PORT"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    n_tasks = int(environ["SLURM_NTASKS"])
    n_nodes = int(environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", n_tasks)))
    per_node = math.ceil(n_tasks / max(n_nodes, 1))
    return {
        "coordinator": coordinator,
        "num_processes": n_tasks,
        "process_id": int(environ["SLURM_PROCID"]),
        # One task per node drives all the node's devices; several share them out.
        "local_device_ids": (int(environ["SLURM_LOCALID"]),) if per_node > 1 else None,
    }


def detect(flag_values: Mapping[str, object] | None = None,
           environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launch described by `flag_values` (coordinator / num_processes / process_id from
    the command line, None where not given), the environment and SLURM."""
    environ = os.environ if environ is None else environ
    flag_values = flag_values or {}
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for key, env_name in ENV.items():
        if flag_values.get(key) is not None:
            values[key], sources[key] = flag_values[key], "flags"
        elif environ.get(env_name, "") != "":
            raw = environ[env_name]
            if key != "coordinator":
                try:
                    raw = int(raw)
                except ValueError as e:
                    raise ConfigError(f"{env_name}={environ[env_name]!r} must be an integer") from e
            values[key], sources[key] = raw, "environment"
    slurm = _slurm(environ) if len(values) < 3 else None
    local_ids = None
    if slurm is not None:
        for key in ENV:
            values.setdefault(key, slurm[key])
            sources.setdefault(key, "slurm")
        local_ids = slurm["local_device_ids"]
    if not values:
        return None
    missing = [k for k in ENV if k not in values]
    if missing:
        raise ConfigError(
            "an incomplete multi-process launch: "
            + ", ".join(f"{k} from {sources[k]}" for k in values)
            + " but no "
            + ", ".join(f"{k} ({_FLAG[k]} or {ENV[k]})" for k in missing)
            + "; give all three, or none for a single process"
        )
    n, pid, coordinator = int(values["num_processes"]), int(values["process_id"]), str(values["coordinator"])
    if n < 1:
        raise ConfigError(f"num_processes={n} must be >= 1 ({_FLAG['num_processes']} / {ENV['num_processes']})")
    if not 0 <= pid < n:
        raise ConfigError(
            f"process_id={pid} must be in 0..{n - 1} (num_processes={n}); number the processes "
            f"0..{n - 1} ({_FLAG['process_id']} / {ENV['process_id']})"
        )
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"coordinator={coordinator!r} must be HOST:PORT, the address of process 0 and a free "
            f"port on it ({_FLAG['coordinator']} / {ENV['coordinator']})"
        )
    if n == 1:
        return None
    return Launch(coordinator, n, pid, local_ids, source="/".join(sorted(set(sources.values()))))
