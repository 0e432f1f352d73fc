"""olmo_jax.targets: the checked-in target configs become abstract GPUs whose kind,
compute capability and SM count are read back from the devices, as the platform code
reads them from a mesh; a real CUDA device answers from its own attributes; a device
that is no GPU answers None."""

import jax
import pytest

from olmo_jax import targets

# The table of the module docstring, written out again: a config edit must be deliberate.
TABLE = {
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 132, 84_978_434_048, 3.35e12),
    "h200": ("NVIDIA H200", (9, 0), 132, 150_754_820_096, 4.8e12),
    "b200": ("NVIDIA B200", (10, 0), 148, 191_514_673_152, 8.0e12),
    "b300": ("NVIDIA B300 SXM6 AC", (10, 3), 158, 297_021_865_984, 8.0e12),
}


@pytest.mark.parametrize("kind", targets.KINDS)
def test_abstract_devices_answer_the_table(kind):
    device_kind, cc, sms, mem, bw = TABLE[kind]
    s = targets.spec(kind)
    assert (s.device_kind, s.capability, s.num_sms, s.memory_bytes, s.memory_bandwidth) == (
        device_kind, cc, sms, mem, bw)
    devices = targets.abstract_devices(kind, 8)
    assert len(devices) == 8 and len({d.id for d in devices}) == 8
    for d in devices:
        assert d.platform == "gpu" and d.device_kind == device_kind
        assert targets.kind_of(d) == kind
        assert targets.capability_of(d) == cc
        assert targets.num_sms_of(d) == sms


def test_topology_is_cached_and_meshes_have_the_shape():
    assert targets.topology("h200", 8) is targets.topology("h200", 8)
    mesh = targets.make_mesh("b300", (2, 4), ("data", "expert"))
    assert dict(mesh.shape) == {"data": 2, "expert": 4}
    assert {targets.kind_of(d) for d in mesh.devices.flat} == {"b300"}
    assert len(targets.abstract_devices("h100", 1)) == 1


def test_cpu_devices_are_no_gpu():
    cpu = jax.devices("cpu")[0]
    assert targets.capability_of(cpu) is None
    assert targets.num_sms_of(cpu) is None
    assert targets.kind_of(cpu) is None


class _RealCudaDevice:
    """The attributes jax's CUDA devices carry (StreamExecutorGpuDevice)."""

    platform = "gpu"
    device_kind = "NVIDIA GH200 480GB"  # outside the table: the attributes answer
    compute_capability = "9.0"
    core_count = 132


def test_real_cuda_devices_answer_from_their_attributes():
    d = _RealCudaDevice()
    assert targets.capability_of(d) == (9, 0)
    assert targets.num_sms_of(d) == 132


def test_unknown_abstract_gpu_and_kind_are_refused():
    class Abstract:
        platform, device_kind = "gpu", "NVIDIA A100-SXM4-80GB"

    with pytest.raises(ValueError, match="none of olmo_jax.targets"):
        targets.capability_of(Abstract())
    with pytest.raises(ValueError, match="choose one of h100, h200, b200, b300"):
        targets.topology("a100", 8)
