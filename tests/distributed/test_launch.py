"""Where a launch comes from (flags > OLMO_JAX_* environment > SLURM), the refusals of a
broken one, and the per-process batch assembly: each process reads only the rows its
devices hold."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmo_jax.distributed import Launch, detect, place_batch
from olmo_jax.errors import ConfigError

NONE = {"coordinator": None, "num_processes": None, "process_id": None}
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[007-009],gpu1", "SLURM_NTASKS": "3",
         "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "3"}


def test_single_process_without_any_launch():
    assert detect(NONE, {}) is None
    assert detect(NONE, {**SLURM, "SLURM_NTASKS": "1"}) is None  # one task: no coordinator
    assert detect({"coordinator": "h:1", "num_processes": 1, "process_id": 0}, {}) is None


def test_flags_then_environment_then_slurm():
    flags = {"coordinator": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    assert detect(flags, {}) == Launch("10.0.0.1:1234", 4, 3, None, "flags")
    env = {"OLMO_JAX_COORDINATOR": "h0:99", "OLMO_JAX_NUM_PROCESSES": "2", "OLMO_JAX_PROCESS_ID": "1"}
    assert detect(NONE, env) == Launch("h0:99", 2, 1, None, "environment")
    assert detect({**NONE, "process_id": 0}, env).process_id == 0  # a flag beats the variable
    # srun, one task per node: the first node of the step is the coordinator (JAX's port
    # rule: 65535 - 2**12 + 1 + job id % 2**12 = 61440 + 146), every local device is used.
    assert detect(NONE, SLURM) == Launch("node007:61586", 3, 2, None, "slurm")
    two_per_node = {**SLURM, "SLURM_NTASKS": "6", "SLURM_LOCALID": "1"}
    assert detect(NONE, two_per_node).local_device_ids == (1,)  # one device per task
    mixed = detect(NONE, {**SLURM, "OLMO_JAX_COORDINATOR": "login:5000"})
    assert (mixed.coordinator, mixed.num_processes, mixed.source) == ("login:5000", 3, "environment/slurm")


@pytest.mark.parametrize(
    "flags,env,match",
    [
        ({**NONE, "process_id": 1}, {}, r"incomplete multi-process launch: process_id from flags "
                                        r"but no coordinator \(--coordinator or OLMO_JAX_COORDINATOR\)"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {}, r"process_id=2 must be in 0\.\.1"),
        ({"coordinator": "nohost", "num_processes": 2, "process_id": 0}, {}, "must be HOST:PORT"),
        (NONE, {"OLMO_JAX_NUM_PROCESSES": "two", "OLMO_JAX_PROCESS_ID": "0",
                "OLMO_JAX_COORDINATOR": "h:1"}, "OLMO_JAX_NUM_PROCESSES='two' must be an integer"),
    ],
)
def test_broken_launches_name_what_is_wrong(flags, env, match):
    with pytest.raises(ConfigError, match=match):
        detect(flags, env)


@pytest.mark.parametrize("axes,spec", [((1, 8), ("e",)), ((2, 4), ("d",)), ((4, 2), (("d", "e"),))])
def test_each_device_rows_are_read_once(axes, spec):
    """place_batch equals device_put of the whole batch, and reads exactly the rows the
    process's devices hold, each once (a row replicated over an axis is read once)."""
    mesh = Mesh(np.asarray(jax.devices()).reshape(axes), ("d", "e"))
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    batch = np.arange(16 * 5, dtype=np.int32).reshape(16, 5)
    reads = []

    def read(rows):
        reads.append(rows.tolist())
        return batch[rows]

    got = place_batch(read, batch.shape, sharding)
    np.testing.assert_array_equal(np.asarray(got), batch)
    assert got.sharding == sharding
    indices = sharding.addressable_devices_indices_map(batch.shape).values()
    held = {tuple(np.arange(16)[idx[0]].tolist()) for idx in indices}
    assert sorted(map(tuple, reads)) == sorted(held)  # one read per distinct row block
