"""Test-wide settings: float32 matmuls at full precision, 8 fake CPU devices (set by
`make test` through XLA_FLAGS; set here too so a bare `pytest` behaves the same)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
