"""Test-wide settings: float32 matmuls at full precision, 8 fake CPU devices (set by
`make test` through XLA_FLAGS; set here too so a bare `pytest` behaves the same).

JAX's persistent compilation cache is on for the whole run: one folder per pytest run
(OLMO_JAX_TEST_CACHE; when unset, the run's first process makes a fresh temporary folder
and removes it at the end), shared by the xdist workers and the child processes tests
start (they inherit the JAX_* variables set here), so a program that several tests or
modules compile (e.g. a train step in-process and in a launched run) compiles once. A new
folder per run keeps a run from reading programs another checkout or jax version wrote
(`make test` runs its jax 0.11.2 and GPU stages as separate runs). OLMO_JAX_TEST_CACHE=0
turns it off; a test or module marked `no_compile_cache` (one that measures compiling),
and every test of the UNCACHED packages, runs with it off. `compile_cache` is the run's
folder, for tests that hand it to child processes (`compile_cache_env`).

Shape annotations (`olmo_jax.shapes.check`) are checked at trace time in every test, and
in the child processes tests start (they inherit OLMO_JAX_SHAPE_CHECKS)."""

import gc
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("OLMO_JAX_SHAPE_CHECKS", "1")  # read when olmo_jax.shapes is imported

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

REPO = Path(__file__).resolve().parents[1]
# The slow tier: `make test` runs everything, `make check` the rest (-m "not slow"). Files
# (or file::test ids) whose tests launch an oracle (torch, OLMo-core, Chromium, the GPU
# compile venv), run gpu_check end to end, or compile several mesh-sized train steps, on
# top of the tests marked @pytest.mark.slow where they are defined. The fast tier keeps at
# least one test file of every package (model, parallel, kernels, trainer, checkpoint,
# data, planner, report, config) and the golden loss curve's one-device run.
SLOW = (
    "tests/model/test_doc_mask.py::test_a_packed_row_gives_each_document_its_own_logits_and_gradients",
    "tests/olmo_core/test_batch_size_schedule.py",
    "tests/olmo_core/test_data_semantics.py",
    "tests/olmo_core/test_doc_mask_oracle.py",
    "tests/olmo_core/test_loss.py",
    "tests/olmo_core/test_mixture.py",
    "tests/olmo_core/test_model_parity.py",
    "tests/olmo_core/test_reference_numbers.py",
    "tests/olmo_core/test_router_parity.py",
    "tests/olmo_core/test_schedulers.py",
    "tests/olmo_core/test_sliding_window_oracle.py",
    "tests/olmo_core/test_rope_scaling.py",
    "tests/checkpoint/test_hf_parity.py",
    "tests/test_golden_curve.py::test_the_default_run_reproduces_the_golden_curve[data2_expert4]",
    "tests/checkpoint/test_generate_hf.py",
    "tests/data/test_object_store.py::test_a_run_trains_from_the_bucket_as_from_disk",
    "tests/data/test_object_store.py::test_credentials_appear_nowhere",
    "tests/data/test_object_store.py::test_convert_reads_from_and_writes_to_the_bucket",
    "tests/trainer/test_bucket_run_dir.py::test_killed_run_resumes_bitwise_from_the_bucket",
    "tests/trainer/test_bucket_run_dir.py::test_a_second_trainer_is_refused_while_the_owner_lives",
    "tests/trainer/test_bucket_run_dir.py::test_the_bucket_holds_the_run_folder_and_no_credentials",
    "tests/trainer/test_bucket_run_dir.py::test_init_from_and_convert_read_the_bucket",
    "tests/trainer/test_bucket_run_dir.py::test_the_report_reads_the_bucket",
    "tests/trainer/test_gcs_run_dir.py::test_a_stopped_run_resumes_bitwise_from_the_bucket",
    "tests/trainer/test_gcs_run_dir.py::test_the_bucket_holds_the_run_folder_and_no_token",
    "tests/trainer/test_gcs_run_dir.py::test_init_from_and_convert_read_the_bucket",
    "tests/evals/test_downstream.py",
    "tests/evals/test_in_loop.py",
    "tests/parallel/test_gpu_paths.py",
    "tests/parallel/test_context_doc_mask.py",
    "tests/parallel/test_context_parallel.py",
    "tests/parallel/test_parallel_bf16.py",
    "tests/parallel/test_parallel_invariance.py",
    "tests/parallel/test_pipeline.py",
    "tests/parallel/test_window_parallel.py",
    "tests/model/test_window_pattern.py",
    "tests/olmo_core/test_window_pattern_oracle.py",
    "tests/test_long_context_config.py::test_tiny_long_trains_with_context_windows_and_doc_masking",
    "tests/planner/test_plan_compiled.py",
    "tests/planner/test_plan_batch_sizes.py",
    "tests/planner/test_plan_xla_gpu.py",
    "tests/reliability/test_run_faults.py",
    "tests/report/test_report_browser.py",
    "tests/tools/test_gpu_check.py",
    "tests/trainer/test_batch_size_warmup.py",
    "tests/trainer/test_mixture_run.py",
    "tests/trainer/test_train_pipeline.py",
    "tests/trainer/test_durations.py::test_a_token_budget_ends_the_run_and_drives_a_token_scheduler",
)

# Packages whose tests run without the run's compilation cache (marked no_compile_cache
# at collection): few of their programs are compiled by a second process, so their writes
# did not pay for themselves. Measured over one main-suite run, per package (seconds of
# writes / seconds saved by hits): model 5.7 / 2.3, parallel 19.7 / 17.0, kernels 1.2 /
# -0.2, olmo_core 1.1 / -0.3, evals 0.8 / 0.0, planner 1.4 / 0.0; against trainer 2.6 /
# 46.1 and checkpoint 1.6 / 11.8, whose in-process and launched runs share train steps.
# The crashes seen in XLA:CPU's executable.serialize() under the cache write (Makefile:
# RESUME) were in these packages' mesh, pipeline or planner programs, but for the two
# tests marked no_compile_cache where they are defined. With them off:
# 8.1 s of writes instead of 37, hits saving 57.6 s instead of 100 (the trainer's 33 s
# instead of 46: a few of its programs had been written here first), about even in time.
UNCACHED = ("tests/model/", "tests/parallel/", "tests/kernels/", "tests/olmo_core/",
            "tests/evals/", "tests/planner/")

CACHE_ENV = "OLMO_JAX_TEST_CACHE"
_CACHE_OWNER_ENV = "OLMO_JAX_TEST_CACHE_OWNER"  # the pid that made the folder removes it


def _run_cache() -> str | None:
    """The run's cache folder (made here in the run's first process, inherited by the
    xdist workers and child processes through the environment); None when turned off."""
    folder = os.environ.get(CACHE_ENV)
    if folder is None:
        folder = os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="olmo_jax_test_cache_")
        os.environ[_CACHE_OWNER_ENV] = str(os.getpid())
    return None if folder in ("", "0") else folder


RUN_CACHE = _run_cache()
CACHE_OPTIONS = {  # jax.config name -> the environment variable child processes read
    "jax_compilation_cache_dir": "JAX_COMPILATION_CACHE_DIR",
    "jax_persistent_cache_min_compile_time_secs": "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "jax_persistent_cache_min_entry_size_bytes": "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
}
if RUN_CACHE:
    for (k, env), v in zip(CACHE_OPTIONS.items(), (RUN_CACHE, 0.0, 0), strict=True):
        jax.config.update(k, v)
        os.environ[env] = str(v)  # the child processes tests start


def pytest_configure(config):
    from tests.crash_resume import CrashResume

    config.pluginmanager.register(CrashResume(config), "olmo_jax_crash_resume")
    config.addinivalue_line(
        "markers", "no_compile_cache: runs with the persistent compilation cache off "
        "(tests that measure compiling)")


def pytest_collection_modifyitems(config, items):
    """Marks the SLOW files and tests `slow` and the UNCACHED packages' tests
    `no_compile_cache`; a SLOW entry naming a missing file is an error
    (a renamed file must not drop silently into the fast tier). The slow tests are handed
    out first: with `--dist loadfile` a long file picked up last keeps one worker busy
    while the other has nothing left to do."""
    missing = [p for p in SLOW if not (REPO / p.split("::")[0]).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW names missing files: {missing}")
    for item in items:
        if any(item.nodeid == p or item.nodeid.startswith((p + "::", p + "[")) for p in SLOW):
            item.add_marker(pytest.mark.slow)
        if item.nodeid.startswith(UNCACHED):
            item.add_marker(pytest.mark.no_compile_cache)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files stay whole


_frozen_module = [None]  # the test module whose first test last froze the heap


def pytest_runtest_setup(item):
    """Python's cyclic garbage collector skips what was alive when a test module started.
    A test process keeps what its modules built (JAX's trace and compile caches, cached
    runs, imported libraries), and each full collection walked all of it: 40 of the main
    suite's 51 worker seconds of collection were 38 full collections, about 1 s each.
    `gc.freeze()` at each module's first test moves what is alive then out of the
    collector's reach (reference counting still frees it); garbage made since is
    collected as before. Measured side by side on five files in one process (the
    context-parallel doc masks, the parallel invariance, decoding, in-loop evals, the
    transformer: 2.5 GB peak either way): 1.5 s of collection instead of 5.0 s."""
    if item.module is not _frozen_module[0]:
        _frozen_module[0] = item.module
        gc.freeze()


def pytest_unconfigure(config):
    if RUN_CACHE and os.environ.get(_CACHE_OWNER_ENV) == str(os.getpid()):
        shutil.rmtree(RUN_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_compile_cache(request, monkeypatch):
    """The cache off (in this process and for its children) in tests marked no_compile_cache."""
    if not RUN_CACHE or request.node.get_closest_marker("no_compile_cache") is None:
        yield
        return
    for env in CACHE_OPTIONS.values():
        monkeypatch.delenv(env, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()  # re-read the options (checked once per process)
    yield
    jax.config.update("jax_compilation_cache_dir", RUN_CACHE)
    compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """The run's compilation cache folder (a session folder of its own when the run's cache
    is off), for tests that pass it to child processes (compile_cache_env)."""
    return Path(RUN_CACHE) if RUN_CACHE else tmp_path_factory.mktemp("jax_cache")


def compile_cache_env(cache) -> dict:
    """Environment variables giving a child process the same cache and matmul precision."""
    return {
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium (tests/report/chromium.py) for a module's browser checks; the
    module is skipped where the Debian packages cannot be had."""
    from tests.report import chromium

    absent = chromium.missing()
    if absent:
        pytest.skip(f"chromium cannot be installed on this machine ({', '.join(absent)} missing): "
                    "`make test` installs the Debian packages chromium and chromium-driver with "
                    "apt-get when it runs as root; install them to run the browser checks")
    with chromium.Browser(tmp_path_factory.mktemp("chromium")) as b:
        yield b
