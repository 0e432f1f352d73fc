"""Report section "pipeline": the pipeline schedule (stage x tick, forward/backward of
each microbatch) for the config's schedule, P, M and V.

This build has no pipeline schedules (`parallel.pipe` must be 1 in the trainer), so the
section says so instead of drawing a schedule that the trainer would not run.
"""

from __future__ import annotations

ABSENT = "pipeline schedule: needs parallel.pipe > 1 (not available in this build)"


def pipeline_section(cfg) -> dict:
    return {"id": "pipeline", "title": "Pipeline schedule", "kind": "schedule", "absent": ABSENT}
