"""Abstract NVIDIA GPUs: XLA:GPU compiles for them on a machine without a GPU.

Each kind has a checked-in target config (`<kind>.txtpb`, an XLA `GpuTargetConfigProto` in
text format; the fields are xla/stream_executor/device_description.proto's). The jax CUDA
plugin (.venv-gpu, `make gpu-venv`) turns it into a topology of compile-only devices:

    mesh = targets.make_mesh("h200", (2, 4), ("data", "expert"))
    jax.jit(f).lower(<ShapeDtypeStructs with NamedShardings on mesh>).compile()

runs XLA:GPU's whole pipeline for that GPU (fusion, Triton/cuDNN/Mosaic GPU kernels, buffer
assignment, collectives); nothing can be executed. The device count is any n ("1x1xn":
one slice, one host, n GPUs on it).

| kind | device_kind            | cc   | SMs | HBM (bytes reported) | HBM TB/s | L2 MiB | GHz   |
|------|------------------------|------|-----|----------------------|----------|--------|-------|
| h100 | NVIDIA H100 80GB HBM3  | 9.0  | 132 | 84,978,434,048       | 3.35     | 50     | 1.98  |
| h200 | NVIDIA H200            | 9.0  | 132 | 150,754,820,096      | 4.8      | 50     | 1.98  |
| b200 | NVIDIA B200            | 10.0 | 148 | 191,514,673,152      | 8.0      | 126.5  | 1.965 |
| b300 | NVIDIA B300 SXM6 AC    | 10.3 | 158 | 297,021,865,984      | 8.0      | 129.25 | 1.965 |

Sources.
- SM count, compute capability, L2, clock, shared memory per block opt-in (227 KiB on all
  four), registers and the reported memory size of h100 / b200 / b300: XLA's own device
  specs (xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb, b200.txtpb, b300.txtpb), which are
  `CudaExecutor::CreateDeviceDescription` of real devices. B300 is sm_103 (10.3).
- H200: the same GH100 die as H100 SXM (132 SMs, 50 MiB L2, 1.98 GHz boost; NVIDIA Hopper
  architecture whitepaper); memory 141 GB HBM3e (H200 datasheet), reported by the driver
  as 143,771 MiB (the number above).
- HBM bandwidth: the datasheets (H100 SXM 3.35 TB/s, H200 4.8 TB/s, DGX B200 64 TB/s and
  DGX B300 64 TB/s for 8 GPUs: 8 TB/s each). XLA's specs hold the driver's lower
  estimate (memory clock x bus width); XLA uses it only in its cost model.
- cuDNN version (`gpu_device_info.dnn_version`): the pinned nvidia-cudnn-cu12 of
  tools/requirements/gpu.txt. It matters: the compiler takes the cuDNN version from that
  field (not from `dnn_version_info`, which the compile-only client drops) and below 9.7
  rewrites `jax.nn.scaled_matmul` into a dequantize + dot instead of cuDNN's block-scaled
  GEMM (`__cudnn$blockScaledDot`).

`capability_of(device)` / `num_sms_of(device)`: a real CUDA device's own attributes; an
abstract device's kind is recognised by its `device_kind` (the config's
`device_description_str`), and the table answers; None for a device that is no GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from pathlib import Path

KINDS = ("h100", "h200", "b200", "b300")
_DIR = Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    kind: str
    device_kind: str  # what jax reports as device.device_kind
    capability: tuple[int, int]
    num_sms: int
    memory_bytes: int
    memory_bandwidth: int  # bytes / s
    l2_bytes: int
    clock_ghz: float
    dnn_version: str

    @property
    def target_config(self) -> str:
        return target_config(self.kind)


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown GPU kind {kind!r}: choose one of {', '.join(KINDS)}")
    return kind


def target_config(kind: str) -> str:
    """The GpuTargetConfigProto text of `kind`."""
    return (_DIR / f"{_check_kind(kind)}.txtpb").read_text()


def _field(text: str, name: str) -> str:
    m = re.search(rf"^\s*{name}:\s*(\S+)\s*$", text, re.MULTILINE)
    if m is None:
        raise ValueError(f"olmo_jax/targets: field {name!r} missing")
    return m.group(1).strip('"')


@functools.cache
def spec(kind: str) -> GpuSpec:
    """The table row of `kind`, read from its target config."""
    text = target_config(kind)
    cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text).group(1)
    major = int(re.search(r"major:\s*(\d+)", cc).group(1))
    minor = re.search(r"minor:\s*(\d+)", cc)
    desc = re.search(r'^device_description_str:\s*"([^"]*)"', text, re.MULTILINE).group(1)
    return GpuSpec(
        kind=kind, device_kind=desc, capability=(major, int(minor.group(1)) if minor else 0),
        num_sms=int(_field(text, "core_count")),
        memory_bytes=int(_field(text, "device_memory_size")),
        memory_bandwidth=int(_field(text, "memory_bandwidth")),
        l2_bytes=int(_field(text, "l2_cache_size")),
        clock_ghz=float(_field(text, "clock_rate_ghz")),
        dnn_version=_field(text, "dnn_version"),
    )


def _plugin_missing() -> RuntimeError:
    return RuntimeError(
        "abstract GPUs need the jax CUDA plugin (jax-cuda12-plugin and jax-cuda12-pjrt): "
        "run in .venv-gpu (`make gpu-venv`; tools/requirements/gpu.txt)"
    )


@functools.cache
def topology(kind: str, n: int):
    """A `jax.experimental.topologies.TopologyDescription` of n abstract `kind` GPUs
    (cached: the same devices for the same (kind, n))."""
    _check_kind(kind)
    if n < 1:
        raise ValueError(f"n={n}: at least one GPU")
    # No CUDA driver here: the plugin's check of the installed CUDA libraries against the
    # driver would refuse to start; a compile needs neither.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(
            platform="cuda", target_config=target_config(kind), topology=f"1x1x{n}")
    except Exception as e:  # no plugin: jax raises several types, all naming "cuda"
        import importlib.util

        try:
            found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
        except ModuleNotFoundError:  # no jax_plugins namespace at all
            found = False
        if not found:
            raise _plugin_missing() from e
        if "not implemented for cuda" in str(e):
            raise RuntimeError(
                "the jax CUDA plugin is installed but did not start: without a CUDA driver set "
                "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax initialises its backends (the "
                "first jax.devices() or jit); tests/gpu/conftest.py does"
            ) from e
        raise


def abstract_devices(kind: str, n: int) -> list:
    return list(topology(kind, n).devices)


def make_mesh(kind: str, shape, axis_names):
    """A jax.sharding.Mesh of prod(shape) abstract `kind` GPUs."""
    from jax.experimental import topologies

    shape = tuple(int(s) for s in shape)
    return topologies.make_mesh(topology(kind, math.prod(shape)), shape, tuple(axis_names))


def kind_of(device) -> str | None:
    """The kind of a GPU device (abstract or real) by its device_kind; None when it is no
    GPU or a GPU outside the table."""
    if getattr(device, "platform", None) != "gpu":
        return None
    dk = getattr(device, "device_kind", "")
    for k in KINDS:
        if spec(k).device_kind == dk:
            return k
    return None


def _is_real(device) -> bool:
    return bool(getattr(device, "compute_capability", None))


def _abstract_spec(device) -> GpuSpec:
    kind = kind_of(device)
    if kind is None:
        raise ValueError(
            f"abstract GPU device_kind={device.device_kind!r} is none of olmo_jax.targets' "
            f"({', '.join(spec(k).device_kind for k in KINDS)}); make it with "
            "olmo_jax.targets.make_mesh / abstract_devices"
        )
    return spec(kind)


def capability_of(device) -> tuple[int, int] | None:
    """(major, minor) CUDA compute capability of `device`; None when it is no GPU."""
    if getattr(device, "platform", None) != "gpu":
        return None
    if _is_real(device):
        parts = str(device.compute_capability).split(".")
        if not all(p.isdigit() for p in parts[:2]):
            return None  # a ROCm GPU ("gfx90a"): no CUDA capability
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    return _abstract_spec(device).capability


def num_sms_of(device) -> int | None:
    """Streaming multiprocessors of `device`; None when it is no GPU."""
    if getattr(device, "platform", None) != "gpu":
        return None
    if _is_real(device):
        return int(device.core_count)
    return _abstract_spec(device).num_sms
