"""From token files to training batches.

- `TokenWindows`: the files viewed as fixed windows of `seq_len + 1` tokens at stride
  `seq_len` (inputs = window[:-1], targets = window[1:], so each token is predicted once);
  a window never crosses a file boundary, and a file's last `< seq_len` tokens are unused.
- `split_windows`: the deterministic train / held-out split of window ids.
- `BatchLoader`: batches addressed by global step. The windows of one split form an
  endless stream, epoch after epoch, each epoch a permutation (grain's shuffle, seeded by
  seed and epoch: pipeline.py); the batch of step s is stream positions
  `[s * B, (s + 1) * B)`. Epochs wrap: a batch may end one epoch and start the next, no
  window is dropped, and each is seen once per epoch. So `batch(step)` depends only on
  (data, seed, B, step): not on call order, process count or mesh, and each process can
  read only its `rows` of the global batch. `BatchLoader.stream(rows)` yields those rows
  step after step, read ahead by grain, with a checkpointable iterator state.
- `build_data`: the factory from the `data` config section.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from olmo_jax.data.corpus import CORPUS_DTYPE, stdlib_corpus
from olmo_jax.data.errors import DataError
from olmo_jax.data.pipeline import BatchStream, window_order
from olmo_jax.data.token_file import TokenFile, dtype_for_vocab, token_dtype
from olmo_jax.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

# The hold-out depends only on the data, never on the training seed, so runs with
# different seeds are evaluated on the same windows.
SPLIT_SEED = 0


class TokenWindows:
    """Windows of `seq_len + 1` tokens at stride `seq_len` over each file in turn."""

    def __init__(self, files: Sequence[TokenFile], seq_len: int):
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be at least 1")
        self.files = list(files)
        self.seq_len = seq_len
        windows_per_file_F = np.array([max(0, (len(f) - 1) // seq_len) for f in self.files])
        # first_window_F[f] = global id of file f's first window; the last entry is the total.
        self._first_window_F = np.concatenate([[0], np.cumsum(windows_per_file_F)]).astype(np.int64)

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
        return self.files[file_id][start : start + self.seq_len + 1]

    def read(self, window_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Windows `window_ids` stacked, int32 [len(window_ids), seq_len + 1]."""
        windows_NL = np.empty((len(window_ids), self.seq_len + 1), dtype=np.int32)
        for row, window_id in enumerate(window_ids):
            windows_NL[row] = self.window(int(window_id))
        return windows_NL


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


class BatchLoader:
    """Global batches of `global_batch_size` windows drawn from `window_ids`, by step.

    `step` is the next step `iterate` will yield; `state_dict` / `load_state_dict` carry it
    (with what it depends on) through checkpoints."""

    def __init__(
        self,
        windows: TokenWindows,
        window_ids: Sequence[int] | np.ndarray,
        global_batch_size: int,
        seed: int,
    ):
        self.windows = windows
        self.window_ids = np.asarray(window_ids, dtype=np.int64)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.step = 0
        if seed < 0:
            raise DataError(f"seed={seed} must be non-negative (numpy seeds the shuffle with it)")
        if global_batch_size < 1:
            raise DataError(f"global batch size {global_batch_size} must be at least 1")
        if self.n_windows < global_batch_size:
            raise DataError(
                f"{self.n_windows} windows of seq_len {windows.seq_len} + 1 tokens are fewer "
                f"than one global batch of {global_batch_size}; lower seq_len or the global "
                "batch size, or add token files to data.paths"
            )
        self._order = window_order(self.window_ids, seed)  # position -> window id (grain)

    @property
    def n_windows(self) -> int:
        return len(self.window_ids)

    @property
    def seq_len(self) -> int:
        return self.windows.seq_len

    @property
    def steps_per_epoch(self) -> int:
        """Full batches inside epoch 0: steps [0, steps_per_epoch) read distinct windows."""
        return self.n_windows // self.global_batch_size

    def epoch_at(self, step: int) -> int:
        """The epoch that the first row of `step`'s batch belongs to."""
        return step * self.global_batch_size // self.n_windows

    def batch(self, step: int, rows: slice | None = None) -> np.ndarray:
        """Rows `rows` (default all) of step `step`'s global batch, int32 [rows, seq_len + 1]."""
        if step < 0:
            raise IndexError(f"step {step} must be non-negative")
        row_ids = np.arange(self.global_batch_size)[rows if rows is not None else slice(None)]
        positions_R = step * self.global_batch_size + row_ids
        return self.windows.read([self._order[int(p)] for p in positions_R])

    def stream(self, rows: np.ndarray | None = None, prefetch: int = 0) -> BatchStream:
        """Rows `rows` (default all) of the batches from `self.step` on, read ahead
        `prefetch` batches by grain on its own thread (pipeline.py)."""
        rows = np.arange(self.global_batch_size) if rows is None else rows
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

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "seed": self.seed,
            "n_windows": self.n_windows,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resumes at `state["step"]`; raises DataError if the batches it indexes would differ."""
        current = self.state_dict()
        changed = [
            f"{key} {int(state[key])} -> {current[key]}"
            for key in ("n_windows", "seq_len", "global_batch_size", "seed")
            if int(state[key]) != current[key]
        ]
        if changed:
            raise DataError(
                "the checkpoint's data position does not fit this data loader ("
                + ", ".join(changed)
                + "): the token files (data.paths), data.eval_fraction, seq_len, the global "
                "batch size or the seed changed since it was saved; resume with the same "
                "settings, or start a new run"
            )
        self.step = int(state["step"])


@dataclass(frozen=True)
class Data:
    """What `build_data` returns. `eval` (the default split) is None when
    data.eval_fraction is 0; `eval_sets` are the named sets of data.eval_sets."""

    train: BatchLoader
    eval: BatchLoader | None
    tokenizer: Tokenizer
    vocab_size: int
    windows: TokenWindows
    eval_sets: dict[str, BatchLoader] = field(default_factory=dict)

    def describe_eval(self) -> str:
        """What evaluation reads, for the startup banner."""
        parts = []
        if self.eval is not None:
            n, total = self.eval.n_windows, len(self.windows)
            parts.append(
                f"eval_loss on the default split: {n} of the {total} training-file windows "
                f"({100 * n / total:.1f}%, data.eval_fraction; a fixed draw, seed {SPLIT_SEED}), "
                "held out of training")
        else:
            parts.append("no default split (data.eval_fraction=0)")
        for name, loader in self.eval_sets.items():
            files = ", ".join(str(f.path) for f in loader.windows.files)
            parts.append(f"eval/{name}/loss on {loader.n_windows} windows of {files}")
        return "; ".join(parts)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "olmo_jax"


def _field(cfg: Any, name: str, default: Any) -> Any:
    """`cfg[name]` for mappings, `cfg.name` otherwise (ml_collections, dataclasses)."""
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def build_data(
    data_cfg: Any,
    seq_len: int,
    global_batch_size: int,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> Data:
    """Train and eval loaders from the `data` config section: a dict, ConfigDict or object
    with `paths` (token files, a list or one comma-separated string; empty: the embedded
    stdlib corpus, cached in `cache_dir`),
    `tokenizer` ('' | 'bytes' | path to tokenizer.json), `vocab_size` (0: the tokenizer's
    padded vocabulary), `eval_fraction` (default 0.01; at least one global batch is held
    out, 0 disables eval) and `dtype` ('' from the vocabulary, 'uint16', 'uint32')."""
    paths = _paths(_field(data_cfg, "paths", ()))
    tokenizer_spec = str(_field(data_cfg, "tokenizer", ""))
    tokenizer = load_tokenizer(tokenizer_spec)
    vocab_size = int(_field(data_cfg, "vocab_size", 0)) or tokenizer.padded_vocab_size
    eval_fraction = float(_field(data_cfg, "eval_fraction", 0.01))
    dtype_name = str(_field(data_cfg, "dtype", ""))
    if vocab_size < tokenizer.vocab_size:
        raise DataError(
            f"data.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set it to 0 (the padded tokenizer vocabulary, "
            f"{tokenizer.padded_vocab_size}) or at least {tokenizer.vocab_size}"
        )

    if not paths:
        if not isinstance(tokenizer, ByteTokenizer):
            raise DataError(
                "data.paths is empty, so the byte-tokenized embedded corpus is used, but "
                f"data.tokenizer={tokenizer_spec!r}; set data.tokenizer='' or list token "
                "files made with that tokenizer in data.paths"
            )
        if dtype_name and token_dtype(dtype_name) != CORPUS_DTYPE:
            raise DataError(
                f"data.dtype={dtype_name!r}, but the embedded corpus (data.paths empty) is "
                "uint16; set data.dtype=''"
            )
        corpus_path = stdlib_corpus(cache_dir if cache_dir is not None else default_cache_dir())
        files = [TokenFile(corpus_path, CORPUS_DTYPE, vocab_size)]
    else:
        dtype = token_dtype(dtype_name) if dtype_name else dtype_for_vocab(vocab_size)
        files = _token_files(paths, "data.paths", dtype, vocab_size,
                             " (or leave data.paths empty for the embedded stdlib corpus)")

    windows = TokenWindows(files, seq_len)
    n_batches_needed = 2 if eval_fraction > 0 else 1  # train, and eval when enabled
    if len(windows) < n_batches_needed * global_batch_size:
        raise DataError(
            f"the data ({windows.n_tokens} tokens in {len(files)} file(s)) gives "
            f"{len(windows)} windows of seq_len {seq_len} + 1 tokens, fewer than "
            f"{n_batches_needed} global batch(es) of {global_batch_size} (training"
            + (", and eval since data.eval_fraction > 0" if eval_fraction > 0 else "")
            + "); lower seq_len or the global batch size, or add token files to data.paths"
        )
    min_eval_windows = global_batch_size if eval_fraction > 0 else 0
    train_ids, eval_ids = split_windows(len(windows), eval_fraction, SPLIT_SEED, min_eval_windows)
    if len(train_ids) < global_batch_size:
        raise DataError(
            f"after holding out {len(eval_ids)} of {len(windows)} windows for eval "
            f"(data.eval_fraction={eval_fraction}, at least one global batch), "
            f"{len(train_ids)} remain for training, fewer than one global batch of "
            f"{global_batch_size} at seq_len {seq_len}; lower data.eval_fraction, seq_len or "
            "the global batch size, or add token files to data.paths"
        )
    # Eval batches ignore the training seed too: every run evaluates the same batches.
    eval_loader = None
    if len(eval_ids):
        eval_loader = BatchLoader(windows, eval_ids, global_batch_size, SPLIT_SEED)
    dtype = token_dtype(dtype_name) if dtype_name else dtype_for_vocab(vocab_size)
    eval_sets = {
        name: _eval_set(name, set_paths, seq_len, global_batch_size, dtype, vocab_size)
        for name, set_paths in _mapping(_field(data_cfg, "eval_sets", {})).items()
    }
    return Data(
        train=BatchLoader(windows, train_ids, global_batch_size, seed),
        eval=eval_loader,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        windows=windows,
        eval_sets=eval_sets,
    )


def _paths(paths: Any) -> list:
    if isinstance(paths, str):  # the config's form: comma-separated paths
        return [p.strip() for p in paths.split(",") if p.strip()]
    return [paths] if isinstance(paths, Path) else list(paths)


def _mapping(value: Any) -> dict:
    if hasattr(value, "to_dict"):  # ml_collections.ConfigDict
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise DataError(
            f"data.eval_sets={value!r} must map names to token files, e.g. "
            "{'wiki': '/data/wiki_val.npy'}")
    return dict(value)


def _token_files(paths: list, where: str, dtype: np.dtype, vocab_size: int,
                 hint: str = "") -> list[TokenFile]:
    for i, path in enumerate(paths):
        if not Path(path).expanduser().is_file():
            raise DataError(
                f"{where}[{i}]: token file {path} does not exist; make one from text "
                f"files with `python tools/tokenize_files.py INPUTS -o OUTPUT`{hint}"
            )
    return [TokenFile(Path(path).expanduser(), dtype, vocab_size) for path in paths]


def _eval_set(name: str, paths: Any, seq_len: int, global_batch_size: int, dtype: np.dtype,
              vocab_size: int) -> BatchLoader:
    """A named eval set: every window of its files, in a fixed shuffled order (seed
    SPLIT_SEED, like the default split), one global batch at a time."""
    where = f"data.eval_sets.{name}"
    if not name or not all(c.isalnum() or c in "_-." for c in name):
        raise DataError(
            f"data.eval_sets name {name!r} is logged as eval/<name>/loss: use letters, "
            "digits, '_', '-' or '.'")
    paths = _paths(paths)
    if not paths:
        raise DataError(f"{where} lists no token files; give it one or more, or remove it")
    windows = TokenWindows(_token_files(paths, where, dtype, vocab_size), seq_len)
    if len(windows) < global_batch_size:
        raise DataError(
            f"{where}: {windows.n_tokens} tokens give {len(windows)} windows of seq_len "
            f"{seq_len} + 1 tokens, fewer than one global batch of {global_batch_size} "
            "(evaluation runs whole global batches); add token files to it, or lower "
            "seq_len or the global batch size")
    return BatchLoader(windows, np.arange(len(windows)), global_batch_size, SPLIT_SEED)
