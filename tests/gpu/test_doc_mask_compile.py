"""Document masking on cuDNN, compiled by XLA:GPU for an abstract H200 (no GPU needed): the
trainer's step with data.doc_mask runs cuDNN's fused attention forward and backward in
its packed-segment form (padding-causal mask over per-row document offsets), makes no
[T, S] score buffer, and keeps cuDNN's softmax statistics at model.cudnn_max_docs per row.
One 1-GPU cell of tests/gpu/test_compile_matrix.py's model (vocab 384: the byte
tokenizer's EOS is id 256)."""

from __future__ import annotations

import re

import pytest

from olmo_jax import config as config_lib
from olmo_jax import targets
from olmo_jax.planner import gpu_hlo, hlo_cost
from olmo_jax.planner.compile import compile_train_step
from tests.gpu.test_compile_matrix import COMPILE_OPTIONS, SEQ_LEN, Cell, cell_config

pytestmark = pytest.mark.no_compile_cache


def test_doc_masked_step_runs_cudnn_packed_attention(monkeypatch):
    # jax asks the local GPU for its compute capability before it lowers cuDNN's packed
    # layout (Hopper or later); deviceless, the abstract H200 (sm_90) is the answer.
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability",
                        lambda capability: tuple(map(int, capability.split("."))) <= (9, 0))
    cfg = cell_config(Cell("h200", 1, "local", "ragged_dot", "bf16"))
    cfg.model.vocab_size, cfg.model.cudnn_max_docs = 384, 4
    cfg.data.doc_mask = True
    run = config_lib.validate(cfg)
    assert run.model_config().doc_mask_eos == 256  # the byte tokenizer's EOS
    step = compile_train_step(run, targets.abstract_devices("h200", 1), trainer_step=True,
                              options=COMPILE_OPTIONS)
    calls = gpu_hlo.cudnn_attention(step.module)
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= {c.target for c in calls}
    assert not hlo_cost.score_buffers(step.module, SEQ_LEN)
    hlo = step.compiled.as_text()
    fmha = [line for line in hlo.splitlines() if "__cudnn$fmha" in line and "custom-call(" in line]
    # the packed layout's mask and segment slots, and its softmax statistics
    # [B * cudnn_max_docs, heads, T] float32
    assert fmha and all(re.search(r'"mask_type":\s*"PADDING_CAUSAL"', line)
                        and re.search(r'"max_seg_per_batch":\s*4\b', line) for line in fmha), fmha[:1]
    B, N = cfg.trainer.global_batch_size, cfg.model.n_heads
    assert re.search(rf"f32\[{B * 4},{N},{SEQ_LEN}\]", hlo)
