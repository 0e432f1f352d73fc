"""Where the kernels run: the target platform of the program being traced, taken from the
devices of the mesh it runs on (never from `jax.default_backend()`), and Pallas' GPU
interpret mode for running the GPU kernels on a CPU.

Which grouped matmul and attention core a model runs is not chosen here: that is
olmo_jax/kernels/select.py, given a Target explicitly, once per plan. The context below
sets what the chosen kernels are lowered for (SM count, native collectives, their own
platform checks).

- `Target`: platform (cpu | gpu | tpu), CUDA compute capability, SM count, and whether
  the devices are abstract (a deviceless compile: `olmo_jax.targets`).
- `target_of(devices)`: the Target of a list (or mesh array) of devices.
- `targeting(target)`: inside this context every query below answers for `target`. The
  parallel plan traces its steps inside it (`ParallelPlan._for_target`), so a step lowered
  for abstract GPUs on a CPU host lowers its kernels for them (jax's cuDNN attention
  checks the abstract GPU's compute capability then, not the host's: `_cudnn_capability`);
  outside any context the target is the default device's.
- `gpu_capability()`: (major, minor) of the target, or None when it is no CUDA GPU.
- `block_scaled_mma_supported()`: Blackwell and newer, where `jax.nn.scaled_matmul`
  runs a cuDNN MXFP8 block-scaled GEMM.
- `native_collectives()`: the target has `jax.lax.ragged_all_to_all` (GPU, TPU).
- `interpret()`: inside this context the Pallas GPU kernels run in GPU interpret mode
  (on the CPU); `interpret_params()` is what the kernels pass to `plgpu.kernel`.
- `cross_lowering()`: inside this context the kernels may be traced on a CPU host in
  order to lower them for CUDA (`.lower(lowering_platforms=("cuda",))`) as for an H100
  (sm_90, 132 SMs): the Pallas -> Mosaic GPU lowering runs (shapes, layouts, transforms,
  primitive support are checked) without a GPU; the result cannot be executed here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import numpy as np

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class Target:
    platform: str  # "cpu" | "gpu" | "tpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability (NVIDIA GPUs)
    num_sms: int = 0  # streaming multiprocessors (GPUs)
    abstract: bool = False  # devices of a deviceless compile: lowered, never executed here

    @property
    def is_gpu(self) -> bool:
        return self.platform == "gpu"

    def describe(self) -> str:
        if self.capability is not None:
            return f"a GPU of compute capability {self.capability}"
        return self.platform


def _capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if cc:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    from olmo_jax import targets  # an abstract GPU of a deviceless compile

    return targets.capability_of(device)


def _num_sms(device) -> int:
    n = getattr(device, "core_count", None)
    if n:
        return int(n)
    from olmo_jax import targets

    return int(targets.num_sms_of(device) or 0)


def target_of(devices) -> Target:
    """The Target of `devices` (a sequence, a numpy array of devices or a Mesh): all of one
    platform, as every mesh here is."""
    devices = getattr(devices, "devices", devices)  # a Mesh
    first = np.asarray(devices, dtype=object).flat[0]
    plat = first.platform.lower()
    if plat in GPU_PLATFORMS:
        cc = _capability(first)
        return Target("gpu", cc, _num_sms(first), abstract=not hasattr(first, "compute_capability"))
    return Target(plat)


_TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "olmo_jax_target", default=None
)
_CROSS_LOWERING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "olmo_jax_cross_lowering", default=False
)
_CROSS_LOWERING_TARGET = Target("gpu", (9, 0), 132, abstract=True)  # H100/H200 SXM
# The jax.experimental.pallas.mosaic_gpu.InterpretGPUParams in force (imported lazily:
# loading Pallas costs about a second).
_INTERPRET: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "olmo_jax_gpu_interpret", default=None
)


def current_target() -> Target:
    t = _TARGET.get()
    return t if t is not None else target_of(jax.devices()[:1])


@contextlib.contextmanager
def targeting(target: Target):
    token = _TARGET.set(target)
    try:
        with _cudnn_capability(target):
            yield
    finally:
        _TARGET.reset(token)


@contextlib.contextmanager
def _cudnn_capability(target: Target):
    """jax's cuDNN attention asks the first local GPU for its compute capability while it
    lowers (`fused_attention_stablehlo.check_compute_capability`: the packed layout of
    document masking needs sm_90 or later, the head-dim limit and B300's cuDNN version
    check depend on it). A deviceless compile has no local GPU, so jax would answer "no
    GPU" and refuse the packed layout; for a GPU target traced on a host whose default
    backend is no GPU (jax's check reads that backend, not the mesh), the answer is the
    target's capability while the step is traced. Nothing changes where jax has a GPU."""
    if not (target.is_gpu and target.capability) or jax.default_backend() == "gpu":
        yield
        return
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:  # another jax layout: its own answer stands
        yield
        return

    def parse(capability: str) -> tuple[int, ...]:
        return tuple(int(x) for x in capability.split("."))

    answers = {"check_compute_capability": lambda c: target.capability >= parse(c),
               "is_cuda_compute_capability_equal": lambda c: target.capability == parse(c)}
    saved = {name: getattr(fused, name) for name in answers if hasattr(fused, name)}
    for name in saved:
        setattr(fused, name, answers[name])
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(fused, name, fn)


def gpu_capability() -> tuple[int, int] | None:
    return current_target().capability


def block_scaled_mma_supported() -> bool:
    cc = gpu_capability()
    return cc is not None and cc[0] >= 10


def native_collectives() -> bool:
    """The target has jax.lax.ragged_all_to_all (GPU and TPU; XLA:CPU has none)."""
    return current_target().platform in ("gpu", "tpu")


def num_sms() -> int:
    """Streaming multiprocessors of the target GPU (a small number when interpreting,
    where every program is simulated)."""
    return current_target().num_sms or 4


@contextlib.contextmanager
def interpret(params=None):
    """Run the Pallas GPU kernels traced inside this context in GPU interpret mode.

    Defaults: out-of-bounds reads raise and uninitialized memory reads NaN, so an index
    or masking error fails loudly instead of passing by accident."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _synchronize_interpreted_devices()
    token = _INTERPRET.set(params or plgpu.InterpretGPUParams())
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def _synchronize_interpreted_devices() -> None:
    """Make GPU interpret mode sound for kernels run by several devices at once (inside
    shard_map on a CPU mesh, where XLA runs the devices in parallel threads).

    At the end of an interpreted kernel each device asserts that no barrier is allocated
    in the interpreter's shared memory, which is common to all devices, and only then
    waits for the others (jax 0.11 / 0.12: `gpu_callbacks._assert_no_barriers_allocated`,
    then the clean-up barrier). A device that finishes first sees the others' live
    barriers and fails. Here every device first waits for all the others at the
    interpreter's own device barrier, so the check sees a finished kernel on every device.
    """
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
        return
    check = getattr(gpu_callbacks, "_assert_no_barriers_allocated", None)
    if check is None or getattr(check, "_olmo_jax_synchronized", False):
        return

    def synchronized_check(token):
        gpu_callbacks._get_shared_memory().barrier.wait()
        return check(token)

    synchronized_check._olmo_jax_synchronized = True
    gpu_callbacks._assert_no_barriers_allocated = synchronized_check


@contextlib.contextmanager
def cross_lowering():
    """Trace as for an H100 on a CPU host, in order to lower for CUDA: this target wins
    over the mesh's devices (`cross_lowering_target`)."""
    token = _CROSS_LOWERING.set(True)
    try:
        with targeting(_CROSS_LOWERING_TARGET):
            yield
    finally:
        _CROSS_LOWERING.reset(token)


def cross_lowering_target() -> Target | None:
    return _CROSS_LOWERING_TARGET if _CROSS_LOWERING.get() else None


def interpret_params():
    return _INTERPRET.get()


def require_kernel_platform(what: str) -> None:
    """Clear error when a Pallas GPU kernel is called where it cannot run."""
    if interpret_params() is None and gpu_capability() is None:
        raise RuntimeError(
            f"{what} is a Pallas Mosaic GPU kernel: it needs an NVIDIA GPU (the target is "
            f"{current_target().describe()}); on a CPU run it inside "
            "olmo_jax.kernels.platform.interpret() (slow, for tests)"
        )
