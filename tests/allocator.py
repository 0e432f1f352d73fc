"""What the test stages' processes allocate with: the Makefile preloads jemalloc
(tools/setup/jemalloc.sh) into every process of `make test`, `make check` and
`make test-gpu` where the machine has it (TEST_MALLOC; docs/development.md says why)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def jemalloc_library() -> str:
    """The path tools/setup/jemalloc.sh prints: the machine's libjemalloc.so.2, or ''."""
    out = subprocess.run([str(REPO / "tools" / "setup" / "jemalloc.sh")], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def skip_reason() -> str | None:
    """Why this process cannot show the Makefile's choice: not started by make, or no
    jemalloc on the machine; None when it can."""
    if "MAKELEVEL" not in os.environ:
        return "checks the Makefile's test stages: run by `make test` / `make check`"
    if not jemalloc_library():
        return ("no libjemalloc.so.2 on this machine (`make system-packages` installs the Debian "
                "package libjemalloc2 as root), so the tests run on glibc's malloc")
    return None


def preloaded() -> bool:
    """Whether this process has jemalloc mapped (it replaced glibc's malloc)."""
    return any(line.rstrip().endswith("/libjemalloc.so.2")
               for line in Path("/proc/self/maps").read_text().splitlines())
