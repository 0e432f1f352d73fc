"""tests/gpu: XLA:GPU compiles for abstract GPUs (olmo_jax.targets), no GPU needed. They
run in .venv-gpu, which has the jax CUDA plugin (`make gpu-venv`; `make test` runs them
beside the main suite with `.venv-gpu/bin/python -m pytest tests/gpu`). In an interpreter
without the plugin they do not skip: collection stops with that message.

The step is compiled as the trainer compiles it, so the main conftest's test-wide
`jax_default_matmul_precision=highest` is put back to the default here.

Each compiled cell of the matrix leaves {"id", "status", "lower_s", "compile_s", ...} in
.artifacts/gpu_compile_matrix/ and the session ends with a table of them (the xdist
workers write, the controller prints)."""

import importlib.util
import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA driver here

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.gpu import results  # noqa: E402


def _has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


if not _has_cuda_plugin():
    raise pytest.UsageError(
        "tests/gpu need the jax CUDA plugin: run them with .venv-gpu/bin/python -m pytest "
        "tests/gpu (`make gpu-venv` builds it; `make test` runs them)")

jax.config.update("jax_default_matmul_precision", None)


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


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
