"""tests/crash_resume.py through tools/testing/pytest_resume.sh, on a small suite run by a
pytest of its own (2 xdist workers, --dist loadfile --max-worker-restart=0, as `make test`
runs the main suite) in which one test kills its process with a segmentation fault: the
crashed thread's stack is in the failure report, the tests the crash left run once more
(and the ones that ended do not), a second crash fails, and a real failure beside a crash
is not run past."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "testing" / "pytest_resume.sh"

CONFTEST = """
from tests.crash_resume import CrashResume

def pytest_configure(config):
    config.pluginmanager.register(CrashResume(config), "crash_resume")
"""
# test_a.py: the crasher (segfaults while `crashes` has lines left, taking one per run);
# test_b.py: a plain file, whose tests must run once in all.
TEST_A = """
import ctypes, os
from pathlib import Path

def _count(name):
    with open(Path(os.environ["SUITE_LOG"]) / name, "a") as f:
        f.write("x")

def test_a1_before():
    _count("a1")

def test_a2_crashes_in_a_frame_of_its_own():
    _count("a2")
    left = Path(os.environ["SUITE_LOG"]) / "crashes"
    n = int(left.read_text())
    if n > 0:
        left.write_text(str(n - 1))
        ctypes.string_at(0)  # SIGSEGV
    assert os.environ.get("FAIL_A2") != "1"

def test_a3_after():
    _count("a3")
"""
TEST_B = """
import os
from pathlib import Path

def test_b1():
    with open(Path(os.environ["SUITE_LOG"]) / "b1", "a") as f:
        f.write("x")
"""


def _run(tmp_path, crashes: int, fail_a2=False, fail_b1=False):
    suite, log = tmp_path / "suite", tmp_path / "log"
    suite.mkdir(exist_ok=True)
    log.mkdir(exist_ok=True)
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_a.py").write_text(TEST_A)
    (suite / "test_b.py").write_text(TEST_B + ("\n    assert False\n" if fail_b1 else ""))
    (log / "crashes").write_text(str(crashes))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLMO_JAX_TEST_")}
    env.update(PYTHONPATH=str(REPO), SUITE_LOG=str(log), FAIL_A2="1" if fail_a2 else "0")
    p = subprocess.run(
        [str(SCRIPT), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-n", "2", "--dist", "loadfile", "--max-worker-restart=0", "--rootdir", str(suite),
         str(suite)], cwd=suite, env=env, capture_output=True, text=True, timeout=300)
    runs = {f.name: len(f.read_text()) for f in log.iterdir() if f.name != "crashes"}
    return p, p.stdout + p.stderr, runs


def test_a_crash_is_reported_with_its_stack_and_the_rest_runs_once_more(tmp_path):
    p, out, runs = _run(tmp_path, crashes=1)
    assert p.returncode == 0, out
    assert "crashed while running 'test_a.py::test_a2_crashes_in_a_frame_of_its_own'" in out
    assert "Segmentation fault" in out and "test_a2_crashes_in_a_frame_of_its_own" in out
    assert "pytest_resume: a test process crashed" in out
    # the crashed test runs again; every other test ran exactly once
    assert runs == {"a1": 1, "a2": 2, "a3": 1, "b1": 1}, runs


def test_a_second_crash_fails_the_suite(tmp_path):
    p, out, runs = _run(tmp_path, crashes=2)
    assert p.returncode != 0
    assert runs["a2"] == 2 and out.count("node down: Not properly terminated") == 2, out


def test_a_real_failure_beside_a_crash_is_not_run_past(tmp_path):
    p, out, runs = _run(tmp_path, crashes=1, fail_b1=True)
    assert p.returncode != 0
    assert "pytest_resume" not in out and runs["a2"] == 1, out


def test_a_crashed_test_that_fails_when_run_again_fails_the_suite(tmp_path):
    p, out, runs = _run(tmp_path, crashes=1, fail_a2=True)
    assert p.returncode != 0 and runs["a2"] == 2, out
