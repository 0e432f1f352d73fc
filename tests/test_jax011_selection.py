"""`make test`'s jax 0.11.2 stage selects its tests by mark (`-m "jax011 or image"` over the
Makefile's J11_TESTS) and, through tests/jax011_apis.py, fails unless they made olmo_jax
call each API of olmo_jax/compat.py's list. This keeps the pieces in step without running
jax 0.11.2: the files named exist and each holds a marked test, every file with a marked
test is named, the stage's command line selects by mark and loads the plugin, and every
API of the list is a function of this jax that olmo_jax calls by that name."""

import importlib
import inspect
import re
from pathlib import Path

from tests import jax011_apis

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = (REPO / "Makefile").read_text()
MARK = re.compile(r"pytest\.mark\.(jax011|image)\b")


def j11_tests() -> list[str]:
    body = re.search(r"^J11_TESTS \?=((?:.*\\\n)*.*)$", MAKEFILE, re.M).group(1)
    return body.replace("\\\n", " ").split()


def test_the_stage_selects_by_mark_and_checks_the_apis():
    (line,) = [ln for ln in MAKEFILE.splitlines() if "$(J11_TESTS); j11=" in ln]
    assert '-m "jax011 or image" -p tests.jax011_apis $(J11_TESTS)' in line, line


def test_the_named_files_and_the_marked_files_are_the_same():
    named = j11_tests()
    assert len(set(named)) == len(named), named
    for path in named:
        assert path.endswith(".py") and (REPO / path).is_file(), f"J11_TESTS names {path}"
    marked = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                    if MARK.search(p.read_text()))
    assert sorted(named) == marked, (
        "Makefile J11_TESTS must name exactly the test files with a test marked jax011 or "
        f"image: named but unmarked {sorted(set(named) - set(marked))}, marked but not named "
        f"{sorted(set(marked) - set(named))}")


def test_every_api_is_a_function_olmo_jax_uses():
    apis = jax011_apis.apis()
    assert {"olmo_jax.compat.gpu_store", "olmo_jax.compat.gpu_kernel_cost"} <= set(apis)
    source = "\n".join(p.read_text() for p in (REPO / "olmo_jax").rglob("*.py"))
    for dotted in apis:
        module, _, name = dotted.rpartition(".")
        f = getattr(importlib.import_module(module), name)
        assert callable(f) and not inspect.isclass(f), dotted
        # as olmo_jax spells it: compat.X, plgpu.X, jax.lax.X ...
        short = {"olmo_jax.compat": "compat", "jax.experimental.pallas.mosaic_gpu": "plgpu"}
        spelled = f"{short.get(module, module)}.{name}"
        assert re.search(rf"(?<![\w.]){re.escape(spelled)}\b", source), (
            f"olmo_jax never uses {spelled}: drop it from compat.SAME_ON_BOTH")
