"""Multi-process runs on JAX's distributed runtime: one process per host (SLURM, Kubernetes
or started by hand), all driving one global device mesh.

    launch = distributed.detect()                  # flags, OLMO_JAX_* env, SLURM, or None
    distributed.initialize(launch, peer_timeout_s) # before anything touches a device
    distributed.is_main()                          # process 0 writes logs and metrics
    distributed.place_batch(read_rows, shape, sharding)  # each process reads its rows
    distributed.local_rows(shape, sharding)        # ... which are these

On CPU the processes' collectives go over TCP (JAX's gloo backend, the default of
`jax_cpu_collectives_implementation`); each process's device count comes from XLA_FLAGS
(--xla_force_host_platform_device_count=N), as in a single process. The watchdog
(watchdog.py) turns a lost process into a clean exit of the others.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import jax
import numpy as np

from olmo_jax.distributed.launch import Launch, detect
from olmo_jax.distributed.watchdog import EXIT_PEER_LOST, Watchdog
from olmo_jax.errors import ConfigError

__all__ = [
    "EXIT_PEER_LOST", "Launch", "await_lost_peer", "detect", "finish", "initialize", "is_main",
    "local_rows", "place_batch", "report_error", "rows_reader", "set_hint",
]

_watchdog: Watchdog | None = None


def initialize(launch: Launch | None, peer_timeout_s: float, init_timeout_s: int = 300) -> None:
    """Joins the run's processes (nothing for a single process) and starts the watchdog.
    Must run before the first use of a device."""
    global _watchdog
    if launch is None:
        return
    if peer_timeout_s <= 0:
        raise ConfigError(f"trainer.peer_timeout_s must be > 0, got {peer_timeout_s}")
    try:
        jax.distributed.initialize(
            coordinator_address=launch.coordinator,
            num_processes=launch.num_processes,
            process_id=launch.process_id,
            local_device_ids=list(launch.local_device_ids) if launch.local_device_ids else None,
            cluster_detection_method="deactivate",
            initialization_timeout=init_timeout_s,
            # JAX's own detection is the backstop; the watchdog (peer_timeout_s) reports first.
            heartbeat_timeout_seconds=int(2 * peer_timeout_s + 30),
        )
    except Exception as e:  # the coordination service could not be reached or joined
        raise ConfigError(
            f"process {launch.process_id} of {launch.num_processes} could not join the run at "
            f"{launch.coordinator} (from {launch.source}) within {init_timeout_s} s: {e}; start "
            f"every process 0..{launch.num_processes - 1} with the same coordinator (process 0 "
            "serves it on that port)"
        ) from e
    from jax._src import distributed as jax_distributed  # the client JAX just connected

    _watchdog = Watchdog(jax_distributed.global_state.client, launch.process_id,
                         launch.num_processes, peer_timeout_s).start()


def is_main() -> bool:
    """Process 0: the one that prints, writes metrics and the run's config."""
    return jax.process_index() == 0


def set_hint(text: str) -> None:
    """What a lost process's message tells the user to do (e.g. where the checkpoints are)."""
    if _watchdog is not None:
        _watchdog.hint = text


def finish() -> None:
    """This process ended its run normally (no effect in a single process)."""
    if _watchdog is not None:
        _watchdog.finish()


def await_lost_peer() -> None:
    """After a runtime error in a multi-process run: when it came from a collective whose
    peer died, exit with EXIT_PEER_LOST and the watchdog's message (within
    trainer.peer_timeout_s); else return (no effect in a single process)."""
    if _watchdog is not None:
        _watchdog.await_verdict()


def report_error(message: str, code: int) -> int:
    """Prints `error: message` and returns `code` (the exit code). In a multi-process run
    it exits the process itself after telling the others (they stop with this message
    rather than wait for this process in a collective), skipping JAX's shutdown barrier,
    which would wait for them."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if _watchdog is None:
        return code
    _watchdog.fail(f"process {jax.process_index()} failed: {message}")
    try:  # processes failing alike leave together; one failing alone leaves after the wait
        from jax._src import distributed as jax_distributed

        jax_distributed.global_state.client.wait_at_barrier(
            "olmo_jax/exit", int(min(_watchdog.timeout, 10) * 1000))
    except Exception:
        pass
    sys.stdout.flush()
    os._exit(code)


def place_batch(read_rows: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...],
                sharding: jax.sharding.Sharding) -> jax.Array:
    """The global token array of `shape` ([rows, L], or [microbatches, rows, L]) on
    `sharding`, built from the rows this process's devices hold: `read_rows(ids)` returns
    the global rows `ids` (ids into the flattened leading axes) as [len(ids), L]. Each
    process reads only its own rows; rows several local devices hold are read once."""
    *lead, length = shape
    row_ids = np.arange(int(np.prod(lead))).reshape(lead)
    read: dict[bytes, np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        ids = row_ids[index[:-1]]
        key = ids.tobytes() + str(ids.shape).encode()
        if key not in read:
            read[key] = np.asarray(read_rows(ids.reshape(-1))).reshape(*ids.shape, length)
        return read[key][..., index[-1]]

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def local_rows(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> np.ndarray:
    """The global row ids (into the flattened leading axes of `shape`, as `place_batch`
    numbers them) that this process's devices hold, sorted: what it reads of each batch."""
    *lead, _ = shape
    row_ids = np.arange(int(np.prod(lead))).reshape(lead)
    held = [row_ids[index[:-1]].reshape(-1)
            for index in sharding.addressable_devices_indices_map(tuple(shape)).values()]
    return np.unique(np.concatenate(held))


def rows_reader(row_ids: np.ndarray, rows_BX: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """`read_rows` for `place_batch` from rows already read: rows_BX[i] is global row
    row_ids[i] (sorted, e.g. from `local_rows`)."""
    def read_rows(ids: np.ndarray) -> np.ndarray:
        at = np.searchsorted(row_ids, ids)
        if not np.array_equal(row_ids[np.minimum(at, len(row_ids) - 1)], ids):
            raise ValueError(f"rows {ids} are not all among the rows read ({row_ids})")
        return rows_BX[at]
    return read_rows
