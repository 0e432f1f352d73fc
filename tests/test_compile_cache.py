"""The run's persistent compilation cache (tests/conftest.py): on in every test, one
folder that the child processes tests start inherit, off in tests marked
no_compile_cache (and for their children)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import RUN_CACHE

pytestmark = pytest.mark.skipif(RUN_CACHE is None, reason="OLMO_JAX_TEST_CACHE=0: the cache is off")

CHILD = "import jax; print(jax.config.jax_compilation_cache_dir)"


def _child_cache_dir() -> str:
    out = subprocess.run([sys.executable, "-c", CHILD], env=dict(os.environ), capture_output=True,
                         text=True, check=True, timeout=300)
    return out.stdout.strip()


def test_programs_compile_into_the_runs_folder(compile_cache):
    assert str(compile_cache) == RUN_CACHE == jax.config.jax_compilation_cache_dir
    x_N = jnp.arange(13.0)
    before = set(os.listdir(compile_cache))
    jax.jit(lambda a_N: jnp.cumsum(a_N * 7.0 - 3.0))(x_N).block_until_ready()
    assert set(os.listdir(compile_cache)) - before, "the jitted program wrote no cache entry"
    assert _child_cache_dir() == RUN_CACHE


@pytest.mark.no_compile_cache
def test_a_marked_test_and_its_children_compile_without_it():
    assert jax.config.jax_compilation_cache_dir is None
    assert _child_cache_dir() == "None"


class _Item:  # what pytest_collection_modifyitems reads of a collected test
    def __init__(self, nodeid):
        self.nodeid, self.markers = nodeid, set()

    def add_marker(self, marker):
        self.markers.add(marker.name)

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def test_the_uncached_packages_run_without_the_cache():
    from tests import conftest

    ids = ["tests/parallel/test_pipeline.py::test_a", "tests/model/test_router.py::test_b",
           "tests/planner/test_plan_muon.py::test_c", "tests/trainer/test_faults.py::test_d",
           "tests/test_compile_cache.py::test_e"]
    items = [_Item(i) for i in ids]
    conftest.pytest_collection_modifyitems(None, items)
    marked = {i.nodeid.split("/")[1] for i in items if "no_compile_cache" in i.markers}
    assert marked == {"parallel", "model", "planner"}
