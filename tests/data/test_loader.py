"""Windows over token files, the train/eval split, step-addressed batches, and build_data."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import ml_collections
import numpy as np
import pytest

from olmo_jax import labels
from olmo_jax.data import (
    BatchLoader,
    ByteTokenizer,
    DataError,
    TokenFile,
    TokenWindows,
    build_data,
    split_windows,
    write_token_file,
)
from olmo_jax.data.repetition import RepetitionFilter

VOCAB = 8000  # token ids k * 1000 + offset: a token says which file and offset it came from


def identity_files(tmp_path: Path, lengths: list[int]) -> list[TokenFile]:
    """File k holds tokens k * 1000 + arange(length)."""
    files = []
    for k, length in enumerate(lengths):
        path = tmp_path / f"part-{k}.npy"
        write_token_file(path, k * 1000 + np.arange(length), "uint16")
        files.append(TokenFile(path, "uint16", VOCAB))
    return files


def window_ids_of(windows: TokenWindows, batch_BX: np.ndarray) -> list[int]:
    first_token_to_id = {int(windows.window(i)[0]): i for i in range(len(windows))}
    return [first_token_to_id[int(row[0])] for row in batch_BX]


@pytest.fixture
def windows(tmp_path: Path) -> TokenWindows:
    return TokenWindows(identity_files(tmp_path, [41, 3, 77, 20]), seq_len=4, instances="plus_one")


def test_plus_one_windows_stay_inside_files_and_predict_each_token_once(tmp_path: Path):
    lengths = [10, 3, 17, 5]
    windows = TokenWindows(identity_files(tmp_path, lengths), seq_len=4, instances="plus_one")
    # (length - 1) // seq_len windows per file: 2, 0, 4, 1.
    assert len(windows) == 7
    assert windows.n_tokens == sum(lengths)
    targets_by_file: dict[int, list[int]] = {}
    for i in range(len(windows)):
        window = windows.window(i)
        assert window.dtype == np.int32 and window.shape == (5,)
        file_id, offsets = np.divmod(window, 1000)
        assert len(set(file_id)) == 1  # never crosses a file boundary
        np.testing.assert_array_equal(np.diff(offsets), 1)
        assert offsets[0] % 4 == 0  # stride seq_len
        targets_by_file.setdefault(int(file_id[0]), []).extend(offsets[1:])
    for file_id, targets in targets_by_file.items():
        n_windows = (lengths[file_id] - 1) // 4
        assert targets == list(range(1, n_windows * 4 + 1))  # each token a target once
    np.testing.assert_array_equal(windows.read([6, 0]), [windows.window(6), windows.window(0)])
    with pytest.raises(IndexError):
        windows.window(7)


def test_olmo_core_instances_are_seq_len_tokens_with_an_unlabelled_end(tmp_path: Path):
    lengths = [8, 3, 17, 4]  # exactly 2 and 1 instances of 4 in files 0 and 3 (OLMo-core: k, not k - 1)
    windows = TokenWindows(identity_files(tmp_path, lengths), seq_len=4)
    assert windows.instances == "olmo_core" and len(windows) == 2 + 0 + 4 + 1
    tokens_by_file: dict[int, list[int]] = {}
    for i in range(len(windows)):
        window = windows.window(i)
        assert window.dtype == np.int32 and window.shape == (5,) and window[-1] == labels.NO_LABEL
        file_id, offsets = np.divmod(window[:-1], 1000)
        assert len(set(file_id)) == 1 and offsets[0] % 4 == 0
        tokens_by_file.setdefault(int(file_id[0]), []).extend(offsets)
    for file_id, tokens in tokens_by_file.items():  # every token of whole instances, once
        assert tokens == list(range(lengths[file_id] // 4 * 4))
    with pytest.raises(DataError, match="data.instances='shifted'"):
        TokenWindows(identity_files(tmp_path, lengths), seq_len=4, instances="shifted")


def test_repetition_filter_marks_the_instance_row(tmp_path: Path):
    path = tmp_path / "rep.npy"
    repetitive = np.tile([7, 8], 16)  # period 2, 16 times in 32 tokens
    write_token_file(path, np.concatenate([np.arange(32), repetitive]), "uint16")
    files = [TokenFile(path, "uint16", VOCAB)]
    kept = TokenWindows(files, 32)
    assert [w[-1] for w in kept.read([0, 1])] == [labels.NO_LABEL, labels.NO_LABEL]
    filtered = TokenWindows(files, 32, repetition_filter=RepetitionFilter(max_count=16))
    assert [w[-1] for w in filtered.read([0, 1])] == [labels.NO_LABEL, labels.FILTERED]
    np.testing.assert_array_equal(filtered.window(1)[:-1], repetitive)  # inputs untouched
    lenient = TokenWindows(files, 32, repetition_filter=RepetitionFilter(max_count=17))
    assert lenient.window(1)[-1] == labels.NO_LABEL
    with pytest.raises(DataError, match="only data.instances='olmo_core'"):
        TokenWindows(files, 32, "plus_one", RepetitionFilter())


def test_split_windows_is_disjoint_deterministic_and_sized():
    train_ids, eval_ids = split_windows(1000, 0.05, seed=3)
    assert len(eval_ids) == 50 and len(train_ids) == 950
    assert not set(train_ids) & set(eval_ids)
    np.testing.assert_array_equal(np.sort(np.concatenate([train_ids, eval_ids])), np.arange(1000))
    np.testing.assert_array_equal(split_windows(1000, 0.05, seed=3)[1], eval_ids)
    assert not np.array_equal(split_windows(1000, 0.05, seed=4)[1], eval_ids)
    assert len(split_windows(1000, 0.0001, seed=3)[1]) == 1  # at least one
    assert len(split_windows(1000, 0.01, seed=3, min_eval_windows=32)[1]) == 32
    assert len(split_windows(1000, 0.0, seed=3)[1]) == 0
    with pytest.raises(DataError, match="eval_fraction"):
        split_windows(1000, 1.0, seed=3)
    with pytest.raises(DataError, match="leaves none to train on"):
        split_windows(10, 0.5, seed=3, min_eval_windows=10)


def test_shuffle_is_seeded_per_epoch_and_covers_each_window_once(windows: TokenWindows):
    n = len(windows)  # 10 + 0 + 19 + 4 = 33 windows
    loader = BatchLoader(windows, np.arange(n), global_batch_size=11, seed=7)
    assert loader.steps_per_epoch == 3
    epoch0 = [w for step in range(3) for w in window_ids_of(windows, loader.batch(step))]
    epoch1 = [w for step in range(3, 6) for w in window_ids_of(windows, loader.batch(step))]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1  # a new permutation each epoch
    assert epoch0 != list(range(n))
    same_seed = BatchLoader(windows, np.arange(n), global_batch_size=11, seed=7)
    other_seed = BatchLoader(windows, np.arange(n), global_batch_size=11, seed=8)
    np.testing.assert_array_equal(same_seed.batch(4), loader.batch(4))
    assert not np.array_equal(other_seed.batch(0), loader.batch(0))


def test_batches_wrap_across_epochs_without_dropping(windows: TokenWindows):
    ids = np.arange(0, 30, 3)  # a split of 10 windows
    loader = BatchLoader(windows, ids, global_batch_size=4, seed=0)
    stream = [w for step in range(5) for w in window_ids_of(windows, loader.batch(step))]
    assert sorted(stream[:10]) == sorted(stream[10:]) == list(ids)  # two whole epochs
    assert [loader.epoch_at(step) for step in range(5)] == [0, 0, 0, 1, 1]


def test_batch_depends_only_on_step(windows: TokenWindows):
    loader = BatchLoader(windows, np.arange(len(windows)), global_batch_size=8, seed=1)
    in_order = [loader.batch(step) for step in range(12)]
    shuffled_steps = np.random.default_rng(0).permutation(12)
    fresh = BatchLoader(windows, np.arange(len(windows)), global_batch_size=8, seed=1)
    out_of_order = {int(step): fresh.batch(int(step)) for step in shuffled_steps}
    for step in range(12):
        np.testing.assert_array_equal(out_of_order[step], in_order[step])
        np.testing.assert_array_equal(loader.batch(step), in_order[step])  # repeat calls


def test_row_slices_concatenate_to_the_global_batch(windows: TokenWindows):
    loader = BatchLoader(windows, np.arange(len(windows)), global_batch_size=8, seed=2)
    for step in (0, 4, 9):  # step 4 spans epochs 0 and 1 (33 windows)
        full = loader.batch(step)
        assert full.shape == (8, 5) and full.dtype == np.int32
        for n_processes in (2, 4, 8):
            rows = 8 // n_processes
            shards = [
                loader.batch(step, slice(p * rows, (p + 1) * rows)) for p in range(n_processes)
            ]
            np.testing.assert_array_equal(np.concatenate(shards), full)
        np.testing.assert_array_equal(loader.batch(step, slice(1, 8, 3)), full[1:8:3])


def test_iterate_and_state_dict_round_trip(windows: TokenWindows):
    ids = np.arange(len(windows))
    loader = BatchLoader(windows, ids, global_batch_size=4, seed=5)
    for step, batch in loader.iterate():
        np.testing.assert_array_equal(batch, loader.batch(step))
        if step == 2:
            break
    state = loader.state_dict()
    assert state == {"step": 3, "seed": 5, "n_windows": 33, "seq_len": 4, "global_batch_size": 4,
                     "instances": windows.instances, "repetition_filter": "off", "mixture": "none"}
    resumed = BatchLoader(windows, ids, global_batch_size=4, seed=5)
    resumed.load_state_dict(state)
    step, batch = next(resumed.iterate())
    assert step == 3 and resumed.step == 4
    np.testing.assert_array_equal(batch, loader.batch(3))
    step, _ = next(loader.iterate(start_step=10, rows=slice(0, 2)))
    assert step == 10 and loader.step == 11


def test_load_state_dict_rejects_changed_data(windows: TokenWindows):
    state = BatchLoader(windows, np.arange(33), global_batch_size=4, seed=5).state_dict()
    fewer_windows = BatchLoader(windows, np.arange(30), global_batch_size=4, seed=5)
    with pytest.raises(DataError, match="n_windows 33 -> 30"):
        fewer_windows.load_state_dict(state)
    other_seed = BatchLoader(windows, np.arange(33), global_batch_size=4, seed=6)
    with pytest.raises(DataError, match="seed 5 -> 6"):
        other_seed.load_state_dict(state)


def test_load_state_dict_rejects_another_instance_layout_or_filter(tmp_path: Path):
    """The instance layout and the repetition filter decide which tokens a step's rows
    hold, so a resume under other ones is refused; a state saved before they were
    recorded means the plus_one windows without a filter."""
    files = identity_files(tmp_path, [64, 64])
    core = TokenWindows(files, 4)
    state = BatchLoader(core, np.arange(len(core)), global_batch_size=4, seed=0).state_dict()
    assert state["instances"] == "olmo_core" and state["repetition_filter"] == "off"
    filtered = TokenWindows(files, 4, repetition_filter=RepetitionFilter())
    loader = BatchLoader(filtered, np.arange(len(filtered)), global_batch_size=4, seed=0)
    with pytest.raises(DataError, match="repetition_filter off -> 13/1/32"):
        loader.load_state_dict(state)
    old = {k: v for k, v in state.items() if k not in ("instances", "repetition_filter")}
    with pytest.raises(DataError, match="instances plus_one -> olmo_core"):
        BatchLoader(core, np.arange(len(core)), global_batch_size=4, seed=0).load_state_dict(old)
    plus_one = TokenWindows(files, 4, instances="plus_one")
    resumed = BatchLoader(plus_one, np.arange(len(plus_one)), global_batch_size=4, seed=0)
    resumed.load_state_dict({**old, "n_windows": len(plus_one)})


def test_too_few_windows_for_a_batch(windows: TokenWindows):
    with pytest.raises(DataError) as error:
        BatchLoader(windows, np.arange(33), global_batch_size=64, seed=0)
    message = str(error.value)
    assert "33 windows" in message and "seq_len 4" in message and "64" in message


def token_files(tmp_path: Path, n_files: int = 3, n_tokens: int = 5000) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for k in range(n_files):
        path = tmp_path / f"doc-{k}.npy"
        write_token_file(path, rng.integers(0, 257, n_tokens), "uint16")
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("config_kind", ["dict", "config_dict", "namespace"])
def test_build_data_from_token_files(tmp_path: Path, config_kind: str):
    fields = {"paths": token_files(tmp_path), "tokenizer": "", "vocab_size": 0, "dtype": ""}
    config = {
        "dict": lambda: fields,
        "config_dict": lambda: ml_collections.ConfigDict(fields),
        "namespace": lambda: SimpleNamespace(**fields),
    }[config_kind]()
    data = build_data(config, seq_len=64, global_batch_size=8, seed=0, cache_dir=tmp_path)
    assert isinstance(data.tokenizer, ByteTokenizer) and data.vocab_size == 384
    assert len(data.windows) == 3 * (5000 // 64)
    assert data.eval is None  # no default split unless data.eval_fraction asks for one
    assert data.train.n_windows == len(data.windows)
    assert data.train.batch(0).shape == (8, 65)
    assert (data.train.batch(0)[:, -1] == labels.NO_LABEL).all()
    held_out = build_data({**fields, "eval_fraction": 0.01}, 64, 8, seed=0, cache_dir=tmp_path)
    # eval_fraction 0.01 of 234 windows rounds to 2: at least one batch is held out.
    assert held_out.eval.n_windows == 8 and held_out.train.n_windows == len(data.windows) - 8
    assert not set(held_out.train.window_ids) & set(held_out.eval.window_ids)
    np.testing.assert_array_equal(data.train.batch(3), data.train.batch(3))


def test_build_data_options(tmp_path: Path):
    paths = token_files(tmp_path)
    no_eval = build_data({"paths": paths, "eval_fraction": 0.0}, 64, 8, seed=1)
    assert no_eval.eval is None and no_eval.train.n_windows == len(no_eval.windows)
    big_vocab = build_data({"paths": paths, "vocab_size": 512, "eval_fraction": 0.1}, 64, 8, 1)
    assert big_vocab.vocab_size == 512 and big_vocab.eval.n_windows == 23
    # Same hold-out and eval batches for every training seed.
    other_seed = build_data({"paths": paths, "vocab_size": 512, "eval_fraction": 0.1}, 64, 8, 2)
    np.testing.assert_array_equal(other_seed.eval.batch(0), big_vocab.eval.batch(0))
    assert not np.array_equal(other_seed.train.batch(0), big_vocab.train.batch(0))


def test_build_data_errors(tmp_path: Path, hf_tokenizer_json: Path):
    paths = token_files(tmp_path)
    missing = str(tmp_path / "not-there.npy")
    with pytest.raises(DataError) as error:
        build_data({"paths": [*paths, missing]}, 64, 8)
    message = str(error.value)
    assert "data.paths[3]" in message and missing in message
    assert "python -m olmo_jax.tokenize" in message
    with pytest.raises(DataError, match="3 windows of seq_len 4096.*lower seq_len"):
        build_data({"paths": paths}, 4096, 8)
    with pytest.raises(DataError, match="data.vocab_size=100 is smaller"):
        build_data({"paths": paths, "vocab_size": 100}, 64, 8)
    too_big = tmp_path / "too_big.npy"
    write_token_file(too_big, [1, 2, 400], "uint16")
    with pytest.raises(DataError, match="token 400 at offset 2 is >= vocab_size 384"):
        build_data({"paths": [*paths, str(too_big)]}, 64, 8)
    with pytest.raises(
        DataError, match="byte-tokenized embedded corpus is used, but data.tokenizer="
    ):
        build_data({"paths": [], "tokenizer": str(hf_tokenizer_json)}, 64, 8)
    odd = tmp_path / "odd.npy"
    write_token_file(odd, np.arange(5), "uint16")
    with pytest.raises(DataError, match="not a whole number of uint32"):
        build_data({"paths": [str(odd)], "dtype": "uint32"}, 64, 8)
    with pytest.raises(DataError, match="data.eval_fraction=0.98.*5 remain for training"):
        build_data({"paths": paths, "eval_fraction": 0.98}, 64, 8)


def test_repetition_filter_settings_are_checked(tmp_path: Path):
    paths = token_files(tmp_path)
    bad = {"paths": paths, "repetition_filter": True, "repetition_min_period": 5,
           "repetition_max_period": 3}
    with pytest.raises(DataError, match="data.repetition_min_period=5.*need 1 <= min_period"):
        build_data(bad, 64, 8)
    from olmo_jax.config import default_config, validate
    from olmo_jax.errors import ConfigError

    cfg = default_config()
    cfg.data.repetition_filter, cfg.data.repetition_max_count = True, 2
    with pytest.raises(ConfigError, match="data.repetition_max_count=2.*max_count >= 3"):
        validate(cfg)
