"""Imports run one way, down the layer table (docs/ARCHITECTURE.md; the table and the
import walk are tools/testing/import_graph.py's): every olmo_jax module has a row, no import
statement anywhere in a module (function-level ones included) names a unit of its own
row or above, and the document's table is the code's. Inside a unit, files import one
way too: no circle of modules importing each other (at any depth)."""

import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", REPO / "tools" / "testing" / "import_graph.py")
ig = sys.modules["import_graph"] = importlib.util.module_from_spec(_spec)  # (for dataclasses)
_spec.loader.exec_module(ig)

# Arrows another change of issue 18.2 removes: plan.py and report/__main__.py use
# train.py's private flag parsing until it moves to the shared olmo_jax/cli.py.
PENDING: set = set()


def _graph():
    return ig.graph(REPO / "olmo_jax")


def test_every_module_has_a_row():
    _, unplaced = _graph()
    assert not unplaced, f"add these modules to a row of tools/testing/import_graph.py LAYERS: {unplaced}"


def test_imports_run_down_the_layers():
    edges, _ = _graph()
    up = [f"{i.path}:{i.line} {i.module} -> {i.target} (row {ig.ROW[e.src]} {e.src} -> "
          f"row {ig.ROW[e.dst]} {e.dst})"
          for e in edges if e.upward and (e.src, e.dst) not in PENDING for i in e.imports]
    assert not up, "imports running back up the layers:\n" + "\n".join(up)


def test_pending_arrows_still_exist():
    """An allowance the code no longer needs is removed (so the arrow cannot come back)."""
    edges, _ = _graph()
    stale = PENDING - {(e.src, e.dst) for e in edges}
    assert not stale, f"remove {sorted(stale)} from PENDING in tests/test_layers.py"


def test_function_level_and_relative_imports_count(tmp_path):
    pkg = tmp_path / "olmo_jax"
    files = {
        "__init__.py": "",
        "trainer/__init__.py": "",
        "trainer/step.py": "X = 1\n",
        "model/__init__.py": "import jax\n\n\ndef f():\n    from olmo_jax.trainer import step\n",
        "model/attention.py": "from ..trainer.step import X\n",
        "model/rope.py": "from . import attention\nimport olmo_jax.kernels.platform\n",
        "kernels/__init__.py": "",
        "kernels/platform.py": "",
        "loose.py": "",
    }
    _write_tree(pkg, files)
    edges, unplaced = ig.graph(pkg)
    assert unplaced == ["olmo_jax.loose"]
    by = {(e.src, e.dst): e for e in edges}
    assert set(by) == {("model", "trainer"), ("model", "kernels")}
    assert by["model", "trainer"].upward and not by["model", "kernels"].upward
    found = {(i.module, i.target, i.line) for i in by["model", "trainer"].imports}
    assert found == {("olmo_jax.model", "olmo_jax.trainer.step", 5),
                     ("olmo_jax.model.attention", "olmo_jax.trainer.step", 1)}
    assert ig.unit_of("olmo_jax.report.__main__") == "report.__main__"
    assert ig.unit_of("olmo_jax.report.page") == "report"
    assert ig.ROW["train"] == ig.ROW["plan"]  # peers: an import between them is upward too


def test_a_unit_of_several_modules(monkeypatch):
    monkeypatch.setitem(ig.UNITS, "trainer", ("trainer", "report.page"))
    assert ig.unit_of("olmo_jax.report.page") == "trainer"
    assert ig.unit_of("olmo_jax.report.view") == "report"
    assert ig.unit_of("olmo_jax.trainer.step") == "trainer"


def test_docs_table_is_the_layer_table():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            rows[int(m.group(1))] = tuple(re.findall(r"`([^`]+)`", m.group(2)))
    assert [rows[i] for i in sorted(rows)] == [tuple(r) for r in ig.LAYERS]
    assert sorted(rows) == list(range(len(ig.LAYERS)))


def _circles(package_dir: Path) -> list[list[str]]:
    """Groups of modules whose imports (any depth, as the layer walk reads them) run in a
    circle: the strongly connected components of more than one module (Tarjan)."""
    known = ig.modules(package_dir)
    graph = {m: sorted({t for t, _ in ig.imports_of(m, p.read_text(), known, p.name == "__init__.py")}
                       - {m})
             for m, p in known.items()}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_file_circles():
    circles = _circles(REPO / "olmo_jax")
    assert not circles, "modules importing each other in a circle (move the shared part " \
        "into the module both need):\n" + "\n".join(" <-> ".join(c) for c in circles)


def _write_tree(pkg: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)


def test_circles_count_function_level_imports(tmp_path):
    pkg = tmp_path / "olmo_jax"
    files = {
        "__init__.py": "",
        "planner/__init__.py": "",
        "planner/a.py": "from olmo_jax.planner import b\n",
        "planner/b.py": "def f():\n    from olmo_jax.planner import c\n",
        "planner/c.py": "from . import a\n",
        "planner/d.py": "from olmo_jax.planner import a, c\n",
    }
    _write_tree(pkg, files)
    assert _circles(pkg) == [["olmo_jax.planner.a", "olmo_jax.planner.b", "olmo_jax.planner.c"]]
    (pkg / "planner/b.py").write_text("X = 1\n")
    assert _circles(pkg) == []
