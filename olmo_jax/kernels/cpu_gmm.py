"""The routed SwiGLU over expert runs as an XLA FFI call on CPUs (`model.moe.gmm_impl=blas`,
auto's choice there for float32): one SGEMM per expert over its contiguous rows, through
the OpenBLAS that numpy ships, operands read in place. Forward and the custom VJP's
backward are each one call (cpu_gmm.cc); the SwiGLU's element-wise work runs between the
expert's GEMMs. Reference: model/moe/tiled.py's XLA loop and the naive loop in the tests.

The C++ is built on first use (g++, jax.ffi.include_dir()) into a cache folder
($OLMO_JAX_KERNEL_CACHE, else ~/.cache/olmo_jax, else a temporary folder), keyed by the source, jax's version and
the CPU; numpy's OpenBLAS is found by its cblas_sgemm symbol and handed to the library.
`available()` says whether all of that works here (auto falls back to the tiled loop).

Layout: expert e's sizes_E[e] rows start at row starts_E[e], the runs ascending and
disjoint; rows outside them come out zero (and get zero gradient).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import platform as _platform
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from olmo_jax.kernels import vma
from olmo_jax.kernels.vma import cotangent_like

SOURCE = Path(__file__).with_name("cpu_gmm.cc")
FWD, BWD = "olmo_cpu_swiglu_fwd", "olmo_cpu_swiglu_bwd"
CXXFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC")
# numpy's OpenBLAS (64-bit integers, symbols prefixed scipy_ in the scipy-openblas wheels):
# cblas_sgemm, openblas_get_num_threads, openblas_set_num_threads
BLAS_SYMBOLS = {prefix: tuple(prefix + s + "64_" for s in (
    "cblas_sgemm", "openblas_get_num_threads", "openblas_set_num_threads"))
    for prefix in ("scipy_", "")}


class Unavailable(RuntimeError):
    """The FFI kernel cannot be built or loaded here (the message says why)."""


def _cpu_key() -> str:
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines()
                     if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = _platform.processor()
    return f"{_platform.machine()} {flags}"


def _cache_dir() -> Path:
    root = os.environ.get("OLMO_JAX_KERNEL_CACHE") or Path.home() / ".cache" / "olmo_jax"
    return Path(root)


def _build() -> Path:
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join(
        [src, jax.__version__.encode(), " ".join(CXXFLAGS).encode(), _cpu_key().encode()]))
    name = f"cpu_gmm-{key.hexdigest()[:16]}.so"
    out = _cache_dir() / name
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # e.g. a read-only home: a per-user temporary folder
        out = Path(tempfile.gettempdir()) / f"olmo_jax-{os.getuid()}" / name
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / "cpu_gmm.o", Path(tmp) / out.name
        cxx = os.environ.get("CXX", "g++")
        # compiled with -ffast-math (vectorized exp) but linked without it, so that no
        # crtfastmath sets flush-to-zero for the whole process
        cmds = [[cxx, *CXXFLAGS, "-I", jax.ffi.include_dir(), "-c", str(SOURCE), "-o", str(obj)],
                [cxx, "-shared", str(obj), "-o", str(lib)]]
        for cmd in cmds:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as e:
                raise Unavailable(f"cpu_gmm: cannot run the C++ compiler {cxx!r} ({e}); "
                                  "install g++ or set CXX, or use model.moe.gmm_impl=tiled") from e
            if done.returncode:
                raise Unavailable(f"cpu_gmm: building {SOURCE.name} failed:\n{done.stderr[-2000:]}")
        os.replace(lib, out)  # atomic: concurrent builders write the same bytes
    return out


def _blas_addresses() -> tuple[int, int, int]:
    """The addresses of BLAS_SYMBOLS in numpy's OpenBLAS."""
    import numpy as np

    libs = Path(np.__file__).parent.parent / "numpy.libs"
    for path in sorted(glob.glob(str(libs / "*openblas*.so*"))):
        lib = ctypes.CDLL(path)  # numpy has it loaded already: the same handle
        for names in BLAS_SYMBOLS.values():
            fns = [getattr(lib, n, None) for n in names]
            if all(f is not None for f in fns):
                return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in fns)
    raise Unavailable(f"cpu_gmm: no 64-bit OpenBLAS cblas_sgemm in numpy's {libs}; use "
                      "model.moe.gmm_impl=tiled")


@functools.cache
def _register() -> None:
    addresses = _blas_addresses()
    lib = ctypes.CDLL(str(_build()))
    lib.olmo_cpu_gmm_set_blas(*(ctypes.c_void_p(a) for a in addresses))
    for name, sym in ((FWD, lib.OlmoCpuSwigluFwd), (BWD, lib.OlmoCpuSwigluBwd)):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(sym), platform="cpu")


@functools.cache
def available() -> str | None:
    """None when the kernel builds and loads here, else why not."""
    try:
        _register()
    except Unavailable as e:
        return str(e)
    return None


def _require() -> None:
    why = available()
    if why is not None:
        raise Unavailable(why)


def _call(target, outs, *args):
    """The FFI call with every operand and result typed varying like all operands (the
    FFI call requires equal vma; results inherit it)."""
    args = tuple(vma.like(a, *args) for a in args)
    aval = jax.typeof(args[0])
    kw = {}
    if vma.varying_axes(args[0]):  # inside shard_map: results typed on its manual mesh
        kw = {"sharding": NamedSharding(aval.sharding.mesh, PartitionSpec()),
              "manual_axis_type": aval.manual_axis_type}
    shapes_ = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, **kw) for o in outs)
    return jax.ffi.ffi_call(target, shapes_)(*args)


def _fwd_call(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD):
    R, F = x_RD.shape[0], wg_EDF.shape[2]
    outs = (jax.ShapeDtypeStruct(x_RD.shape, x_RD.dtype),
            jax.ShapeDtypeStruct((R, 2 * F), x_RD.dtype))
    return _call(FWD, outs, x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD)


@jax.custom_vjp
def _swiglu(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD):
    return _fwd_call(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD)[0]


def _swiglu_fwd(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD):
    y_RD, gu_RJ = _fwd_call(x_RD, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD)
    return y_RD, (x_RD, gu_RJ, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD)


def _swiglu_bwd(res, dy_RD):
    x_RD, gu_RJ, starts_E, sizes_E, wg_EDF, wu_EDF, wd_EFD = res
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x_RD, wg_EDF, wu_EDF, wd_EFD))
    dx_RD, dwg_EDF, dwu_EDF, dwd_EFD = _call(
        BWD, outs, x_RD, gu_RJ, dy_RD.astype(x_RD.dtype), starts_E, sizes_E, wg_EDF, wu_EDF,
        wd_EFD)
    return (cotangent_like(dx_RD, x_RD), None, None, cotangent_like(dwg_EDF, wg_EDF),
            cotangent_like(dwu_EDF, wu_EDF), cotangent_like(dwd_EFD, wd_EFD))


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def ffn_runs(x_RD, starts_E, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD):
    """y_RD = SwiGLU of each expert's run of rows (float32 only); differentiable in x and
    the weights. Raises Unavailable (with the reason) where the kernel cannot be built."""
    arrays = (x_RD, w_gate_EDF, w_up_EDF, w_down_EFD)
    if any(jnp.dtype(a.dtype) != jnp.float32 for a in arrays):
        raise ValueError(
            f"model.moe.gmm_impl=blas runs float32 GEMMs, got {[a.dtype.name for a in arrays]}: "
            "set model.dtype=float32 or model.moe.gmm_impl=auto (tiled for other dtypes)")
    _require()
    return _swiglu(x_RD, starts_E.astype(jnp.int32), sizes_E.astype(jnp.int32),
                   w_gate_EDF, w_up_EDF, w_down_EFD)
