"""The accelerators a plan can target: peak FLOP/s, HBM size and bandwidth, and the
bandwidth of the links between devices, with where each number comes from.

Peak FLOP/s are `olmo_jax.metrics.PEAK_FLOPS` (dense, no sparsity; the B300 figure is
the one OLMo-core's MFU uses, docs/reference.md). Link bandwidths are per GPU and per direction:
NVLink inside a node of `gpus_per_node` GPUs, the GPU's own network adapter (one NIC per
GPU, rail-optimized) between nodes.

Sources (vendor datasheets):
  B300  HGX B300 / Blackwell Ultra: 288 GB HBM3e at 8 TB/s; NVLink 5, 1.8 TB/s per GPU
        (both directions); ConnectX-8 SuperNIC, 800 Gb/s per GPU.
        https://www.nvidia.com/en-us/data-center/hgx/ ,
        https://www.nvidia.com/en-us/data-center/technologies/blackwell-architecture/
  H200  H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s; NVLink 4, 900 GB/s per GPU (both
        directions); DGX H200 / HGX H200: ConnectX-7, 400 Gb/s per GPU.
        https://www.nvidia.com/en-us/data-center/h200/
  H100  H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s; NVLink 4, 900 GB/s per GPU (both
        directions); DGX H100: ConnectX-7, 400 Gb/s per GPU.
        https://www.nvidia.com/en-us/data-center/h100/
  cpu   this machine, measured: the matmul peak (metrics.measured_cpu_peak) and a large
        array copy, both shared by the fake devices of a simulated mesh.

  B200  HGX B200: 180 GB HBM3e at 8 TB/s; NVLink 5, 1.8 TB/s per GPU (both directions);
        DGX B200: ConnectX-7, 400 Gb/s per GPU.
        https://www.nvidia.com/en-us/data-center/dgx-b200/

What a GPU sustains, not its datasheet (`DeviceSpec.matmul_efficiency`, `link_efficiency`):
  matmuls  MATMUL_EFFICIENCY of the dense peak: measured on the lent H200, a bf16 8192^3
           matmul ran at 769-798 TFLOP/s of 989 (the midpoint, 783.5 / 989 = 0.792). The
           same fraction is assumed for the other GPU kinds (not measured on them).
  links    LINK_EFFICIENCY of the per-direction bandwidth: the bus bandwidth NCCL sustains
           on large messages (assumed, not measured here).
  HBM      at the datasheet bandwidth (no efficiency applied).

Collective time (`link_seconds`) uses NCCL's bus-bandwidth factors (nccl-tests,
doc/PERFORMANCE.md): a ring all-gather / reduce-scatter / all-to-all moves (g-1)/g of the
full buffer over each device's link, an all-reduce 2(g-1)/g, a collective-permute all of it,
at `link_efficiency` of the link's bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools

from olmo_jax import metrics

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    kind: str
    peak_flops: dict[str, float]  # dense FLOP/s by compute dtype
    hbm_bytes: float  # memory per device
    hbm_bw: float  # bytes/s
    intra_bw: float  # bytes/s per direction inside a node (NVLink)
    inter_bw: float  # bytes/s per direction between nodes (the GPU's NIC)
    gpus_per_node: int
    measured: bool = False  # numbers measured on this machine, not from a datasheet
    matmul_efficiency: float = 1.0  # fraction of the peak a large matmul sustains
    link_efficiency: float = 1.0  # fraction of the link bandwidth a collective sustains

    def peak(self, dtype: str) -> float:
        """The datasheet's dense peak FLOP/s (MFU's denominator)."""
        return self.peak_flops.get(dtype, self.peak_flops["bfloat16"])

    def matmul_flops(self, dtype: str) -> float:
        """FLOP/s a matmul is priced at: the peak x matmul_efficiency."""
        return self.peak(dtype) * self.matmul_efficiency


# bf16 8192^3 matmul on the lent H200: 769-798 TFLOP/s of 989 (module docstring).
MATMUL_EFFICIENCY = (769e12 + 798e12) / 2 / metrics.PEAK_FLOPS["h200"]["bfloat16"]
LINK_EFFICIENCY = 0.8


def _gpu(kind: str, hbm: float, hbm_bw: float, intra: float, inter: float) -> DeviceSpec:
    return DeviceSpec(kind, metrics.PEAK_FLOPS[kind], hbm, hbm_bw, intra, inter, 8,
                      matmul_efficiency=MATMUL_EFFICIENCY, link_efficiency=LINK_EFFICIENCY)


DEVICES = {
    "b300": _gpu("b300", 288 * GB, 8.0e12, 900 * GB, 100 * GB),
    "b200": _gpu("b200", 180 * GB, 8.0e12, 900 * GB, 50 * GB),
    "h200": _gpu("h200", 141 * GB, 4.8e12, 450 * GB, 50 * GB),
    "h100": _gpu("h100", 80 * GB, 3.35e12, 450 * GB, 50 * GB),
}
KINDS = tuple(DEVICES) + ("cpu",)

# Wire bytes per buffer byte of one collective over a group of g devices (nccl-tests).
_BUS_FACTOR = {
    "all-gather": lambda g: (g - 1) / g,
    "reduce-scatter": lambda g: (g - 1) / g,
    "all-to-all": lambda g: (g - 1) / g,
    "ragged-all-to-all": lambda g: (g - 1) / g,
    "all-reduce": lambda g: 2 * (g - 1) / g,
    "collective-permute": lambda g: 1.0,
    "collective-broadcast": lambda g: 1.0,
}


@functools.cache
def measured_cpu_bandwidth(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes/s of a large float32 array copy on this machine (read + write counted)."""
    import jax
    import jax.numpy as jnp

    from olmo_jax.metrics import best_seconds

    a = jax.device_put(jnp.ones((n_bytes // 4,), jnp.float32), jax.devices("cpu")[0])
    return 2 * n_bytes / best_seconds(jax.jit(lambda x: x + 1.0), a, repeats)


def device_spec(kind: str, n_devices: int = 1) -> DeviceSpec:
    """The spec for `kind`; "cpu" is this machine measured now, split over `n_devices`
    fake devices (they share its cores and memory bus; copies between them are memory
    copies)."""
    if kind in DEVICES:
        return DEVICES[kind]
    if kind != "cpu":
        raise ValueError(f"--device-kind={kind!r}: choose one of {', '.join(KINDS)}")
    peak = metrics.measured_cpu_peak() / n_devices
    bw = measured_cpu_bandwidth() / n_devices
    return DeviceSpec("cpu", {"bfloat16": peak, "float32": peak}, 0.0, bw, bw, bw,
                      n_devices, measured=True)


def axis_span(mesh_shape: dict[str, int], axes: tuple[str, ...]) -> int:
    """How many consecutive device ids a group over `axes` spans (devices are numbered
    with the last mesh axis fastest)."""
    names = list(mesh_shape)
    outer = min(names.index(a) for a in axes)
    span = 1
    for name in names[outer:]:
        span *= mesh_shape[name]
    return span


def intra_node(mesh_shape: dict[str, int], axes: tuple[str, ...], group_size: int,
               spec: DeviceSpec) -> bool:
    """Whether a collective's group stays inside one node. Without named axes (a group
    the compiler built) it does only when the whole mesh fits in a node."""
    n = 1
    for size in mesh_shape.values():
        n *= size
    span = axis_span(mesh_shape, axes) if axes else (group_size if n <= spec.gpus_per_node
                                                     else n)
    return span <= spec.gpus_per_node


def link_seconds(kind: str, buffer_bytes: float, group_size: int, intra: bool,
                 spec: DeviceSpec) -> float:
    """Seconds one device spends on the wire for one collective of `buffer_bytes`."""
    if group_size <= 1:
        return 0.0
    factor = _BUS_FACTOR.get(kind, lambda g: 1.0)(group_size)
    bw = (spec.intra_bw if intra else spec.inter_bw) * spec.link_efficiency
    return buffer_bytes * factor / bw
