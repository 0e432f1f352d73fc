"""The GPU expert paths through the trainer's own plan, run on 8 fake CPU devices and
compared with one device's plain float32 step at the mesh-invariance tolerances
(test_parallel_invariance.assert_matches_reference: loss and every gradient within 1e-5
relative, five AdamW steps within 1e-4):

- model.moe.gmm_impl=pallas (the Hopper grouped-matmul kernels, in Pallas' GPU
  interpret mode) under rowwise dispatch on expert 4 (the kernels reading its
  sender-major receive slots in place: 128-row slots, a whole row block each) and ragged
  dispatch on data 2 x expert 4, and
  pallas_tcgen05 (the Blackwell kernels) under ragged dispatch (dropless runs). The reference is
  the single-device default (the blocked einsum), not the kernel itself. The interpreter
  runs every kernel launch of every device in Python, so these runs are as small as the
  kernels' paths allow: one MoE block (its scan, dispatch, forward and both backward
  products run as with more; the input gradient reaches the embedding), two steps, not
  five: the first step's loss and gradients, and the loss after one AdamW update.
- parallel.dispatch=ragged with model.moe.precision=mxfp8: the MXFP8 payload through
  the ragged exchange and the MXFP8 expert unit, forward and backward, against one
  device's MXFP8 step (same quantization of the same rows; the layouts differ), gradients
  within 1e-4 (fp8 rounding boundaries, see the test).
"""

import pytest

from olmo_jax.kernels import platform
from tests.parallel.harness import plan_run, reference_run
from tests.parallel.test_parallel_invariance import assert_matches_reference

PALLAS_WIDTH = 64  # the kernels tile d_model and the expert hidden size by 64
PALLAS_STEPS = 2
PALLAS_LAYERS = (1, 0)  # one MoE block: each block adds its interpreted launches on every device
# rowwise on expert 4 (4 devices: half the interpreted launches of 8): C = ceil(16 x 32
# tokens x top-2 / 8 experts) = 128 slots per (sender, expert), one 128-row block, so the
# kernels read the sender-major receive buffer in place (ffn.reads_slots)
ROWWISE_SLOTS = dict(data=1, capacity_factor=16.0)


@pytest.mark.parametrize("gmm_impl,dispatch", [("pallas", "rowwise"), ("pallas", "ragged"),
                                               ("pallas_tcgen05", "ragged")])
def test_pallas_kernels_through_the_plan_match_one_device(gmm_impl, dispatch):
    mesh = dict(ROWWISE_SLOTS) if dispatch == "rowwise" else {"data": 2}
    with platform.interpret():
        run = plan_run(mesh.pop("data"), 4, dispatch, width=PALLAS_WIDTH,
                       moe=(("gmm_impl", gmm_impl),), steps=PALLAS_STEPS,
                       layers=PALLAS_LAYERS, **mesh)
    assert len(run.curve) == PALLAS_STEPS
    assert "callback" in run.hlo  # the interpreted kernels (the einsum path has none)
    assert_matches_reference(run, reference_run(width=PALLAS_WIDTH, layers=PALLAS_LAYERS))


def test_ragged_mxfp8_trains_and_matches_one_device():
    """Gradients within 1e-4: the mesh's float32 summation order can move a value across an
    fp8 rounding boundary before MXFP8 quantization (measured: 0 on an Intel AVX-512
    machine, 4.7e-5 on an AMD EPYC); a wrong scale or block moves them by orders more."""
    mxfp8 = (("precision", "mxfp8"),)
    assert_matches_reference(plan_run(2, 4, "ragged", moe=mxfp8), reference_run(moe=mxfp8),
                             grads_rtol=1e-4)
