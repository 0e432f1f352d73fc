"""Preflight: before the first step, the train step is compiled ahead of time (on the
state's abstract shapes and shardings, so nothing is allocated yet) and XLA's memory
analysis of the compiled program gives the per-device peak estimate

    arguments + outputs - aliased (donated state) + temporaries + generated code

which must fit the memory available per device: `trainer.memory_limit_gb` when > 0, else
the accelerator's own limit (`bytes_limit` of its memory stats) or, on CPU, the physical
RAM shared by the process's devices. A run that cannot fit is refused with both numbers
and the knobs that reduce the estimate; `trainer.memory_limit_gb` < 0 skips the check.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from olmo_jax.config import RunConfig
from olmo_jax.errors import ConfigError

GB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

    @classmethod
    def of(cls, compiled) -> MemoryEstimate:
        m = compiled.memory_analysis()
        return cls(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                   m.temp_size_in_bytes, m.generated_code_size_in_bytes)


def available_bytes(limit_gb: float, devices=None) -> tuple[int, str]:
    """(bytes available per device, where that number comes from)."""
    if limit_gb > 0:
        return int(limit_gb * GB), f"trainer.memory_limit_gb={limit_gb:g}"
    devices = list(devices if devices is not None else jax.local_devices())
    stats = devices[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{devices[0].device_kind} memory"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = sum(d.platform == "cpu" for d in devices) or 1
    return ram // n, f"physical RAM {ram / GB:.1f} GiB / {n} local CPU devices"


def _knobs(cfg: RunConfig) -> str:
    m, t, p = cfg.model, cfg.trainer, cfg.parallel
    knobs = []
    if m.remat != "block":
        knobs.append(f"model.remat=block (recompute activations; now {m.remat!r})")
    knobs.append(f"more microbatches, trainer.grad_accum (now {t.grad_accum})")
    knobs.append(f"a shorter trainer.seq_len (now {t.seq_len}) or a smaller "
                 f"trainer.global_batch_size (now {t.global_batch_size})")
    if m.dtype != "bfloat16":
        knobs.append(f"model.dtype=bfloat16 (now {m.dtype!r})")
    knobs.append(f"more devices for the experts or layers: parallel.expert (now {p.expert}), "
                 f"parallel.pipe (now {p.pipe})")
    if not p.zero1:
        knobs.append("parallel.zero1=True (shard the optimizer state)")
    return "; ".join(knobs)


def check(compiled, cfg: RunConfig, devices=None) -> tuple[MemoryEstimate, int, str]:
    """(estimate, available bytes, their source) of the step `compiled` for the run's
    sections `cfg`; raises ConfigError when it cannot fit."""
    estimate = MemoryEstimate.of(compiled)
    limit_gb = cfg.trainer.memory_limit_gb
    available, source = available_bytes(limit_gb, devices)
    if limit_gb >= 0 and estimate.total > available:
        e = estimate
        raise ConfigError(
            f"the train step needs an estimated {e.total / GB:.3g} GiB per device (arguments "
            f"{e.arguments / GB:.3g}, outputs {e.outputs / GB:.3g} of which {e.aliased / GB:.3g} "
            f"reuse donated inputs, temporaries {e.temporaries / GB:.3g}, code "
            f"{e.code / GB:.3g}) but {available / GB:.3g} GiB are available ({source}); it "
            f"would run out of memory. To reduce it: {_knobs(cfg)}. (trainer.memory_limit_gb "
            "sets the limit; < 0 skips this check)"
        )
    return estimate, available, source
