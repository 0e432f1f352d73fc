"""From token files to training batches.

- `TokenWindows`: the files viewed as fixed windows, each a row of `seq_len + 1` ints
  (inputs = row[:-1], targets = row[1:]); a window never crosses a file boundary. Two
  layouts (`data.instances`):
  - `olmo_core` (default): OLMo-core's fixed-length instances, `seq_len` tokens at stride
    `seq_len`, so a file of k * seq_len tokens gives k instances. The model reads all
    `seq_len` tokens; the last position has no label: the row's last entry is a sentinel
    (labels.py), `NO_LABEL`, or `FILTERED` when the instance fails the repetition filter
    (repetition.py), which zeroes its loss but still counts its seq_len - 1 labels, as
    OLMo-core does. A file's last `< seq_len` tokens are unused.
  - `plus_one`: windows of `seq_len + 1` tokens at stride `seq_len`, every position
    labelled (the window's last token is the next window's first); a file's last
    `< seq_len + 1` tokens beyond the last window are unused.
- `split_windows`: the deterministic train / held-out split of window ids.
- `BatchLoader`: batches addressed by global step. The windows of one split form an
  endless stream, epoch after epoch, each epoch a permutation (grain's shuffle, seeded by
  seed and epoch: stream.py); the batch of step s is stream positions
  `[s * B, (s + 1) * B)`. Epochs wrap: a batch may end one epoch and start the next, no
  window is dropped, and each is seen once per epoch. So `batch(step)` depends only on
  (data, seed, B, step): not on call order, process count or mesh, and each process can
  read only its `rows` of the global batch. `BatchLoader.stream(rows)` yields those rows
  step after step, read ahead by grain, with a checkpointable iterator state. With a
  batch-size schedule (batch_schedule.py) step s holds `size(s)` windows from stream
  position `position(s)`: consecutive slices still, of the sizes the schedule sets.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from olmo_jax import storage
from olmo_jax.data.batch_schedule import BatchSizeSchedule
from olmo_jax.data.repetition import RepetitionFilter
from olmo_jax.data.stream import BatchStream, window_order
from olmo_jax.data.token_file import TokenFile
from olmo_jax.errors import DataError
from olmo_jax.labels import FILTERED, INSTANCES, NO_LABEL


def document_lengths(tokens_T: np.ndarray, eos_id: int) -> np.ndarray:
    """The lengths of the documents in one instance's tokens, int32, as OLMo-core's
    `get_document_lengths` (data/utils.py) cuts them: a document ends with (and includes)
    an EOS token; the tokens after the last EOS are one more document. With data.doc_mask
    the model masks attention between them: objective.document_segments numbers each
    position's document on the device, from the same tokens of the batch row."""
    tokens_T = np.asarray(tokens_T)
    ends = np.flatnonzero(tokens_T == eos_id)
    if len(tokens_T) and (len(ends) == 0 or ends[-1] != len(tokens_T) - 1):
        ends = np.append(ends, len(tokens_T) - 1)
    return np.diff(np.concatenate([[-1], ends])).astype(np.int32)


# The hold-out depends only on the data, never on the training seed, so runs with
# different seeds are evaluated on the same windows.
SPLIT_SEED = 0


def _noop(spans) -> None:
    """The prefetch of a file that has none (a local TokenFile)."""


class TokenWindows:
    """Rows of `seq_len + 1` ints over each file in turn, in the `instances` layout."""

    def __init__(self, files: Sequence[TokenFile], seq_len: int, instances: str = "olmo_core",
                 repetition_filter: RepetitionFilter | None = None):
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be at least 1")
        if instances not in INSTANCES:
            raise DataError(f"data.instances={instances!r}: choose one of {', '.join(INSTANCES)}")
        if repetition_filter is not None and instances != "olmo_core":
            raise DataError(
                "data.repetition_filter drops an instance from the loss through its unlabelled "
                "last position, which only data.instances='olmo_core' has; set "
                "data.instances='olmo_core' or turn the filter off")
        self.files = list(files)
        self.seq_len = seq_len
        self.instances = instances
        self.repetition_filter = repetition_filter
        tokens_read = seq_len if instances == "olmo_core" else seq_len + 1
        windows_per_file_F = np.array(
            [max(0, (len(f) - tokens_read) // seq_len + 1) for f in self.files])
        # first_window_F[f] = global id of file f's first window; the last entry is the total.
        self._first_window_F = np.concatenate([[0], np.cumsum(windows_per_file_F)]).astype(np.int64)
        # Files in an object store fetch a batch's windows in one request batch (prefetch).
        self._tokens_read = tokens_read
        self._remote = any(storage.is_remote(f.path) for f in self.files)

    def __len__(self) -> int:
        return int(self._first_window_F[-1])

    @property
    def n_tokens(self) -> int:
        return sum(len(f) for f in self.files)

    def window(self, window_id: int) -> np.ndarray:
        """Window `window_id` as int32 [seq_len + 1]."""
        if not 0 <= window_id < len(self):
            raise IndexError(f"window {window_id} out of range [0, {len(self)})")
        file_id = int(np.searchsorted(self._first_window_F, window_id, side="right")) - 1
        start = int(window_id - self._first_window_F[file_id]) * self.seq_len
        if self.instances == "plus_one":
            return self.files[file_id][start : start + self.seq_len + 1]
        tokens_T = self.files[file_id][start : start + self.seq_len]
        keep = self.repetition_filter is None or self.repetition_filter.keeps(tokens_T)
        return np.append(tokens_T, np.int32(NO_LABEL if keep else FILTERED))

    def read(self, window_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Windows `window_ids` stacked, int32 [len(window_ids), seq_len + 1]."""
        if self._remote:
            self._prefetch(window_ids)
        windows_BX = np.empty((len(window_ids), self.seq_len + 1), dtype=np.int32)
        for row, window_id in enumerate(window_ids):
            windows_BX[row] = self.window(int(window_id))
        return windows_BX

    def _prefetch(self, window_ids) -> None:
        """Token spans of `window_ids`, grouped by file, to each remote file's prefetch."""
        ids = np.asarray(window_ids, dtype=np.int64)
        file_ids = np.searchsorted(self._first_window_F, ids, side="right") - 1
        starts = (ids - self._first_window_F[file_ids]) * self.seq_len
        for f in np.unique(file_ids):
            prefetch = getattr(self.files[f], "prefetch", _noop)
            prefetch([(int(a), int(a) + self._tokens_read) for a in starts[file_ids == f]])


def split_windows(
    n_windows: int, eval_fraction: float, seed: int, min_eval_windows: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(train_ids, eval_ids), sorted, disjoint, covering range(n_windows).

    The held-out set is a uniformly random subset, drawn from `default_rng([seed, 1])`, of
    `max(min_eval_windows, round(eval_fraction * n_windows))` windows; none when
    `eval_fraction` is 0."""
    if not 0 <= eval_fraction < 1:
        raise DataError(f"data.eval_fraction={eval_fraction} must be in [0, 1); 0 disables eval")
    if eval_fraction == 0:
        return np.arange(n_windows), np.arange(0)
    n_eval = max(min_eval_windows, round(eval_fraction * n_windows))
    if n_eval >= n_windows:
        raise DataError(
            f"holding out {n_eval} of {n_windows} windows for eval (data.eval_fraction="
            f"{eval_fraction}) leaves none to train on; add data, shorten seq_len, or lower "
            "the global batch size"
        )
    eval_ids = np.sort(np.random.default_rng([seed, 1]).choice(n_windows, n_eval, replace=False))
    return np.setdiff1d(np.arange(n_windows), eval_ids, assume_unique=True), eval_ids


# What a loader-state key that a checkpoint lacks meant when it was saved.
ABSENT_STATE_MEANING = {"instances": "plus_one", "repetition_filter": "off", "mixture": "none",
                        "batch_size_schedule": ""}


class BatchLoader:
    """Global batches of `global_batch_size` windows drawn from `window_ids`, by step.

    `step` is the next step `iterate` will yield; `state_dict` / `load_state_dict` carry it
    (with what it depends on) through checkpoints. `mixture` is the fingerprint of the
    data.sources selection the windows come from ("none" without one). `schedule` (a
    BatchSizeSchedule whose reference is `global_batch_size`) sets each step's size."""

    def __init__(
        self,
        windows: TokenWindows,
        window_ids: Sequence[int] | np.ndarray,
        global_batch_size: int,
        seed: int,
        mixture: str = "none",
        schedule: BatchSizeSchedule | None = None,
    ):
        self.windows = windows
        self.mixture = mixture
        self.schedule = schedule
        self.window_ids = np.asarray(window_ids, dtype=np.int64)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.step = 0
        if seed < 0:
            raise DataError(f"seed={seed} must be non-negative (numpy seeds the shuffle with it)")
        if global_batch_size < 1:
            raise DataError(f"global batch size {global_batch_size} must be at least 1")
        largest = max(self.sizes)
        if self.n_windows < largest:
            raise DataError(
                f"{self.n_windows} windows of seq_len {windows.seq_len} are fewer "
                f"than one global batch of {largest}; lower seq_len or the global "
                "batch size (or trainer.batch_size_schedule's largest), or add token files to data.paths"
            )
        self._order = window_order(self.window_ids, seed)  # position -> window id (grain)

    @property
    def n_windows(self) -> int:
        return len(self.window_ids)

    @property
    def seq_len(self) -> int:
        return self.windows.seq_len

    @property
    def sizes(self) -> list[int]:
        """The distinct batch sizes of the steps, ascending."""
        if self.schedule is None:
            return [self.global_batch_size]
        return [int(s) for s in self.schedule.sizes]

    def size(self, step: int) -> int:
        """Windows in step `step`'s batch."""
        return self.global_batch_size if self.schedule is None else self.schedule.size(step)

    def position(self, step: int) -> int:
        """The stream position of step `step`'s first window."""
        return step * self.global_batch_size if self.schedule is None else self.schedule.position(step)

    @property
    def steps_per_epoch(self) -> int:
        """Full batches inside epoch 0: steps [0, steps_per_epoch) read distinct windows."""
        return self.n_windows // self.global_batch_size

    def epoch_at(self, step: int) -> int:
        """The epoch that the first row of `step`'s batch belongs to."""
        return self.position(step) // self.n_windows

    def batch(self, step: int, rows: slice | None = None) -> np.ndarray:
        """Rows `rows` (default all) of step `step`'s global batch, int32 [rows, seq_len + 1]."""
        if step < 0:
            raise IndexError(f"step {step} must be non-negative")
        row_ids = np.arange(self.size(step))[rows if rows is not None else slice(None)]
        positions_B = self.position(step) + row_ids
        return self.windows.read([self._order[int(p)] for p in positions_B])

    def stream(self, rows: np.ndarray | Mapping[int, np.ndarray] | None = None,
               prefetch: int = 0) -> BatchStream:
        """Rows `rows` (default all; with a batch-size schedule {size: rows} for each of
        `sizes`) of the batches from `self.step` on, read ahead `prefetch` batches by grain
        on its own thread (stream.py)."""
        if rows is None:
            rows = {size: np.arange(size) for size in self.sizes}
        elif not isinstance(rows, Mapping):
            rows = {self.global_batch_size: rows}
        return BatchStream(self, rows, prefetch)

    def iterate(
        self, start_step: int | None = None, rows: slice | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """(step, batch) from `start_step` (default: `self.step`) on; `self.step` is set to
        step + 1 as each batch is yielded, so a checkpoint taken after training on it resumes
        with the next one."""
        step = self.step if start_step is None else start_step
        while True:
            batch = self.batch(step, rows)
            self.step = step + 1
            yield step, batch
            step += 1

    def state_dict(self) -> dict[str, int | str]:
        """The position and what it depends on (`batch_size_schedule` only when there is one)."""
        f = self.windows.repetition_filter
        state = {
            "step": self.step,
            "seed": self.seed,
            "n_windows": self.n_windows,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "instances": self.windows.instances,
            "repetition_filter": "off" if f is None else f"{f.max_period}/{f.min_period}/{f.max_count}",
            "mixture": self.mixture,
        }
        if self.schedule is not None:
            state["batch_size_schedule"] = self.schedule.spec
        return state

    def load_state_dict(self, state: Mapping[str, int | str]) -> None:
        """Resumes at `state["step"]`; raises DataError if the batches it indexes would differ.
        A state saved before the instance layout and the filter were recorded had the
        plus_one windows and no filter."""
        current = {**ABSENT_STATE_MEANING, **self.state_dict()}
        saved = {**ABSENT_STATE_MEANING, **state}
        if str(saved["batch_size_schedule"]) != current["batch_size_schedule"]:
            raise DataError(
                f"the checkpoint was saved with trainer.batch_size_schedule="
                f"{saved['batch_size_schedule']!r} and this run has "
                f"{current['batch_size_schedule']!r}: its steps would read other batches at "
                "other sizes; resume with the checkpoint's schedule, or start a new run")
        if str(saved["mixture"]) != self.mixture:
            raise DataError(
                f"the checkpoint was saved with data mixture {saved['mixture']} and this run "
                f"selects {self.mixture} (fingerprints of the files and token counts chosen): "
                "data.sources, data.requested_tokens or data.mix (or the files they name) "
                "changed since it was saved; resume with the same mixture, or start a new run")
        changed = [
            f"{key} {saved[key]} -> {current[key]}"
            for key in ("n_windows", "seq_len", "global_batch_size", "seed", "instances",
                        "repetition_filter")
            if str(saved[key]) != str(current[key])
        ]
        if changed:
            raise DataError(
                "the checkpoint's data position does not fit this data loader ("
                + ", ".join(changed)
                + "): the token files (data.paths), data.eval_fraction, seq_len, the global "
                "batch size, the seed, data.instances or the repetition filter changed since "
                "it was saved; resume with the same settings, or start a new run"
            )
        self.step = int(state["step"])
