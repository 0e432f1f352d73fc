"""Document masking compiled by XLA:GPU for abstract H200s (no GPU needed), on
tests/gpu/test_compile_matrix.py's model (vocab 384: the byte tokenizer's EOS is id 256).

One GPU: the trainer's step with data.doc_mask runs cuDNN's fused attention forward and
backward in its packed-segment form (padding-causal mask over per-row document offsets),
makes no [T, S] score buffer, and keeps cuDNN's softmax statistics at
model.cudnn_max_docs per row.

Context parallelism, 8 GPUs as data 2 x context 2 x expert 2 (ring and all-gather
attention) and pipe 2 x context 2 x expert 2 (1F1B, all-gather and ring): each cell
compiles on its path, the attention's collectives being the ring's K/V
collective-permutes (under the pipeline its pair exchanges: all-gathers over groups of 2
context ranks inside a stage, e.g. {{0,2},{1,3},{4,6},{5,7}}) or the all-gather's K/V
all-gathers and dK/dV reduce-scatters,
the ring holding no score block that spans the whole sequence's keys (the all-gather's
[2L, T] one is found by the same check). The ring's [L, L] blocks before their queries
are cuDNN's fused attention forward and backward (kernels/ring_blocks.py: a padding mask
over dense rows, their keys rotated); its diagonal blocks, which hold several documents,
XLA's, masked by segment (cuDNN's packed layout for them compiles in the GPU check's
program, the last test); the all-gather's block is XLA's einsum, masked by segment
(`hlo_cost.document_masks`), with no cuDNN call. Each cell is recorded in the session's table (tests/gpu/results.py)."""

from __future__ import annotations

import re

import pytest

from olmo_jax import config as config_lib
from olmo_jax import targets
from olmo_jax.planner import comms, gpu_hlo, hlo_cost
from olmo_jax.planner.compile import compile_train_step
from tests.gpu import results
from tests.gpu.test_compile_matrix import COMPILE_OPTIONS, SEQ_LEN, Cell, cell_config

pytestmark = pytest.mark.no_compile_cache


def test_doc_masked_step_runs_cudnn_packed_attention():
    # jax asks the local GPU for its compute capability before it lowers cuDNN's packed
    # layout (Hopper or later); the plan traces for the abstract H200 (sm_90), and
    # platform.targeting answers for it (no patch here).
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


# (model.context_attention, parallel.pipe) on 8 H200s
CONTEXT_CELLS = [("ring", 1), ("allgather", 1), ("allgather", 2), ("ring", 2)]


def context_cell_config(how: str, pipe: int):
    """The matrix's 8-GPU rowwise cell as data 2 x context 2 x expert 2, or pipe 2 x
    context 2 x expert 2 (1F1B, 2 microbatches, 2 MoE blocks), with data.doc_mask."""
    cfg = cell_config(Cell("h200", 8, "rowwise", "auto", "bf16"))
    cfg.model.vocab_size, cfg.model.context_attention = 384, how
    cfg.model.cudnn_max_docs = 4  # the ring's diagonal blocks: 4 packed segment slots
    cfg.data.doc_mask = True
    p = cfg.parallel
    p.data, p.context, p.expert = 2, 2, 2
    if pipe > 1:
        cfg.model.n_layers = 3
        p.pipe, p.data, p.pipeline_schedule, p.microbatches = pipe, 1, "1f1b", 2
    return cfg


@pytest.mark.parametrize("how, pipe", CONTEXT_CELLS,
                         ids=[f"{h}-pipe{p}" for h, p in CONTEXT_CELLS])
def test_doc_masked_context_parallel_compiles_on_its_path(how, pipe):
    cfg = context_cell_config(how, pipe)
    step = compile_train_step(config_lib.validate(cfg), targets.abstract_devices("h200", 8),
                              trainer_step=True, options=COMPILE_OPTIONS)
    cell_id = f"h200x8-doc_mask-context2-{how}" + (f"-pipe{pipe}" if pipe > 1 else "")
    colls = [c for c in comms.collectives(step.module)
             if "attention" in c.op_name and c.group_size > 1]
    kinds = {c.kind for c in colls}
    want = {"all-gather", "reduce-scatter"}
    if how == "ring":  # K/V around the ring; under a pipeline, swapped inside pairs of ranks
        want = {"collective-permute"} if pipe == 1 else {"all-gather"}
    whole = hlo_cost.key_span_buffers(step.module, SEQ_LEN)
    problems = []
    if kinds != want:
        problems.append(f"attention collectives {sorted(kinds)}, not {sorted(want)}")
    if how == "ring" and pipe > 1 and any(c.group_size != 2 for c in colls):
        problems.append("the ring's pair exchanges span more than pairs of context ranks")
    if how == "ring" and whole:
        problems.append(f"whole-sequence score blocks next to the ring: {whole[:3]}")
    if how == "allgather" and not whole:
        problems.append("key_span_buffers no longer sees the all-gather's [2L, T] block")
    if how == "ring":
        problems += ring_block_problems(step, cfg)
    else:  # XLA's [2L, T] block, masked by segment; no cuDNN
        if not hlo_cost.document_masks(step.module):
            problems.append("no q-segment == k-segment mask in the attention blocks")
        if gpu_hlo.cudnn_attention(step.module):
            problems.append("cuDNN attention in the all-gather: update the docs")
    if pipe > 1 and gpu_hlo.collective_counts(step.module)["collective-permute"] == 0:
        problems.append("pipe=2 has no collective-permute between stages")
    results.record(cell_id, "wrongpath" if problems else "compiled", step.lower_s,
                   step.compile_s, "; ".join(problems))
    assert not problems, f"{cell_id}:\n  " + "\n  ".join(problems)


def ring_block_problems(step, cfg) -> list[str]:
    """What keeps the ring's [L, L] blocks off their GPU path (kernels/ring_blocks.py): the
    blocks before their queries cuDNN's fused attention, forward and backward, a padding
    mask over dense rows (one segment slot); the diagonal blocks, which hold several
    documents, XLA's blocks masked by segment, with no packed (PADDING_CAUSAL) cuDNN call:
    where cuDNN keeps the packed layout's statistics is unverified on a GPU, and the GPU
    check compiles that path (test below)."""
    calls = [c for c in gpu_hlo.cudnn_attention(step.module) if "attention" in c.op_name]
    problems = []
    targets = {c.target for c in calls}
    if not {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= targets:
        problems.append(f"the ring's blocks are not cuDNN's forward and backward: {targets}")
    fmha = [line for line in step.compiled.as_text().splitlines()
            if "__cudnn$fmha" in line and "custom-call(" in line]
    padding = [line for line in fmha if re.search(r'"mask_type":\s*"PADDING"', line)]
    if not padding or not all(re.search(r'"max_seg_per_batch":\s*"?1\b', line)
                              for line in padding):
        problems.append("no PADDING blocks over dense rows (one segment slot)")
    if any(re.search(r'"mask_type":\s*"PADDING_CAUSAL"', line) for line in fmha):
        problems.append("packed diagonal blocks on cuDNN: ring_blocks runs them on XLA")
    if not hlo_cost.document_masks(step.module):
        problems.append("the diagonal blocks are not masked by segment")
    return problems


def test_gpu_check_ring_blocks_compile_on_cudnn():
    # tools/gpu_check's ring block program (jax_kernels.ring_block_program: the four block
    # kinds, forward and backward from global statistics) compiles for an H200 with one
    # cuDNN forward and one backward call of each kind's mask.
    import collections
    import sys
    from pathlib import Path

    import jax
    from jax.sharding import SingleDeviceSharding

    from olmo_jax.kernels import platform, ring_blocks

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu_check"))
    import jax_kernels

    dev = targets.abstract_devices("h200", 1)[0]
    cases = jax_kernels.ring_block_cases(128)
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(dev))
            for x in jax.eval_shape(lambda: jax_kernels.ring_block_inputs(128))]
    run = jax_kernels.ring_block_program(ring_blocks.cudnn_kernels(4, packed_diagonal=True),
                                         cases)
    with platform.targeting(platform.target_of([dev])):
        hlo = jax.jit(run).lower(*args).compile().as_text()
    calls = collections.Counter(
        (re.search(r'custom_call_target="([^"]+)"', line).group(1),
         re.search(r'"mask_type":\s*"(\w+)"', line).group(1))
        for line in hlo.splitlines() if "__cudnn$fmha" in line and "custom-call(" in line)
    want = {(t, m): 1 for t in ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
            for m in ("CAUSAL", "PADDING_CAUSAL", "NO_MASK", "PADDING")}
    assert calls == want, calls
