"""The grain side of the data pipeline (olmo_jax/data/stream.py) and named eval sets:
the window order is grain's per-epoch shuffle, deterministic by seed and epoch; a batch
stream yields exactly `batch(step)[rows]` step after step, reads on grain's prefetch thread,
and resumes from its saved iterator state to the same batches; a process's rows are the
rows its devices hold; data.eval_sets builds one loader per set, with clear errors."""

from __future__ import annotations

import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmo_jax import distributed
from olmo_jax.data import BatchLoader, DataError, TokenWindows, build_data
from olmo_jax.data.stream import shuffle_seed, window_order
from tests.data.test_loader import identity_files, token_files, window_ids_of


@pytest.fixture
def windows(tmp_path: Path) -> TokenWindows:
    return TokenWindows(identity_files(tmp_path, [41, 3, 77, 20]), seq_len=4, instances="plus_one")  # 33 windows


def test_window_order_is_grains_shuffle_per_epoch():
    ids = np.arange(100, 133)
    order = window_order(ids, seed=3)
    epochs = [[int(order[e * 33 + i]) for i in range(33)] for e in range(3)]
    assert all(sorted(e) == list(ids) for e in epochs)  # each epoch: every window once
    assert len({tuple(e) for e in epochs}) == 3  # a new permutation each epoch
    again = window_order(ids, seed=3)
    assert [int(again[p]) for p in range(99)] == sum(epochs, [])  # deterministic
    # Seeds are hashed: epoch 1 of seed s is not epoch 0 of seed s + 1 (grain adds the epoch).
    assert shuffle_seed(3) + 1 != shuffle_seed(4)
    assert [int(window_order(ids, 4)[i]) for i in range(33)] != epochs[1]


def test_stream_yields_the_rows_of_each_step_from_a_reader_thread(windows, monkeypatch):
    loader = BatchLoader(windows, np.arange(len(windows)), global_batch_size=8, seed=1)
    threads = set()
    read = windows.read
    monkeypatch.setattr(windows, "read", lambda ids: threads.add(threading.current_thread().name) or read(ids))
    rows = np.array([1, 2, 5, 6])
    stream = loader.stream(rows, prefetch=3)
    got = [next(stream) for _ in range(6)]
    stream.close()
    readers = set(threads)
    assert readers and all(name.startswith("grain-prefetch") for name in readers), readers
    assert [s for s, _ in got] == list(range(6)) and loader.step == 6
    for step, batch in got:
        np.testing.assert_array_equal(batch, read(np.array([int(loader._order[step * 8 + r]) for r in rows])))
        np.testing.assert_array_equal(batch, loader.batch(step)[rows])


def test_stream_resumes_from_its_iterator_state(windows):
    loader = BatchLoader(windows, np.arange(len(windows)), global_batch_size=4, seed=5)
    stream = loader.stream(prefetch=2)
    first = [next(stream)[1] for _ in range(7)]
    state = stream.get_state()
    assert state == {"next_index": 7}
    rest = [next(stream)[1] for _ in range(5)]
    stream.close()
    fresh = BatchLoader(windows, np.arange(len(windows)), global_batch_size=4, seed=5)
    resumed = fresh.stream(prefetch=2)
    resumed.set_state(state)
    assert fresh.step == 7
    again = [next(resumed) for _ in range(5)]
    resumed.close()
    assert [s for s, _ in again] == list(range(7, 12))
    for a, (_, b) in zip(rest, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert window_ids_of(windows, np.concatenate(first[:8]))  # real windows


def test_local_rows_are_the_rows_the_devices_hold():
    """One process holds every row (the multi-process test, tests/distributed, covers a
    process reading only its own)."""
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = Mesh(devices, ("data", "expert"))
    batch = NamedSharding(mesh, PartitionSpec(("data", "expert"), None))
    np.testing.assert_array_equal(distributed.local_rows((16, 9), batch), np.arange(16))
    microbatched = NamedSharding(mesh, PartitionSpec(None, "data", None))  # expert devices repeat rows
    np.testing.assert_array_equal(distributed.local_rows((2, 8, 9), microbatched), np.arange(16))
    rows_BX = np.arange(16 * 9).reshape(16, 9)
    placed = distributed.place_batch(distributed.rows_reader(np.arange(16), rows_BX), (16, 9), batch)
    np.testing.assert_array_equal(np.asarray(placed), rows_BX)
    with pytest.raises(ValueError, match="not all among the rows read"):
        distributed.rows_reader(np.array([0, 2]), rows_BX[:2])(np.array([1]))


def test_eval_sets_are_whole_files_in_a_fixed_order(tmp_path: Path):
    paths = token_files(tmp_path, n_files=3)
    data = build_data({"paths": paths[:1], "eval_fraction": 0.01,
                       "eval_sets": {"b": paths[1], "cd": ",".join(paths[1:])}}, 64, 8)
    assert sorted(data.eval_sets) == ["b", "cd"]
    b, cd = data.eval_sets["b"], data.eval_sets["cd"]
    assert b.n_windows == 4999 // 64 and cd.n_windows == 2 * (4999 // 64)
    assert [str(f.path) for f in cd.windows.files] == paths[1:]
    other_seed = build_data({"paths": paths[:1], "eval_sets": {"b": paths[1]}}, 64, 8, seed=9)
    np.testing.assert_array_equal(other_seed.eval_sets["b"].batch(0), b.batch(0))
    assert "eval/cd/loss on 156 windows" in data.describe_eval()
    assert "default split: 8 of the 78 training-file windows" in data.describe_eval()


def test_eval_set_errors_name_the_field(tmp_path: Path):
    paths = token_files(tmp_path)
    missing = str(tmp_path / "nope.npy")
    with pytest.raises(DataError, match=r"data.eval_sets.wiki\[1\]: token file .*nope.npy does not exist"):
        build_data({"paths": paths, "eval_sets": {"wiki": [paths[0], missing]}}, 64, 8)
    with pytest.raises(DataError, match="data.eval_sets.tiny: .* fewer than one global batch of 8"):
        small = tmp_path / "small.npy"
        small.write_bytes(np.arange(200, dtype=np.uint16).tobytes())
        build_data({"paths": paths, "eval_sets": {"tiny": str(small)}}, 64, 8)
    with pytest.raises(DataError, match="data.eval_sets name 'a/b'"):
        build_data({"paths": paths, "eval_sets": {"a/b": paths[0]}}, 64, 8)
    with pytest.raises(DataError, match="data.eval_sets.empty lists no token files"):
        build_data({"paths": paths, "eval_sets": {"empty": ""}}, 64, 8)


def test_checkpoints_hold_the_iterator_state_through_grains_handler(tmp_path: Path, windows):
    from olmo_jax.checkpoint import manager as m

    stream = BatchLoader(windows, np.arange(len(windows)), global_batch_size=4, seed=5).stream(prefetch=2)
    for _ in range(3):
        next(stream)
    state = stream.get_state()
    with m.Checkpoints(tmp_path / "ckpts") as ckpts:
        ckpts.save(3, model={"w": np.zeros(2, np.float32)}, data_iter=state)
        next(stream)  # the stream moves on while the save completes: the saved state stays
        ckpts.save(4, model={"w": np.zeros(2, np.float32)})  # a checkpoint without one
        ckpts.wait()
        assert ckpts.read_iterator_state(3) == {"next_index": 3}
        assert ckpts.read_iterator_state(4) is None
    stream.close()
    assert (tmp_path / "ckpts" / "3" / "data_iter" / "process_0-of-1.json").is_file()
