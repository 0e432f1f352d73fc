"""The main suite's processes allocate with jemalloc (tests/allocator.py): a test process
started by the Makefile, on a machine that has the library, has it mapped."""

import pytest

from tests import allocator


def test_make_runs_the_suite_on_jemalloc():
    if reason := allocator.skip_reason():
        pytest.skip(reason)
    assert allocator.preloaded(), (
        f"{allocator.jemalloc_library()} is on this machine but not preloaded into the test "
        "process: the Makefile's TEST_MALLOC is missing from this stage's command")
