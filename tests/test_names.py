"""One meaning per name: no two modules of olmo_jax/ share a file name, and the error
types live in olmo_jax/errors.py alone (ConfigError is imported from there only).

Read with `ast` and the file tree, importing nothing."""

import ast
import collections
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "olmo_jax"

# File names that mean the same thing in every package, so they may repeat:
# `__init__` / `__main__` are Python's own, and `config.py` is always "this package's
# section of the run config" (model, data, optim, parallel, trainer and the root's
# assembly of them).
SHARED_STEMS = frozenset({"__init__", "__main__", "config"})
ERROR_TYPES = ("ConfigError", "CheckpointError", "DataError")


def repeated_stems(package: Path) -> dict[str, list[str]]:
    """File name stem -> its modules (paths relative to the package's parent), for every
    stem outside SHARED_STEMS that more than one module of `package` has."""
    by_stem = collections.defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        if path.stem not in SHARED_STEMS:
            by_stem[path.stem].append(str(path.relative_to(package.parent)))
    return {stem: paths for stem, paths in by_stem.items() if len(paths) > 1}


def stray_error_imports(roots: list[Path], base: Path) -> list[str]:
    """`path:line` of every import of ConfigError from a module other than
    olmo_jax.errors (relative imports included), and of every `X.ConfigError` attribute
    read, under `roots`."""
    out = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            where = path.relative_to(base)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and any(a.name == "ConfigError" for a in node.names):
                    if node.level or node.module != "olmo_jax.errors":
                        out.append((where, node.lineno, f"from {'.' * node.level}{node.module or ''} import"))
                elif isinstance(node, ast.Attribute) and node.attr == "ConfigError":
                    if ast.unparse(node.value) not in ("olmo_jax.errors", "errors"):
                        out.append((where, node.lineno, ast.unparse(node)))
    return [f"{where}:{line} {what}" for where, line, what in sorted(out)]


def error_definitions(package: Path) -> dict[str, list[str]]:
    """Error type name -> the modules (paths relative to the package's parent) that
    define a class of that name."""
    out = collections.defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name in ERROR_TYPES:
                out[node.name].append(str(path.relative_to(package.parent)))
    return dict(out)


def test_no_two_modules_share_a_file_name(tmp_path):
    pkg = tmp_path / "olmo_jax"  # first, that the scan sees a repeat (and only a repeat)
    for name in ("__init__.py", "a/__init__.py", "a/config.py", "config.py", "a/mxfp8.py",
                 "b/__init__.py", "b/mxfp8.py", "b/__main__.py", "b/stream.py"):
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text("")
    assert repeated_stems(pkg) == {"mxfp8": ["olmo_jax/a/mxfp8.py", "olmo_jax/b/mxfp8.py"]}

    repeated = repeated_stems(PACKAGE)
    assert not repeated, "rename one of each (a name says what its module holds): " + "; ".join(
        f"{stem}: {', '.join(paths)}" for stem, paths in sorted(repeated.items()))


def test_config_error_is_imported_from_olmo_jax_errors_only(tmp_path):
    (tmp_path / "t.py").write_text(  # first, that the scan sees each kind of stray import
        "from olmo_jax.errors import ConfigError\n"
        "from olmo_jax.model.config import ConfigError, MoEConfig\n"
        "from olmo_jax.model import ConfigError as CE\n"
        "from .errors import ConfigError\n"
        "import olmo_jax.errors\n"
        "import olmo_jax.model.config as mc\n"
        "def f():\n"
        "    from olmo_jax.trainer.config import ConfigError\n"
        "    raise olmo_jax.errors.ConfigError(mc.ConfigError)\n")
    assert stray_error_imports([tmp_path], tmp_path) == [
        "t.py:2 from olmo_jax.model.config import", "t.py:3 from olmo_jax.model import",
        "t.py:4 from .errors import", "t.py:8 from olmo_jax.trainer.config import",
        "t.py:9 mc.ConfigError"]

    stray = stray_error_imports([PACKAGE, REPO / "tests"], REPO)
    assert not stray, "import ConfigError from olmo_jax.errors:\n" + "\n".join(stray)


def test_error_types_are_defined_in_olmo_jax_errors_only():
    assert error_definitions(PACKAGE) == {name: ["olmo_jax/errors.py"] for name in ERROR_TYPES}
