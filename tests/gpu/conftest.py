"""tests/gpu: XLA:GPU compiles for abstract GPUs (olmo_jax.targets), no GPU needed. They
run in .venv-gpu, which has the jax CUDA plugin (`make gpu-venv`; `make test` runs them
after the CPU stages with `.venv-gpu/bin/python -m pytest tests/gpu -k SELECTION`, one GPU
architecture per process: `make test-gpu`). In an interpreter without the plugin they do
not skip: collection stops with that message.

The step is compiled as the trainer compiles it, so the main conftest's test-wide
`jax_default_matmul_precision=highest` is put back to the default here.

Each compiled cell of the matrix leaves {"id", "status", "lower_s", "compile_s", ...} in
.artifacts/gpu_compile_matrix/ and the session ends with a table of them (the xdist
workers write, the controller prints)."""

import importlib.util
import os
import re

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA driver here

import jax  # noqa: E402
import pytest  # noqa: E402

from olmo_jax import targets  # noqa: E402
from tests.gpu import results  # noqa: E402


def _has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


if not _has_cuda_plugin():
    raise pytest.UsageError(
        "tests/gpu need the jax CUDA plugin: run them with .venv-gpu/bin/python -m pytest "
        "tests/gpu -k b300 (`make gpu-venv` builds it; `make test-gpu` runs them all)")

jax.config.update("jax_default_matmul_precision", None)


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _architectures(items) -> dict[tuple[int, int], list[str]]:
    """The GPU architectures (compute capabilities) that the collected tests name in their
    ids, each with the kinds that name it."""
    found: dict[tuple[int, int], list[str]] = {}
    for item in items:
        for kind in targets.KINDS:
            if re.search(rf"(?<![a-z0-9]){kind}(?![0-9])", item.nodeid):
                kinds = found.setdefault(targets.spec(kind).capability, [])
                if kind not in kinds:
                    kinds.append(kind)
    return found


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    """One GPU architecture per process. Once a process has assembled a Mosaic GPU kernel
    for one `sm_XYa`, ptxas refuses the kernels of another ("cannot be compiled to future
    architecture", "SM version specified by .target is higher than default SM version
    assumed"), so which test fails would depend on how xdist spreads the tests. Refuse the
    mixed selection instead, whatever the order."""
    archs = _architectures(items)
    if len(archs) > 1:
        named = "; ".join(f"sm_{a}{b}: {', '.join(k)}" for (a, b), k in sorted(archs.items()))
        raise pytest.UsageError(
            f"tests/gpu: this selection compiles for {len(archs)} GPU architectures ({named}); "
            "one process compiles for one architecture: select one with -k (`make test-gpu` "
            'runs -k "not b200 and not b300", then -k b200, then -k b300)')
    items.sort(key=lambda item: not any(h in item.nodeid for h in LONG))  # stable


# The longest compiles (pipelined and doc-masked steps, the gmm comparison: 35-60 s each
# under `make test-gpu`'s 4 processes, against 15-25 s for a matrix cell), handed out
# first: xdist gives the workers tests in collection order, and one of these picked up
# last kept a single worker busy for its last 17 s (Hopper).
LONG = ("-pipe2", "test_gmm_auto.py", "test_doc_mask_compile.py", "test_window_compile.py")


def pytest_sessionstart(session):
    if not _is_worker(session.config):
        results.clear()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _is_worker(config):
        return
    lines = results.table()
    if lines:
        terminalreporter.section("GPU compile matrix (wall seconds per cell: build + lower, compile)")
        for line in lines:
            terminalreporter.write_line(line)
