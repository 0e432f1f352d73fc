"""Child process of the kill-mid-save test (run as a script, not collected by pytest).

    python kill_child.py CONFIG.json HANG_STEP MARKER

Trains with the run config in CONFIG.json (a ConfigDict as JSON). The checkpoint save of
step HANG_STEP stops at its commit point: every file is written into orbax's temporary
folder and only the atomic rename to the final step folder is left (in a bucket: the step
folder is written and only its commit marker is left). There the child writes MARKER and
blocks, so the parent can `kill -9` it exactly mid-save.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import ml_collections  # noqa: E402
from etils import epath  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py


def main() -> None:
    config_path, hang_step, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    path_type = type(epath.Path("/"))
    rename = path_type.rename

    def hanging_rename(self, target):
        if ".orbax-checkpoint-tmp" in self.name and epath.Path(target).name == hang_step:
            marker.write_text(str(self))
            while True:
                time.sleep(60)
        return rename(self, target)

    path_type.rename = hanging_rename
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.CommitFileTemporaryPath.finalize

    async def hanging_finalize(self):
        if self.get_final().name == hang_step:
            marker.write_text(str(self.get_final()))
            while True:
                time.sleep(60)
        return await finalize(self)

    atomicity.CommitFileTemporaryPath.finalize = hanging_finalize
    from olmo_jax import config as config_lib
    from olmo_jax.trainer.loop import train

    train(config_lib.validate(ml_collections.ConfigDict(json.loads(Path(config_path).read_text()))))


if __name__ == "__main__":
    main()
