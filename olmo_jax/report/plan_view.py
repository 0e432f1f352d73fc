"""Report sections of a plan: "memory" (per-device memory of the compiled step by
category) and "collectives" (bytes per collective per step).

Both belong to the planner (`python -m olmo_jax.plan`), which this build does not have;
the sections say so rather than estimate the numbers a second way.
"""

from __future__ import annotations

ABSENT = ("{what}: needs the planner (python -m olmo_jax.plan, AOT-compiled step), "
          "which is not part of this build")


def plan_sections(cfg, model_cfg) -> list[dict]:
    return [
        {"id": "memory", "title": "Memory per device", "kind": "memory",
         "absent": ABSENT.format(what="memory per device by category")},
        {"id": "collectives", "title": "Bytes per collective", "kind": "collectives",
         "absent": ABSENT.format(what="bytes per collective")},
    ]
