"""Test-wide settings: float32 matmuls at full precision, 8 fake CPU devices (set by
`make test` through XLA_FLAGS; set here too so a bare `pytest` behaves the same).

`compile_cache`: JAX's persistent compilation cache, on only while a module that asks for
it runs (compile-time tests elsewhere must not hit it), in one folder for the whole
session: train runs of one program in several modules, and the child processes they
start (`compile_cache_env`), compile it once.

Shape annotations (`olmo_jax.shapes.check`) are checked at trace time in every test, and
in the child processes tests start (they inherit OLMO_JAX_SHAPE_CHECKS)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("OLMO_JAX_SHAPE_CHECKS", "1")  # read when olmo_jax.shapes is imported

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

CACHE_OPTIONS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def compile_cache(compile_cache_dir):
    old = {k: getattr(jax.config, k) for k in CACHE_OPTIONS}
    for k, v in zip(CACHE_OPTIONS, (str(compile_cache_dir), 0.0, 0), strict=True):
        jax.config.update(k, v)
    compilation_cache.reset_cache()  # re-read the options (checked once per process)
    yield compile_cache_dir
    for k, v in old.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


def compile_cache_env(cache) -> dict:
    """Environment variables giving a child process the same cache and matmul precision."""
    return {
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
