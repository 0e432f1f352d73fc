"""A multi-process run (2 processes x 4 CPU devices on loopback, tests/distributed/launcher.py)
whose run folder is in an S3 bucket (moto's server on 127.0.0.1, tests/moto_s3.py):

1. The first launch trains into s3://.../mp and stops at trainer.hard_stop=2 with a
   collective checkpoint in the bucket; both processes exit 0. Process 0 held the lease
   (process 1 only checked the bucket) and gave it back.
2. A second launch resumes from the bucket's step 2 and trains to step 4.
3. Every step, logged once in the bucket's metrics.jsonl, has the loss and gradient norm of
   this process's single-process 8-device run of the same steps within 1e-5 (as
   test_multiprocess.py: the reductions run over another device layout); each checkpoint
   holds both processes' data iterator states and its commit marker.
"""

import json

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from olmo_jax import config as config_lib  # noqa: E402
from olmo_jax import storage  # noqa: E402
from olmo_jax.checkpoint.object_store import COMMIT_MARKER  # noqa: E402
from olmo_jax.trainer.loop import train  # noqa: E402
from tests import moto_s3  # noqa: E402
from tests.distributed.launcher import Run, logged_steps  # noqa: E402
from tests.run_config import run_config  # noqa: E402

BUCKET = "mp-bkt"
RUN = f"s3://{BUCKET}/team/mp"
STEPS = 4


@pytest.mark.slow
def test_two_processes_train_into_a_bucket_and_resume_from_it(tmp_path, compile_cache):
    with moto_s3.server() as endpoint, moto_s3.environment(endpoint):
        storage.filesystem("s3://").mkdir(BUCKET)
        args = [f"--config.trainer.run_dir={RUN}", f"--config.trainer.cache_dir={tmp_path / 'cache'}",
                f"--config.trainer.max_steps={STEPS}", "--config.trainer.save_every=2"]
        first = Run(2, [*args, "--config.trainer.hard_stop=2"], tmp_path / "logs1", compile_cache)
        assert first.wait(300) == [0, 0], first.log(0)[-3000:] + first.log(1)[-3000:]
        steps = [json.loads(line)["step"] for line in storage.read_text(f"{RUN}/metrics.jsonl").splitlines()]
        assert steps == [1, 2]
        assert not storage.exists(f"{RUN}/owner.lease")  # process 0 gave it back

        second = Run(2, args, tmp_path / "logs2", compile_cache)
        assert second.wait(300) == [0, 0], second.log(0)[-3000:] + second.log(1)[-3000:]
        assert f"resumed from checkpoint step 2 in {RUN}/checkpoints" in second.log(0)
        records = [json.loads(line) for line in storage.read_text(f"{RUN}/metrics.jsonl").splitlines()]
        fs = storage.filesystem(RUN)
        for step in (2, 4):
            assert fs.isfile(f"{RUN}/checkpoints/{step}/{COMMIT_MARKER}"), step
            for i in range(2):
                assert fs.isfile(f"{RUN}/checkpoints/{step}/data_iter/process_{i}-of-2.json"), (step, i)
        assert not storage.exists(f"{RUN}/owner.lease")
        for log in (first.log(0), first.log(1), second.log(0), second.log(1)):
            assert moto_s3.SECRET not in log and moto_s3.KEY_ID not in log

    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once
    train(config_lib.validate(run_config(tmp_path / "reference", hard_stop=STEPS)))
    reference = logged_steps(tmp_path / "reference")
    for got, ref in zip(records, reference, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - ref[key]) <= 1e-5, (got["step"], key, got[key], ref[key])
