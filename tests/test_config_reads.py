"""A ConfigDict is read in one place: olmo_jax/config.py turns it into typed sections
(`RunConfig`), and every other module takes those sections; each section's schema module
declares the choice lists it checks, so none of them needs the modules that implement the
choices. Read with `ast`, without importing anything:

- no module but config.py imports ml_collections, except cli.py, which defines the
  --config flag with ml_collections' `config_flags` (the flag's value goes to config.py);
- no module but config.py makes a ConfigDict (`default_config()`, `ConfigDict(...)`);
- in the entry points, the flag's value (`required_config(...)`, `<flag>.value`) is only
  ever passed on whole, as a call's argument (to config.validate / parse), never read
  field by field (`cfg.trainer`, `cfg["model"]`);
- no section schema module (olmo_jax/config.py's SECTIONS: model/config.py, ...) is on an
  import cycle: nothing it imports, at any depth and lazily or not, imports it back.
"""

import ast
import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "olmo_jax"
SCHEMA = PACKAGE / "config.py"
FLAG = PACKAGE / "cli.py"  # defines --config with ml_collections.config_flags
SECTION_MODULES = ("olmo_jax.model.config", "olmo_jax.parallel.config", "olmo_jax.optim.config",
                   "olmo_jax.data.config", "olmo_jax.trainer.config")
_spec = importlib.util.spec_from_file_location(
    "import_graph", PACKAGE.parent / "tools" / "testing" / "import_graph.py")
ig = sys.modules["import_graph"] = importlib.util.module_from_spec(_spec)  # (for dataclasses)
_spec.loader.exec_module(ig)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != SCHEMA:
            yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text())


def _imports_ml_collections(tree) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "ml_collections" or n.startswith("ml_collections.") for n in names):
            lines.append(node.lineno)
    return lines


def _called(node) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _flag_values(tree) -> set[str]:
    """Names bound to the --config flag's ConfigDict: `x = ...required_config(...)` or
    `x = <FLAG>.value` where the flag's name mentions CONFIG."""
    out = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            continue
        v = node.value
        from_call = isinstance(v, ast.Call) and _called(v) == "required_config"
        from_flag = (isinstance(v, ast.Attribute) and v.attr == "value"
                     and "CONFIG" in ast.unparse(v.value).upper())
        if from_call or from_flag:
            out.add(node.targets[0].id)
    return out


def _field_reads(tree) -> list[str]:
    """`name.attr` / `name[...]` of a name bound to the flag's ConfigDict, anywhere in the
    module (conservative: a name rebound later, e.g. `cfg = config.parse(cfg)`, still
    counts)."""
    names = _flag_values(tree)
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.value, ast.Name):
            if node.value.id in names:
                reads.append((node.lineno, f"{node.lineno}: {ast.unparse(node)}"))
    return [r for _, r in sorted(reads)]


def test_only_config_py_and_the_flag_import_ml_collections():
    sample = "import ml_collections\nfrom ml_collections import config_flags\nimport mlx\n"
    assert _imports_ml_collections(ast.parse(sample)) == [1, 2]
    bad = {str(p): lines for p, tree in _modules()
           if (lines := _imports_ml_collections(tree)) and p != FLAG.relative_to(PACKAGE.parent)}
    assert not bad, f"modules importing ml_collections (take config.RunConfig sections): {bad}"


def test_only_config_py_makes_a_config_dict():
    bad = [f"{p}:{node.lineno}" for p, tree in _modules() for node in ast.walk(tree)
           if isinstance(node, ast.Call) and _called(node) in ("default_config", "ConfigDict")]
    assert not bad, f"ConfigDicts made outside olmo_jax/config.py (use config.defaults()): {bad}"


def test_entry_points_pass_the_flag_value_on_whole():
    sample = ("cfg = cli.required_config(argv)\nn = cfg.parallel.data\nrun(cfg)\n"
              "c2 = _CONFIG.value\nx = c2['model']\n")
    assert _field_reads(ast.parse(sample)) == ["2: cfg.parallel", "5: c2['model']"]
    bad = {str(p): reads for p, tree in _modules() if (reads := _field_reads(tree))}
    assert not bad, f"fields of the --config ConfigDict read outside config.py: {bad}"


def _import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the olmo_jax modules its import statements name (any depth)."""
    mods = ig.modules(package)
    return {name: {t for t, _ in ig.imports_of(name, path.read_text(), mods,
                                                 path.name == "__init__.py")} - {name}
            for name, path in mods.items()}


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str]:
    """A path start -> ... -> start of imports, or [] when there is none."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop()
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append(path + [nxt])
    return []


def test_no_section_schema_is_on_an_import_cycle(tmp_path):
    sample = {"olmo_jax/__init__.py": "", "olmo_jax/model/__init__.py": "",
              "olmo_jax/model/config.py": "def f():\n    from olmo_jax.model import router\n",
              "olmo_jax/model/router.py": "from olmo_jax.model.config import X\n"}
    for name, text in sample.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _cycle_through(_import_graph(tmp_path / "olmo_jax"), "olmo_jax.model.config") == [
        "olmo_jax.model.config", "olmo_jax.model.router", "olmo_jax.model.config"]
    graph = _import_graph(PACKAGE)
    cycles = {m: c for m in SECTION_MODULES if (c := _cycle_through(graph, m))}
    assert not cycles, f"section schemas imported back by what they import: {cycles}"
