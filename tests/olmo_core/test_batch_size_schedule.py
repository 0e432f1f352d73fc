"""trainer.batch_size_schedule against OLMo-core's own BatchSizeSchedulerCallback driving
its own NumpyFSLDataLoader (ai2-olmo-core in .venv-oracle, by subprocess:
batch_size_oracle.py) on the same token files: at every step the same global batch size
(an increase that waits for alignment, a decrease, a first size other than the
configured one), the same slice of the epoch's instance order, the same instances' tokens,
the same learning rate (OLMo-core's scheduler from the rescaled initial lr, with its
moving t_max; 1e-12 relative), the same `batch_size` logged, and the run ending at the
same step. olmo_jax's epoch order is grain's permutation, OLMo-core's numpy's: the steps
read the same positions of them, so with the same order they are the same instances."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from olmo_jax import config as config_lib
from olmo_jax.data import TokenFile, TokenWindows, dtype_for_vocab, write_token_file
from olmo_jax.data.loader import BatchLoader
from olmo_jax.optim import schedulers
from olmo_jax.trainer.loop import schedule_args

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

SEQ, VOCAB, SEED, LR = 16, 50_280, 7, 1e-3
# The loader's configured 8 x 16 tokens; 4 sequences first (the lr x sqrt(1/2) at once),
# 16 from 150 tokens (due at step 4, position 12: waits a step), 32 from 700 (waits at
# position 48), back to 8 sequences from 2,000 tokens (a decrease applies at once).
EVENTS = [(64, 0), (256, 150), (512, 700), (128, 2000)]
CASES = [
    # a run of 40 steps, a token-unit cosine: OLMo-core's max_tokens moves with the batch
    {"scheduler": "cos_with_warmup(warmup=300, alpha_f=0.1, units='tokens')",
     "duration": ["steps", 40], "trainer": {"max_steps": 40}},
    # a run of 5,000 tokens, a step-unit WSD: OLMo-core's max_steps moves with the batch
    {"scheduler": "wsd(warmup=3, decay=6, decay_fraction=None)",
     "duration": ["tokens", 5000], "trainer": {"max_steps": 0, "max_tokens": 5000}},
]


def _files(tmp_path: Path) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for k, n in enumerate([200 * SEQ + 5, 150 * SEQ, 170 * SEQ + 11]):  # 520 instances
        paths.append(str(tmp_path / f"part-{k}.npy"))
        write_token_file(paths[-1], rng.integers(1, VOCAB, n), dtype_for_vocab(VOCAB))
    return paths


def _trainer(case: dict):
    cfg = config_lib.default_config()
    t = cfg.trainer
    t.seq_len, t.global_batch_size = SEQ, 8
    t.batch_size_schedule = ",".join(f"{size}@{start}" for size, start in EVENTS)
    for k, v in case["trainer"].items():
        t[k] = v
    cfg.optim.lr, cfg.optim.scheduler = LR, case["scheduler"]
    return config_lib.validate(cfg).trainer


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch_size_oracle")
    paths = _files(tmp)
    cases = [{"global_batch_size": 8 * SEQ, "batch_sizes": [s for s, _ in EVENTS],
              "schedule": [t for _, t in EVENTS], "lr": LR, "scheduler": c["scheduler"],
              "duration": c["duration"], "steps": _trainer(c).total_steps} for c in CASES]
    spec = {"paths": paths, "vocab_size": VOCAB, "seq_len": SEQ, "work_dir": str(tmp),
            "seed": SEED, "cases": cases}
    (tmp / "spec.json").write_text(json.dumps(spec))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("batch_size_oracle.py")),
                    str(tmp / "spec.json"), str(tmp / "out.json")], check=True, cwd=tmp, timeout=300)
    return paths, json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("case", range(len(CASES)), ids=["steps", "tokens"])
def test_sizes_instances_and_lr_equal_olmo_cores(oracle, case):
    paths, out = oracle
    want, t = out[case], _trainer(CASES[case])
    steps = t.total_steps
    assert want["complete_at"] == steps  # the run ends at the same step
    windows = TokenWindows([TokenFile(p, dtype_for_vocab(VOCAB), VOCAB) for p in paths], SEQ)
    loader = BatchLoader(windows, np.arange(len(windows)), t.global_batch_size, SEED,
                         schedule=t.batch_schedule)

    sizes = [loader.size(k) * SEQ for k in range(steps)]
    assert sizes == want["sizes"] == want["logged"]
    assert {64, 256, 512, 128} <= set(sizes)

    # OLMo-core's step k reads positions [p_k, p_k + B_k) of its epoch order; so does olmo_jax
    position_of = np.argsort(np.asarray(want["order"]))
    for k in range(steps):
        got = loader.position(k) + np.arange(loader.size(k))
        np.testing.assert_array_equal(position_of[want["indices"][k]], got, err_msg=f"step {k}")
        # the instances OLMo-core reads are olmo_jax's windows of the same ids
        np.testing.assert_array_equal(windows.read(want["indices"][k])[:, :-1], want["input_ids"][k])

    sched = schedulers.parse(CASES[case]["scheduler"])
    got = schedulers.lr_table(sched, LR, steps, **schedule_args(t))
    np.testing.assert_allclose(got, want["lrs"], rtol=1e-12, atol=0)
    assert len(np.unique(np.round(np.asarray(want["lrs"]) / LR, 12))) > 5  # the lr moves
