"""The drawing of olmo_jax's imports, layer to layer, checked against the layer table
(docs/ARCHITECTURE.md; tests/test_layers.py fails on any arrow running back up).

    python tools/testing/import_graph.py            # layer-to-layer edges; exit 1 on an upward arrow
    python tools/testing/import_graph.py --dot      # the same as a Graphviz digraph (rows as ranks)
    python tools/testing/import_graph.py --root DIR # another checkout's olmo_jax/ (e.g. an old commit)

Every import statement of every module counts, at any depth (function-level imports
too), read with `ast` without importing anything. A module belongs to the unit with the
longest matching name in LAYERS (`report.__main__` before `report`; UNITS names the
modules of a unit made of several); a unit may import its own modules and units of lower
rows only. Units that share a row are peers and may not import each other.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import sys
from pathlib import Path

ROOT = "olmo_jax"  # the package root's own unit (its __init__.py only)

# Bottom to top; names relative to olmo_jax. docs/ARCHITECTURE.md has the same table with
# what each row owns (tests/test_layers.py keeps the two equal).
LAYERS: tuple[tuple[str, ...], ...] = (
    (ROOT, "compat", "errors", "labels", "shapes", "targets"),
    ("kernels", "host_memory", "storage"),
    ("model",),
    ("objective",),
    ("optim",),
    ("parallel",),
    ("data", "distributed", "metrics", "evals"),
    ("trainer.config",),
    ("config",),
    ("checkpoint",),
    ("trainer",),
    ("planner",),
    ("report",),
    ("cli",),
    ("train", "plan", "convert", "tokenize", "generate", "evaluate", "report.__main__"),
)
# A unit made of several modules or packages (names relative to olmo_jax); any other
# unit is the module or package of its name. Imports inside one unit are free.
UNITS: dict[str, tuple[str, ...]] = {}
ROW = {unit: i for i, units in enumerate(LAYERS) for unit in units}


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. olmo_jax.parallel.strategy
    target: str  # the imported olmo_jax module (or package)
    path: str  # file of the importing module, relative to the root's parent
    line: int


@dataclasses.dataclass(frozen=True)
class Edge:
    src: str  # units
    dst: str
    imports: tuple[Import, ...]

    @property
    def upward(self) -> bool:
        """Runs to a higher row, or to a peer on the same row."""
        return ROW[self.dst] >= ROW[self.src]


def modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known) -> str:
    """The longest prefix of `name` that is a module of the package."""
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts)


def imports_of(module: str, source: str, known, is_package: bool = False) -> list[tuple[str, int]]:
    """(imported olmo_jax module, line) for every import statement in `source`, at any
    depth: `from a import b` names module a.b when it exists, else a."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            if name == ROOT or name.startswith(ROOT + "."):
                out.append((_resolve(name, known), node.lineno))
    return list(dict.fromkeys(out))  # one per module and line


def unit_of(module: str) -> str | None:
    """The unit of LAYERS a module belongs to (None: not in the table)."""
    if module == ROOT:
        return ROOT
    prefixes = {p: u for u in ROW if u != ROOT for p in UNITS.get(u, (u,))}
    parts = module.removeprefix(ROOT + ".").split(".")
    for n in range(len(parts), 0, -1):
        unit = prefixes.get(".".join(parts[:n]))
        if unit is not None:
            return unit
    return None


def graph(package_dir: Path) -> tuple[list[Edge], list[str]]:
    """(unit-to-unit edges, modules with no unit) of the package at `package_dir`."""
    known = modules(package_dir)
    found = collections.defaultdict(list)
    unplaced = []
    for module, path in known.items():
        src = unit_of(module)
        if src is None:
            unplaced.append(module)
            continue
        rel = str(path.relative_to(package_dir.parent))
        for target, line in imports_of(module, path.read_text(), known, path.name == "__init__.py"):
            dst = unit_of(target)
            if dst is None:
                unplaced.append(target)
            elif dst != src:
                found[src, dst].append(Import(module, target, rel, line))
    edges = [Edge(s, d, tuple(v)) for (s, d), v in found.items()]
    edges.sort(key=lambda e: (ROW[e.src], e.src, ROW[e.dst], e.dst))
    return edges, sorted(set(unplaced))


def dot(edges: list[Edge]) -> str:
    """A Graphviz digraph: one rank per row (bottom row at the bottom), arrows pointing
    down the layers; an upward arrow is red."""
    lines = ["digraph olmo_jax {", "  rankdir=BT; node [shape=box, fontname=monospace];"]
    for i, units in enumerate(LAYERS):
        names = " ".join(f'"{u}";' for u in units)
        lines.append(f"  subgraph row{i} {{ rank=same; {names} }}")
    for e in edges:
        style = ' [color=red, penwidth=2, label="UP"]' if e.upward else ""
        lines.append(f'  "{e.src}" -> "{e.dst}"{style};')
    lines.append("}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                    help="the checkout whose olmo_jax/ to read (default: this one)")
    ap.add_argument("--dot", action="store_true", help="print a Graphviz digraph")
    args = ap.parse_args(argv)
    edges, unplaced = graph(args.root / ROOT)
    if args.dot:
        print(dot(edges))
    else:
        for e in edges:
            mark = "  UPWARD" if e.upward else ""
            print(f"{ROW[e.src]:>2} {e.src:<16} -> {ROW[e.dst]:>2} {e.dst:<16} "
                  f"{len(e.imports):>3} import(s){mark}")
    up = [e for e in edges if e.upward]
    for e in up:
        for imp in e.imports:
            print(f"upward: {imp.path}:{imp.line} {imp.module} -> {imp.target}", file=sys.stderr)
    for m in unplaced:
        print(f"not in the layer table: {m}", file=sys.stderr)
    return 1 if up or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
