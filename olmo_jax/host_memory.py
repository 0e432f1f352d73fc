"""The host allocator's policy for a training process (`trainer.host_malloc`).

XLA:CPU allocates a step's temporaries and outputs with the C library's malloc, every
call. glibc hands out each block over 32 MB (its largest mmap threshold) as a fresh
`mmap` and `munmap`s it on free, and a thread outside the main arena gets a fresh mmap
for any block over 64 MB whatever the threshold. So every step first-touches its large
buffers again, one page fault per 4 KiB page: ~235k faults per step of the CPU benchmark
shape (tools/bench/bench_vs_torch.py), a tenth of its time on this project's VM.

`retain` makes glibc keep freed blocks for reuse, as a caching allocator does: one
arena for all threads (`M_ARENA_MAX=1`), no mmap'd chunks (`M_MMAP_MAX=0`, so every
block comes from the heap), and no trimming of the heap's top (`M_TRIM_THRESHOLD`). The
process's resident memory then stays at its high-water mark instead of returning to the
kernel (the benchmark shape: 1.7 -> 2.5 GB). One arena is one lock: where several
devices' threads allocate at once (a host-platform mesh of fake CPU devices, as the
tests run) the contention costs more than the faults (+20% and more on the parallel
tests, sys time doubled), so `auto` keeps glibc's arenas there. The arena count is fixed
when a thread first allocates, so this must run before JAX starts its backend (its
thread pools); later it would change nothing and `configure` says so and leaves malloc
alone.

- `MODES`: auto (retain where the process computes on one CPU device, i.e. JAX will
  pick no accelerator plugin and no more host devices are forced; system elsewhere) |
  retain | system (glibc's defaults).
- `configure(mode)`: applies `mode` and returns what was applied: "retain" | "system".
- `retain_tunables()`: the same policy as a `GLIBC_TUNABLES` value, for a process that is
  not olmo_jax's (tools/bench/bench_vs_torch.py offers it to the torch side).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import logging
import os
import pkgutil
import re

from olmo_jax.errors import check_choice

MODES = ("auto", "retain", "system")

# `retain` as (glibc tunable, mallopt(3) parameter, value); the threshold is an int, and
# its largest value means "never trim".
_RETAIN = (("arena_max", -8, 1), ("mmap_max", -4, 0), ("trim_threshold", -1, 2**31 - 1))

_log = logging.getLogger(__name__)


def accelerator_plugins() -> list[str]:
    """The accelerator PJRT plugins JAX would find in this environment, without starting
    JAX: the `jax_plugins` namespace packages and entry points, and libtpu."""
    found = set()
    try:
        import jax_plugins  # noqa: PLC0415 (a namespace package; absent without plugins)

        found |= {m.name for m in pkgutil.iter_modules(jax_plugins.__path__)}
    except ImportError:
        pass
    found |= {ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")}
    if importlib.util.find_spec("libtpu") is not None:
        found.add("libtpu")
    return sorted(found)


def runs_on_cpu() -> bool:
    """Whether JAX will compute on this process's CPU: `jax_platforms` (JAX_PLATFORMS)
    names cpu first, or it is unset and no accelerator plugin is installed."""
    import jax

    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not accelerator_plugins()


def cpu_device_count() -> int:
    """The CPU devices JAX will make: `jax_num_cpu_devices`, else XLA_FLAGS'
    --xla_force_host_platform_device_count (its last value), else 1."""
    import jax

    if jax.config.jax_num_cpu_devices > 0:
        return jax.config.jax_num_cpu_devices
    counts = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(counts[-1]) if counts else 1


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def configure(mode: str) -> str:
    """Apply the allocator policy `mode` (one of MODES) to this process and return the one
    applied; ConfigError for another mode. `retain` needs glibc and a JAX backend not
    started yet; without either it logs why and leaves malloc as it is ("system")."""
    check_choice("trainer.host_malloc", mode, MODES)
    if mode == "auto":
        mode = "retain" if runs_on_cpu() and cpu_device_count() == 1 else "system"
    if mode == "system":
        return "system"
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        _log.warning("trainer.host_malloc=retain: JAX's backend has already started, so its "
                     "threads keep glibc's arenas; leaving malloc as it is (configure it "
                     "before the first JAX computation)")
        return "system"
    libc = _glibc()
    if libc is None:
        _log.warning("trainer.host_malloc=retain needs glibc's mallopt; not found, so "
                     "leaving malloc as it is")
        return "system"
    for _, param, value in _RETAIN:
        if libc.mallopt(param, value) != 1:
            raise OSError(f"mallopt({param}, {value}) failed")
    return "retain"


def retain_tunables() -> str:
    """`retain` as the value of GLIBC_TUNABLES (read by glibc when a process starts)."""
    return ":".join(f"glibc.malloc.{name}={value}" for name, _, value in _RETAIN)
