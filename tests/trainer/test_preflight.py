"""The preflight memory estimate is XLA's analysis of the compiled program, per device:
here a sharded, donated matmul whose argument and output bytes are known exactly."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmo_jax import config as config_lib
from olmo_jax.errors import ConfigError
from olmo_jax.trainer import preflight
from tests.run_config import get_config


def _compiled():
    mesh = Mesh(np.asarray(jax.devices()), ("d",))
    rows, cols = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())
    f = jax.jit(lambda a, b: a @ b + 1.0, in_shardings=(rows, cols), out_shardings=rows,
                donate_argnums=0)
    a = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=rows)
    b = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=cols)
    return f.lower(a, b).compile()


def test_estimate_is_per_device_and_counts_donation():
    e = preflight.MemoryEstimate.of(_compiled())
    shard = 1024 * 256 * 4 // len(jax.devices())  # one device's rows of `a` (and of the output)
    assert e.arguments == shard + 256 * 256 * 4
    assert e.outputs == shard and e.aliased == shard  # the output reuses donated `a`
    assert e.total == e.arguments + e.temporaries + e.code


def test_limits_and_refusal():
    cfg = get_config()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available, source = preflight.available_bytes(0.0)
    assert available == ram // len(jax.local_devices()) and "physical RAM" in source
    compiled = _compiled()
    cfg.trainer.memory_limit_gb = 1.0
    estimate, available, _ = preflight.check(compiled, config_lib.validate(cfg))
    assert available == 2**30 and estimate.total < available
    cfg.trainer.memory_limit_gb = 1e-6
    with pytest.raises(ConfigError, match=r"needs an estimated .* GiB are available \(trainer.memory_limit_gb=1e-06\)"):
        preflight.check(compiled, config_lib.validate(cfg))
    cfg.trainer.memory_limit_gb = -1.0  # no check
    preflight.check(compiled, config_lib.validate(cfg))
