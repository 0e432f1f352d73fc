"""A crashed test process, reported with its stack and run past once (tests/conftest.py
registers this plugin; tools/testing/pytest_resume.sh drives it).

A segmentation fault in a native library kills an xdist worker about once in a few full
runs of the main suite on 2 cores, at a different test each time, not reproduced alone
(where its stack was seen: XLA:CPU's `executable.serialize()`, called by jax's write to
the suite's persistent compilation cache). The run stops there (`--max-worker-restart=0`: xdist's replacement of a
crashed worker once left a `--dist loadfile` run waiting forever), so the tests it had not
reached never ran. This plugin:

- writes each worker's fatal-error stack (faulthandler, every thread) to a file of its own
  and puts the crashed thread's stack into the test's failure report, where the run's
  summary shows it (on a worker's stderr it scrolled away with the rest of the output);
- with OLMO_JAX_TEST_LEDGER=DIR, records every test that ended (passed, failed or skipped)
  and, when the run's only failures were crashes, writes DIR/resume: the ids of the tests
  that ended, so a second run can start where the crash stopped this one;
- with OLMO_JAX_TEST_RESUME=FILE, deselects the tests that FILE names (the crashed test
  itself is not in it: it runs again).

A test that fails runs once; a crash is given one more run of what it left, and a second
crash fails the suite."""

import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

import pytest

LEDGER_ENV = "OLMO_JAX_TEST_LEDGER"
RESUME_ENV = "OLMO_JAX_TEST_RESUME"
_DUMP_ENV = "OLMO_JAX_TEST_CRASH_DUMPS"  # the controller's folder of worker stacks


def _dump_dir() -> Path:
    """The folder of the workers' fatal-error files (CrashResume makes it in the
    controller, before the workers start; they inherit it through the environment)."""
    return Path(os.environ[_DUMP_ENV])


_RUNNER_FRAMES = ("/_pytest/", "/pluggy/", "/execnet/", "/xdist/", 'File "<string>"')


def crashed_thread(dump: str) -> str:
    """From a faulthandler dump: the fatal error's line and the stack of the thread that
    crashed, without the frames of pytest, pluggy and xdist that run every test."""
    lines = dump.splitlines()
    head = [l for l in lines[:2] if l.startswith("Fatal Python error")]
    out, inside = [], False
    for line in lines:
        if line.startswith("Current thread"):
            inside = True
        elif inside and (line.startswith("Thread 0x") or not line.strip()):
            break
        if inside and not any(r in line for r in _RUNNER_FRAMES):
            out.append(line)
    return "\n".join(head + out) if out else "\n".join(lines)


class CrashResume:
    def __init__(self, config):
        self.is_worker = hasattr(config, "workerinput")
        self.ended: list[str] = []
        self.crashed: list[str] = []
        self.failed: set[str] = set()
        self._dump_file = None
        # Read here and taken out of the environment, as the stack folder is by the workers
        # (and the resume list once used): a pytest that a test starts must not share them.
        self.ledger = None if self.is_worker else os.environ.pop(LEDGER_ENV, None)
        self._owns_dumps = not self.is_worker and _DUMP_ENV not in os.environ
        if self._owns_dumps:
            os.environ[_DUMP_ENV] = tempfile.mkdtemp(prefix="olmo_jax_test_crashes_")

    # -- workers: the fatal-error stack to a file (after pytest's faulthandler plugin)
    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session):
        if self.is_worker and _DUMP_ENV in os.environ:
            wid = session.config.workerinput["workerid"]
            self._dump_file = open(_dump_dir() / f"{wid}.txt", "w")  # open until exit
            faulthandler.enable(file=self._dump_file, all_threads=True)
            del os.environ[_DUMP_ENV]

    def pytest_collection_modifyitems(self, config, items):
        resume = os.environ.pop(RESUME_ENV, None)
        if not resume:
            return
        done = set(Path(resume).read_text().splitlines())
        keep = [it for it in items if it.nodeid not in done]
        config.hook.pytest_deselected(items=[it for it in items if it.nodeid in done])
        items[:] = keep

    # -- the controller (or a run without xdist)
    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem, report, sched):
        self.crashed.append(crashitem)
        dump = _dump_dir() / f"{report.node.gateway.id}.txt"  # made by this process
        text = dump.read_text() if dump.is_file() else ""
        if text.strip():
            report.longrepr = f"{report.longrepr}\n\n{crashed_thread(text)}"

    def pytest_runtest_logreport(self, report):
        if self.is_worker:
            return
        if report.failed and report.nodeid not in self.crashed:
            self.failed.add(report.nodeid)
        if report.when == "teardown" and report.nodeid not in self.crashed:
            self.ended.append(report.nodeid)

    def pytest_sessionfinish(self, session, exitstatus):
        if self.is_worker or not self.ledger or not self.crashed or self.failed:
            return
        Path(self.ledger, "resume").write_text("\n".join(self.ended) + "\n")
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"\ncrash_resume: {', '.join(self.crashed)} crashed its test process "
                          f"after {len(self.ended)} tests ended; the rest runs once more",
                          yellow=True)

    def pytest_unconfigure(self, config):
        if self._owns_dumps:
            shutil.rmtree(os.environ.pop(_DUMP_ENV), ignore_errors=True)
