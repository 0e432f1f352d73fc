"""olmo_jax/host_memory.py: `retain` stops XLA:CPU's large per-call buffers from being
fresh, page-faulting mmaps; it is applied only before JAX starts; the config field
rejects a wrong value by name. Each case runs in a fresh interpreter (the policy is
per process and must come before JAX's backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from olmo_jax import host_memory
from olmo_jax.errors import ConfigError
from olmo_jax.trainer.config import TrainerConfig

# A jitted program whose output and temporaries are 128 MB (> glibc's 32 MB mmap ceiling and
# the 64 MB of a thread's own heap), run a few times; prints minor page faults per call
# once warm (XLA frees a call's buffers asynchronously, so under `retain` the heap grows
# for the first few calls, up to 9 measured, before every block is a reused one): the least
# of ten windows of 5 calls, since a late growth step (one output's fresh pages, 6,554
# faults a call over a window) was seen in about one window in six after 16 warm-up calls,
# and in each of three windows in a row while another test process kept both cores busy.
_FAULTS_PER_CALL = """
import json, resource, sys
from olmo_jax import host_memory
applied = host_memory.configure(sys.argv[1])
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.tanh(x[:, None] * x[None, :4096]) * 2.0)
x = jnp.linspace(0.0, 1.0, 8192, dtype=jnp.float32)
for _ in range(16):
    f(x).block_until_ready()
def faults_per_call():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        f(x).block_until_ready()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
print(json.dumps({"applied": applied, "faults": min(faults_per_call() for _ in range(10))}))
"""


def _run(code: str, *args: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
        # glibc's malloc with its own defaults: no preloaded allocator (the Makefile's test
        # stages preload jemalloc, whose reuse makes both policies fault-free) and no
        # tunables (its CPU test stages set glibc.malloc.hugetlb=1 for when jemalloc is
        # missing, which backs large blocks with huge pages: 65 faults a call)
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "GLIBC_TUNABLES": "",
             "LD_PRELOAD": "", **env},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_retain_reuses_large_buffers_where_system_refaults_them():
    pages = 8192 * 4096 * 4 / 4096  # one output's pages
    system = _run(_FAULTS_PER_CALL, "system")
    retain = _run(_FAULTS_PER_CALL, "retain")
    assert system["applied"] == "system" and retain["applied"] == "retain"
    assert system["faults"] > 0.9 * pages, system  # a fresh mmap per call, every page touched
    assert retain["faults"] < 0.01 * pages, retain


def test_retain_after_jax_started_changes_nothing():
    code = """
import json, jax
from olmo_jax import host_memory
jax.numpy.zeros(1).block_until_ready()
print(json.dumps({"applied": host_memory.configure("retain")}))
"""
    assert _run(code)["applied"] == "system"


@pytest.mark.parametrize(("platforms", "xla_flags", "expected"), [
    ("cpu", "", "retain"),
    ("cuda", "", "system"),
    ("cpu", "--xla_force_host_platform_device_count=8", "system"),  # one lock for 8 devices
])
def test_auto_retains_only_where_jax_computes_on_one_cpu_device(platforms, xla_flags, expected):
    code = """
import json
from olmo_jax import host_memory
print(json.dumps({"applied": host_memory.configure("auto")}))
"""
    assert _run(code, JAX_PLATFORMS=platforms, XLA_FLAGS=xla_flags)["applied"] == expected


def test_a_wrong_mode_names_the_field_and_the_choices():
    with pytest.raises(ConfigError, match=r"trainer\.host_malloc='cached': choose one of auto, retain, system"):
        TrainerConfig(host_malloc="cached").validate()
    with pytest.raises(ConfigError, match=r"trainer\.host_malloc"):
        host_memory.configure("cached")


def test_retain_tunables_is_the_same_policy():
    assert host_memory.retain_tunables() == (
        "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
    )
