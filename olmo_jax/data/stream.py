"""The grain side of the data pipeline.

- `window_order(window_ids, seed)`: a grain `MapDataset` giving the window id at each
  position of the endless training stream: `MapDataset.source(ids).shuffle(s).repeat()`.
  Position p is in epoch p // n, and each epoch is its own permutation (grain's
  `index_shuffle`, seeded with s + epoch, s a hash of the run seed): deterministic by
  seed and epoch, O(1) memory, any position addressable directly.
- `BatchStream`: the rows this process holds of consecutive global batches, read ahead by
  grain on its own thread (`to_iter_dataset` with `ReadOptions(num_threads=1,
  prefetch_buffer_size=data.prefetch)`), so the training thread only waits when a batch
  is not read yet. Its grain iterator state, `{"next_index": step}`, is saved in each
  checkpoint by grain's orbax handler (checkpoint/manager.py, item `data_iter`, one file
  per process) and restored on resume, so the resumed stream yields the same batches.
"""

from __future__ import annotations

import functools

import grain
import numpy as np

ENDLESS = 2**62  # the training stream's length in steps (grain datasets are sized)


def shuffle_seed(seed: int) -> int:
    """The 32-bit grain shuffle seed of a run seed (hashed: epoch e of seed s is seeded with
    shuffle_seed(s) + e, so seeds s and s + 1 do not share permutations)."""
    return int(np.random.SeedSequence([seed]).generate_state(1, np.uint32)[0])


def window_order(window_ids: np.ndarray, seed: int) -> grain.MapDataset:
    return grain.MapDataset.source(np.asarray(window_ids, np.int64)).shuffle(
        seed=shuffle_seed(seed)).repeat()


def _read_rows(loader, rows: dict, step: int) -> np.ndarray:
    return loader.batch(step, rows[loader.size(step)])


class BatchStream:
    """Yields (step, batch_BX) from `loader.step` on: rows `rows[size]` (global row ids,
    into the flattened batch; one set per batch size the loader's steps take) of each
    step's global batch, in that order. `loader.step` is set to step + 1 as each batch is
    yielded (what checkpoints record)."""

    def __init__(self, loader, rows: dict, prefetch: int):
        self.loader = loader
        self.rows = {int(size): np.asarray(r, np.int64) for size, r in rows.items()}
        steps = grain.MapDataset.range(ENDLESS).map(
            functools.partial(_read_rows, loader, self.rows))
        options = grain.ReadOptions(num_threads=1 if prefetch else 0,
                                    prefetch_buffer_size=prefetch)
        self._iter = steps.to_iter_dataset(options).__iter__()
        self.set_state({"next_index": loader.step})

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, np.ndarray]:
        step = self.step
        batch_BX = next(self._iter)
        self.loader.step = step + 1
        return step, batch_BX

    @property
    def step(self) -> int:
        """The step of the next batch."""
        return int(self._iter.get_state()["next_index"])

    def get_state(self) -> dict:
        """grain's iterator state: {"next_index": the next step}."""
        return self._iter.get_state()

    def set_state(self, state: dict) -> None:
        self._iter.set_state(state)
        self.loader.step = self.step

    def close(self) -> None:
        self._iter.close()
