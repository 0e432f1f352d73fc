"""Report section "pipeline": the pipeline schedule (stage x tick, each tick a forward slot
then a backward slot, the forward or backward of one microbatch on one virtual stage in
every busy cell) for the config's schedule, P, M and V, with its bubble fraction and
which blocks each stage runs.

The table is the one the trainer runs: `plan.pipeline.schedule` (built by
olmo_jax/parallel/pipeline/schedule.py from parallel.pipeline_schedule, pipe,
virtual_stages and microbatches) and the chunking `plan.pipeline.chunks` (layout.py).
Without a pipeline (parallel.pipe = 1) one stage runs every block and each of the
trainer.grad_accum microbatches runs its forward, then its backward: the one-stage table
of the same builder, bubble 0.
"""

from __future__ import annotations

from olmo_jax.parallel.pipeline import schedule as sched_lib
from olmo_jax.parallel.pipeline.layout import Chunking

KIND = {sched_lib.FWD: "F", sched_lib.BWD: "B"}


def _dense(n: int) -> str:
    return "dense block 0" if n == 1 else f"dense blocks 0-{n - 1}"


def _stage_blocks(chunks: Chunking | None, n_dense: int, n_layers: int, stages: int) -> list[dict]:
    """Per stage: its chunks as (virtual stage, chunk, model block ids), and whether it also
    runs the embedding and dense-first blocks (stage 0) or the head and loss (last stage)."""
    out = []
    for s in range(stages):
        if chunks is None:
            items = [{"virtual": 0, "chunk": 0, "blocks": list(range(n_dense, n_layers))}]
        else:
            items = [{"virtual": v, "chunk": v * stages + s,
                      "blocks": [n_dense + i for i in chunks.chunk_layers(v * stages + s)]}
                     for v in range(chunks.virtual)]
        out.append({"stage": s, "chunks": items,
                    "first": [*(["embedding"] if s == 0 else []),
                              *([_dense(n_dense)] if s == 0 and n_dense else [])],
                    "last": ["final norm, LM head, loss"] if s == stages - 1 else []})
    return out


def schedule_cells(s: sched_lib.Schedule) -> list[dict]:
    """Every busy (tick, slot, stage) cell of the table: F/B, microbatch, virtual stage,
    chunk (slot 0: the tick's forward slot, 1: its backward slot)."""
    col = sched_lib.COL
    cells = []
    for t in range(s.ticks):
        for slot in (0, 1):
            for stage in range(s.stages):
                cell = s.table[t, slot, stage]
                op = int(cell[col["op"]])
                if op == sched_lib.IDLE:
                    continue
                v = int(cell[col["virtual"]])
                cells.append({"tick": t, "slot": slot, "stage": stage, "kind": KIND[op],
                              "microbatch": int(cell[col["mb"]]), "virtual": v,
                              "chunk": v * s.stages + stage})
    return cells


def pipeline_section(cfg, model_cfg, plan) -> dict:
    pipe = plan.pipeline
    if pipe is None:
        sched = sched_lib.build("1f1b", 1, 1, cfg.trainer.grad_accum)
        note = (f"No pipeline (parallel.pipe=1): one stage, every device runs all "
                f"{model_cfg.n_layers} blocks; each of the trainer.grad_accum="
                f"{cfg.trainer.grad_accum} microbatch(es) runs its forward, then its backward. "
                f"Set parallel.pipe > 1 (with parallel.pipeline_schedule, microbatches, "
                f"virtual_stages) to split the blocks into stages.")
        chunks, repeats = None, 1
    else:
        sched, chunks, repeats = pipe.schedule, pipe.chunks, cfg.trainer.grad_accum
        note = ("The schedule table the trainer runs (olmo_jax/parallel/pipeline/schedule.py)"
                + (f", once per each of the trainer.grad_accum={repeats} accumulation steps"
                   if repeats > 1 else "") + ".")
    return {"id": "pipeline", "title": "Pipeline schedule", "kind": "schedule", "data": {
        "schedule": sched.kind if pipe is not None else "no pipeline",
        "stages": sched.stages, "microbatches": sched.microbatches,
        "virtual_stages": sched.virtual, "ticks": sched.ticks,
        "bubble": sched.bubble,
        "textbook_bubble": sched_lib.textbook_bubble(sched.kind, sched.stages, sched.microbatches,
                                                     sched.virtual),
        "stash_slots": sched.slots["stash"], "repeats": repeats, "note": note,
        "cells": schedule_cells(sched),
        "stage_blocks": _stage_blocks(chunks, model_cfg.n_dense_layers, model_cfg.n_layers,
                                      sched.stages)}}
