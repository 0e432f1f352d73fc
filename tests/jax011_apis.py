"""A pytest plugin for `make test`'s jax 0.11.2 stage (`-p tests.jax011_apis`, Makefile): the
run fails unless its tests made olmo_jax call every version-dependent API at least once,
so that the selection (the tests marked `jax011`) cannot silently stop exercising one.

The APIs are olmo_jax/compat.py's shims (its public functions) and the jax functions of
`compat.SAME_ON_BOTH`. At configure time, before any test module imports olmo_jax, each
is replaced by a wrapper that counts the calls made from olmo_jax's own modules (a call
from jax or from a test does not count) and then calls it. The xdist workers hand their
counts to the controller (`workeroutput`), which adds them up and, at the end of the
session, sets a failing exit status and names every API no test reached."""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import sys

import pytest

_CALLS: collections.Counter = collections.Counter()
_KEY = "jax011_api_calls"


def apis() -> list[str]:
    """Every API the stage must reach, by dotted name: compat's shims, then SAME_ON_BOTH."""
    from olmo_jax import compat

    shims = [f"olmo_jax.compat.{name}" for name, f in vars(compat).items()
             if inspect.isfunction(f) and f.__module__ == compat.__name__
             and not name.startswith("_")]
    return shims + list(compat.SAME_ON_BOTH)


def _owner(dotted: str):
    module, _, name = dotted.rpartition(".")
    return importlib.import_module(module), name


def _counting(dotted: str, f):
    @functools.wraps(f)  # keeps the signature (compat.gpu_kernel_cost reads plgpu.kernel's)
    def wrapper(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("olmo_jax."):
            _CALLS[dotted] += 1
        return f(*args, **kwargs)

    return wrapper


def pytest_configure(config):
    for dotted in apis():
        module, name = _owner(dotted)
        f = getattr(module, name, None)
        if not callable(f) or inspect.isclass(f):
            raise pytest.UsageError(f"tests/jax011_apis.py: {dotted} is no function in this jax")
        setattr(module, name, _counting(dotted, f))
    config._jax011_calls = collections.Counter()


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: the controller adds up
        config.workeroutput[_KEY] = dict(_CALLS)
        return
    if config.option.collectonly:
        return
    total = config._jax011_calls + _CALLS
    missing = [a for a in apis() if not total[a]]
    config._jax011_missing = missing
    if missing and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    node.config._jax011_calls.update(getattr(node, "workeroutput", {}).get(_KEY, {}))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    missing = getattr(config, "_jax011_missing", None)
    if missing is None:
        return
    terminalreporter.section("jax 0.11.2: the version-dependent APIs olmo_jax called")
    if missing:
        terminalreporter.write_line(
            "FAILED: no test marked jax011 made olmo_jax call " + ", ".join(missing)
            + " (mark one that does: olmo_jax/compat.py, tests/jax011_apis.py)", red=True)
    else:
        terminalreporter.write_line(f"all {len(apis())} reached: " + ", ".join(
            a.rsplit(".", 1)[1] for a in apis()))
