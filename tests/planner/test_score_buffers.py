"""hlo_cost.score_buffers, the compile matrix's check that cuDNN's fused attention left no
[T, S] score matrix, on a hand-written module: a score-shaped buffer made in the model's
attention_scores scope counts; one of the same shape made elsewhere (a q/k/v projection
slice [B, T, heads x H] with heads x H = seq_len, in the attention scope) does not, nor do
2-D values or ones whose last dims span no query chunk."""

from olmo_jax.planner import hlo_cost

SEQ = 64  # one query chunk at this length

MODULE = """HloModule scores

%fused_scores (a: f32[2,2,64,16], b: f32[2,2,64,16]) -> f32[2,2,64,64] {
  %a = f32[2,2,64,16]{3,2,1,0} parameter(0)
  %b = f32[2,2,64,16]{3,2,1,0} parameter(1)
  ROOT %s = f32[2,2,64,64]{3,2,1,0} dot(%a, %b), lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1}, rhs_contracting_dims={3}, metadata={op_name="jit(train_step)/jvp()/attention/attention_scores/bkmh,bkah->bkma/dot_general"}
}

%fused_slice (x: bf16[2,64,192]) -> bf16[2,64,64] {
  %x = bf16[2,64,192]{2,1,0} parameter(0)
  ROOT %q = bf16[2,64,64]{2,1,0} slice(%x), slice={[0:2], [0:64], [0:64]}, metadata={op_name="jit(train_step)/jvp()/attention/slice"}
}

ENTRY %main (p0: f32[2,2,64,16], p1: bf16[2,64,192], p2: f32[128,64]) -> (f32[2,2,64,64], bf16[2,64,64], f32[128,64]) {
  %p0 = f32[2,2,64,16]{3,2,1,0} parameter(0)
  %p1 = bf16[2,64,192]{2,1,0} parameter(1)
  %p2 = f32[128,64]{1,0} parameter(2)
  %scores = f32[2,2,64,64]{3,2,1,0} fusion(%p0, %p0), kind=kOutput, calls=%fused_scores
  %qslice = bf16[2,64,64]{2,1,0} fusion(%p1), kind=kLoop, calls=%fused_slice
  %flat = f32[128,64]{1,0} negate(%p2), metadata={op_name="jit(train_step)/jvp()/attention/attention_scores/neg"}
  ROOT %out = (f32[2,2,64,64]{3,2,1,0}, bf16[2,64,64]{2,1,0}, f32[128,64]{1,0}) tuple(%scores, %qslice, %flat)
}
"""


def test_only_score_shaped_buffers_of_the_attention_scores_scope_count():
    assert hlo_cost.score_buffers(MODULE, SEQ) == ["scores: f32[2,2,64,64]"]
