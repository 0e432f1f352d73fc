"""The CPU FFI kernels' library: cpu_blas.cc/.h (numpy's OpenBLAS handed in, the thread
pool), cpu_gmm.cc (the routed SwiGLU, `model.moe.gmm_impl=blas`), cpu_attention.cc (QK-norm,
clipping, RoPE and the causal attention core, `model.attention_impl=blas`) and cpu_norm.cc
(the residual stream's RMSNorm, model/norm.py, on CPU in float32), with cpu_rms.h (the
RMSNorm of a span, shared by the last two), built into one shared library on first use and
registered as XLA FFI targets on the CPU platform.

The C++ is built with g++ (`$CXX`) against jax.ffi.include_dir() into a cache folder
($OLMO_JAX_KERNEL_CACHE, else ~/.cache/olmo_jax, else a temporary folder), keyed by the
sources, jax's version, the flags and the CPU; numpy's OpenBLAS is found by its
cblas_sgemm symbol and handed to the library. `available()` says whether all of that
works here (the `auto` choices fall back to XLA paths where it does not).
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
from jax.sharding import NamedSharding, PartitionSpec

from olmo_jax.kernels import vma

HERE = Path(__file__).parent
SOURCES = tuple(HERE / n for n in ("cpu_blas.cc", "cpu_gmm.cc", "cpu_attention.cc",
                                   "cpu_norm.cc"))
HEADERS = (HERE / "cpu_blas.h", HERE / "cpu_rms.h")
# FFI target name -> the library's handler symbol
TARGETS = {
    "olmo_cpu_swiglu_fwd": "OlmoCpuSwigluFwd", "olmo_cpu_swiglu_bwd": "OlmoCpuSwigluBwd",
    "olmo_cpu_attention_fwd": "OlmoCpuAttentionFwd",
    "olmo_cpu_attention_bwd": "OlmoCpuAttentionBwd",
    "olmo_cpu_attention_doc_fwd": "OlmoCpuAttentionDocFwd",
    "olmo_cpu_attention_doc_bwd": "OlmoCpuAttentionDocBwd",
    "olmo_cpu_attention_prep_fwd": "OlmoCpuAttentionPrepFwd",
    "olmo_cpu_attention_prep_bwd": "OlmoCpuAttentionPrepBwd",
    "olmo_cpu_rms_norm_fwd": "OlmoCpuRmsNormFwd", "olmo_cpu_rms_norm_bwd": "OlmoCpuRmsNormBwd",
}
CXXFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC")
# numpy's OpenBLAS (64-bit integers, symbols prefixed scipy_ in the scipy-openblas wheels):
# cblas_sgemm, openblas_get_num_threads, openblas_set_num_threads
BLAS_SYMBOLS = {prefix: tuple(prefix + s + "64_" for s in (
    "cblas_sgemm", "openblas_get_num_threads", "openblas_set_num_threads"))
    for prefix in ("scipy_", "")}


class Unavailable(RuntimeError):
    """The FFI kernels cannot be built or loaded here (the message says why)."""


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
    key = hashlib.sha256(b"\0".join(
        [*(p.read_bytes() for p in (*SOURCES, *HEADERS)), jax.__version__.encode(),
         " ".join(CXXFLAGS).encode(), _cpu_key().encode()]))
    name = f"olmo_cpu_kernels-{key.hexdigest()[:16]}.so"
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
    cxx = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs = [Path(tmp) / (src.stem + ".o") for src in SOURCES]
        lib = Path(tmp) / out.name
        # compiled with -ffast-math (vectorized exp) but linked without it, so that no
        # crtfastmath sets flush-to-zero for the whole process
        cmds = [[cxx, *CXXFLAGS, "-I", jax.ffi.include_dir(), "-c", str(src), "-o", str(obj)]
                for src, obj in zip(SOURCES, objs, strict=True)]
        cmds.append([cxx, "-shared", *map(str, objs), "-o", str(lib)])
        for cmd in cmds:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as e:
                raise Unavailable(f"the CPU kernels: cannot run the C++ compiler {cxx!r} ({e}); "
                                  "install g++ or set CXX") from e
            if done.returncode:
                raise Unavailable(f"the CPU kernels: {' '.join(cmd[-3:])} failed:\n"
                                  f"{done.stderr[-2000:]}")
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
    raise Unavailable(f"the CPU kernels: no 64-bit OpenBLAS cblas_sgemm in numpy's {libs}")


@functools.cache
def _register() -> None:
    addresses = _blas_addresses()
    lib = ctypes.CDLL(str(_build()))
    lib.olmo_cpu_set_blas(*(ctypes.c_void_p(a) for a in addresses))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")


@functools.cache
def available() -> str | None:
    """None when the library builds and loads here, else why not."""
    try:
        _register()
    except Unavailable as e:
        return str(e)
    return None


def require(fallback: str) -> None:
    """Raises Unavailable (why, and `fallback`: the setting that avoids the kernels)."""
    why = available()
    if why is not None:
        raise Unavailable(f"{why}; use {fallback}")


def call(target: str, outs, *args, **attrs):
    """The FFI call `target` with every operand and result typed varying like all operands
    (the FFI call requires equal vma; results inherit it). `outs`: ShapeDtypeStructs;
    `attrs`: the handler's attributes (numpy scalars)."""
    assert target in TARGETS, target
    args = tuple(vma.like(a, *args) for a in args)
    aval = jax.typeof(args[0])
    kw = {}
    if vma.varying_axes(args[0]):  # inside shard_map: results typed on its manual mesh
        kw = {"sharding": NamedSharding(aval.sharding.mesh, PartitionSpec()),
              "manual_axis_type": aval.manual_axis_type}
    shapes_ = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, **kw) for o in outs)
    return jax.ffi.ffi_call(target, shapes_)(*args, **attrs)
