"""The planner's front door and its two halves, read with `ast` (tools/testing/import_graph.py),
importing nothing: code outside planner/ (the `plan` entry point, the report) reaches the
planner through its API, `planner.api.plan_config`, and the device table, never through
the GPU worker's module or the plan's builders; the plan is built in plan_build.py and
rendered in plan_text.py, which only the API imports and which nothing it imports
imports back."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", REPO / "tools" / "testing" / "import_graph.py")
ig = sys.modules.setdefault("import_graph", importlib.util.module_from_spec(_spec))
if not hasattr(ig, "imports_of"):
    _spec.loader.exec_module(ig)

PLANNER = "olmo_jax.planner"
# What code outside the planner may import from it: the API and the device kinds' table.
PUBLIC = {f"{PLANNER}.api", f"{PLANNER}.hardware"}


def _imports() -> dict[str, set[str]]:
    """Module -> the olmo_jax modules it imports (any depth), for every module."""
    known = ig.modules(REPO / "olmo_jax")
    return {m: {t for t, _ in ig.imports_of(m, p.read_text(), known, p.name == "__init__.py")}
            for m, p in known.items()}


def test_outside_code_uses_the_planner_api():
    imports = _imports()
    reached = {(m, t) for m, ts in imports.items() if not m.startswith(PLANNER)
               for t in ts if t.startswith(PLANNER)}
    private = sorted(f"{m} -> {t}" for m, t in reached if t not in PUBLIC)
    assert not private, ("outside the planner, import planner.api.plan_config (or "
                         "planner.hardware), not:\n" + "\n".join(private))
    assert {m for m, t in reached if t == f"{PLANNER}.api"} >= {"olmo_jax.plan",
                                                               "olmo_jax.report.plan_view"}


def test_the_worker_and_the_entry_points_share_one_call():
    imports = _imports()
    assert f"{PLANNER}.api" in imports[f"{PLANNER}.command"]  # the XLA:GPU worker
    assert f"{PLANNER}.command" not in imports[f"{PLANNER}.api"]


def test_building_and_formatting_are_apart():
    imports = _imports()
    text = f"{PLANNER}.plan_text"
    assert {m for m, ts in imports.items() if text in ts} == {f"{PLANNER}.api"}
    assert f"{PLANNER}.plan_build" in imports[text]
    for numbers in (f"{PLANNER}.plan_build", f"{PLANNER}.optimizer_cost"):
        assert text not in imports[numbers]
        source = (REPO / (numbers.replace(".", "/") + ".py")).read_text()
        assert "def format_" not in source and "_section(" not in source, numbers
