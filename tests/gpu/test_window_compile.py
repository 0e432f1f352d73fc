"""cuDNN's sliding-window attention, compiled by XLA:GPU for an abstract H200 (no GPU
needed): the cudnn core with a window (alone, and with document masking in the packed
layout) compiles to cuDNN's fused attention forward and backward carrying the window
(`sliding_window_length`), with no [T, S] score buffer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from olmo_jax import targets
from olmo_jax.model.attention import cudnn_attention
from olmo_jax.planner import gpu_hlo, hlo_cost

B, T, N, K, H, W = 2, 256, 4, 2, 64, 100


@pytest.mark.parametrize("docs", [False, True], ids=["window", "window+docs"])
def test_cudnn_window_compiles_to_fused_attention(monkeypatch, docs):
    from jax._src.cudnn import fused_attention_stablehlo  # deviceless: the H200 is sm_90

    monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability",
                        lambda capability: tuple(map(int, capability.split("."))) <= (9, 0))
    mesh = targets.make_mesh("h200", (1,), ("data",))
    spec = NamedSharding(mesh, PartitionSpec())

    def loss(q, k, v, seg):
        with jax.named_scope("attention_scores"):  # the model's scope, which score_buffers reads
            out = cudnn_attention(q, k, v, seg if docs else None, 4, window=W)
        return jnp.sum(out.astype(jnp.float32))

    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=spec)
            for s in [(B, T, N, H), (B, T, K, H), (B, T, K, H)]]
    args.append(jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=spec))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower().compile()
    hlo = compiled.as_text()
    targets_ = {c.target for c in gpu_hlo.cudnn_attention(hlo)}
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= targets_, targets_
    fmha = [line for line in hlo.splitlines() if "__cudnn$fmha" in line and "custom-call(" in line]
    assert fmha and all(re.search(rf'"sliding_window_length":\s*{W}\b', line) for line in fmha)
    assert not hlo_cost.score_buffers(hlo, T)


def test_window_pattern_step_switches_between_cudnn_cores():
    """The trainer's step of tests/gpu/test_compile_matrix.py's model (a dense block, then
    two MoE blocks) with model.window_pattern (16, -1) and document masking, one H200: the
    scanned MoE layers hold a windowed and a full cuDNN attention as the branches of one
    conditional (the layer's window index picks one), forward and backward, and no
    [T, S] score buffer. (jax's cuDNN capability check answers for the H200 through
    platform.targeting: no patch here.)"""
    from olmo_jax import config as config_lib
    from olmo_jax.planner.compile import compile_train_step
    from tests.gpu.test_compile_matrix import COMPILE_OPTIONS, SEQ_LEN, Cell, cell_config

    cfg = cell_config(Cell("h200", 1, "local", "ragged_dot", "bf16"))
    m = cfg.model
    m.vocab_size, m.cudnn_max_docs, m.n_layers = 384, 4, 3
    m.window_pattern, m.window_full_first, m.window_full_last = (16, -1), False, False
    cfg.data.doc_mask = True
    run = config_lib.validate(cfg)
    assert run.model_config().layer_windows == (16, 0, 16)  # the MoE stack: full, then 16
    step = compile_train_step(run, targets.abstract_devices("h200", 1), trainer_step=True,
                              options=COMPILE_OPTIONS)
    hlo = step.compiled.as_text()
    fmha = [line for line in hlo.splitlines() if "__cudnn$fmha" in line and "custom-call(" in line]
    windowed = [line for line in fmha if re.search(r'"sliding_window_length":\s*16\b', line)]
    assert windowed and len(windowed) < len(fmha), "both cores, windowed and full"
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= {
        c.target for c in gpu_hlo.cudnn_attention(step.module)}
    assert " conditional(" in hlo
    assert not hlo_cost.score_buffers(step.module, SEQ_LEN)
