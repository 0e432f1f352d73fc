"""Roofline arithmetic on a hand-computed case: a device with round numbers, three
operations (compute-bound, memory-bound, an attention-core op whose bytes stay on chip),
a float32 router dot, and collectives inside and across nodes."""

import pytest

from olmo_jax.planner import hardware, roofline
from olmo_jax.planner.hlo_cost import OpCost

SPEC = hardware.DeviceSpec("test", {"bfloat16": 1e15, "float32": 1e14}, 100e9, 1e12,
                           100e9, 10e9, gpus_per_node=4)
MESH = {"pipe": 1, "data": 4, "expert": 4}  # 16 devices, 4 per node


def test_link_placement():
    assert hardware.axis_span(MESH, ("expert",)) == 4
    assert hardware.axis_span(MESH, ("data",)) == 16  # stride 4 x size 4
    assert hardware.axis_span(MESH, ("data", "expert")) == 16
    assert hardware.intra_node(MESH, ("expert",), 4, SPEC)
    assert not hardware.intra_node(MESH, ("data",), 4, SPEC)
    assert not hardware.intra_node(MESH, (), 2, SPEC)  # unnamed group in a 16-device mesh
    assert hardware.intra_node({"pipe": 1, "data": 2, "expert": 2}, (), 2, SPEC)


def test_hand_computed_projection():
    ops = [
        OpCost("routed_experts", count=10, dot_flops=2e12, bytes=1e9, collective=False),
        OpCost("other", count=4, dot_flops=0.0, bytes=5e9, collective=False),
        OpCost("attention_scores", count=2, dot_flops=1e12, bytes=50e9, collective=False),
        OpCost("router", count=1, dot_flops=1e12, bytes=1e6, collective=False),
        OpCost("other", count=3, dot_flops=0.0, bytes=7e9, collective=False,
               backend_inserted=True),
        OpCost("routed_experts", count=8, dot_flops=0.0, bytes=3e9, collective=True),
    ]
    links = [
        roofline.LinkUse("all-to-all", 8e9, count=2, group_size=4, axes=("expert",)),
        roofline.LinkUse("all-reduce", 1e9, count=1, group_size=4, axes=("data",)),
        roofline.LinkUse("all-gather", 4e9, count=1, group_size=1, axes=("data",)),
    ]
    p = roofline.project(ops, links, SPEC, "bfloat16", MESH, tokens_per_device=1000.0,
                         model_flops_per_device=20e12)
    # compute: 10 x 2e12/1e15 + 2 x 1e12/1e15 + 1e12/1e14 (router at the float32 peak)
    assert p.compute_s == pytest.approx(0.02 + 0.002 + 0.01)
    # roofline: experts compute-bound (2 ms > 1 ms); the 5 GB op memory-bound (5 ms); the
    # attention core's 50 GB stay on chip (1 ms compute); router 10 ms; the backend's
    # convert and the collective count no HBM bytes.
    assert p.roofline_s == pytest.approx(0.02 + 4 * 0.005 + 0.002 + 0.01)
    assert p.hbm_bytes == pytest.approx(10 * 1e9 + 4 * 5e9 + 1e6)
    # links: all-to-all in the node 2 x 8e9 x 3/4 / 100e9; all-reduce across nodes
    # 2 x 1e9 x 3/4 / 10e9; a group of one moves nothing.
    assert p.link_s["nvlink"] == pytest.approx(2 * 8e9 * 0.75 / 100e9)
    assert p.link_s["network"] == pytest.approx(2 * 1e9 * 0.75 / 10e9)
    assert p.step_s == pytest.approx(p.roofline_s + 0.12 + 0.15)
    assert p.overlapped_s == pytest.approx(max(p.roofline_s, 0.27))
    assert p.tokens_per_s() == pytest.approx(1000.0 / p.step_s)
    assert p.mfu() == pytest.approx(20e12 / p.step_s / 1e15)
    assert p.mfu(overlapped=True) == pytest.approx(20e12 / p.overlapped_s / 1e15)


def test_reference_mfu_arithmetic():
    """docs/reference.md: 52k tokens/s/GPU at 18.19 GFLOP/token on a B300 is 42% MFU; 858
    TFLOP/s/GPU is 38%."""
    b300 = hardware.device_spec("b300")
    assert 52e3 * 18.19e9 / b300.peak("bfloat16") == pytest.approx(0.42, abs=0.005)
    assert 858e12 / b300.peak("bfloat16") == pytest.approx(0.38, abs=0.005)
    with pytest.raises(ValueError, match="--device-kind"):
        hardware.device_spec("tpu")


def test_gpu_efficiencies_and_what_an_xla_gpu_program_counts():
    """Matmuls at the measured fraction of peak, links at the stated efficiency; of an
    XLA:GPU program every operation's bytes count (attention core and compiler copies
    included), of XLA:CPU's the score matrices only where the GPU fuses them."""
    h200 = hardware.device_spec("h200")
    assert h200.matmul_efficiency == pytest.approx((769 + 798) / 2 / 989)
    assert h200.matmul_flops("bfloat16") == pytest.approx(783.5e12)
    assert h200.peak("bfloat16") == 989e12  # MFU's denominator stays the datasheet's
    assert hardware.device_spec("b300").matmul_efficiency == h200.matmul_efficiency
    spec = hardware.DeviceSpec("test", {"bfloat16": 1e15, "float32": 1e14}, 100e9, 1e12,
                               100e9, 10e9, gpus_per_node=4, matmul_efficiency=0.5,
                               link_efficiency=0.8)
    ops = [OpCost("routed_experts", count=10, dot_flops=2e12, bytes=1e9, collective=False),
           OpCost("attention_scores", count=2, dot_flops=0.0, bytes=50e9, collective=False),
           OpCost("other", count=3, dot_flops=0.0, bytes=7e9, collective=False,
                  backend_inserted=True)]
    links = [roofline.LinkUse("all-to-all", 8e9, count=2, group_size=4, axes=("expert",))]
    gpu = roofline.Accounting.for_program(gpu_program=True, fused_attention=True)
    p = roofline.project(ops, links, spec, "bfloat16", MESH, 1000.0, 20e12, accounting=gpu)
    assert p.compute_s == pytest.approx(10 * 2e12 / 0.5e15)
    assert p.roofline_s == pytest.approx(0.04 + 2 * 0.05 + 3 * 0.007)
    assert p.hbm_bytes == pytest.approx(10e9 + 100e9 + 21e9)
    assert p.link_s["nvlink"] == pytest.approx(2 * 8e9 * 0.75 / (0.8 * 100e9))
    assert p.mfu() == pytest.approx(20e12 / p.step_s / 1e15)
    cpu_xla = roofline.Accounting.for_program(gpu_program=False, fused_attention=False)
    p = roofline.project(ops, [], spec, "bfloat16", MESH, 1000.0, 20e12, accounting=cpu_xla)
    assert p.hbm_bytes == pytest.approx(10e9 + 100e9)  # scores materialized, copies not
    assert roofline.Accounting.for_program(False, True) == roofline.XLA_CPU_AS_GPU
