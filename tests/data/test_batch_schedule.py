"""trainer.batch_size_schedule without compiling anything: the event-jumping schedule
(olmo_jax/data/batch_schedule.py) equals OLMo-core's callback rules replayed one batch at
a time, including increases that wait for alignment and events skipped while one waits;
the loader reads consecutive stream slices of those sizes and refuses a checkpoint of
another schedule; the learning-rate table is OLMo-core's formula with the rescaled initial
lr and the moving t_max; bad specs name the field. (OLMo-core's own callback and loader:
tests/olmo_core/test_batch_size_schedule.py.)"""

import math

import numpy as np
import pytest

from olmo_jax import config as config_lib
from olmo_jax.data import TokenFile, TokenWindows, write_token_file
from olmo_jax.data.batch_schedule import BatchSizeSchedule
from olmo_jax.data.loader import BatchLoader
from olmo_jax.errors import ConfigError, DataError
from olmo_jax.optim import schedulers

SEQ = 4


def replay(events, reference, steps):
    """OLMo-core's BatchSizeSchedulerCallback._maybe_update_batch_size_and_lr and the
    loader's batches_processed, one batch at a time: [(size, first position)] per step."""
    current, processed, tokens, out = reference * SEQ, 0, 0, []
    for _ in range(steps):
        for size, start in reversed(events):
            if tokens >= start:
                if size > current and processed % (size // current) == 0:
                    processed //= size // current
                    current = size
                elif size < current:
                    processed *= current // size
                    current = size
                break
        out.append((current // SEQ, processed * current // SEQ))
        processed += 1
        tokens += current
    return out


CASES = [
    ([(8, 0), (16, 24), (32, 100)], 2),  # warmup from a reference below the first size
    ([(8, 0), (32, 20), (64, 60)], 8),  # 32 waits for alignment at position 4, 12, ...
    ([(16, 0), (32, 12), (128, 40)], 4),  # 32 is still waiting when 128 is due
    ([(32, 0), (8, 50), (16, 90), (4, 200)], 4),  # decreases apply at once
    ([(8, 0)], 8),  # one size, the reference
]


@pytest.mark.parametrize("events,reference", CASES)
def test_segments_equal_olmo_cores_rules_replayed_step_by_step(events, reference):
    spec = ",".join(f"{s}@{t}" for s, t in events)
    schedule = BatchSizeSchedule.from_spec(spec, SEQ, reference)
    want = replay(events, reference, 120)
    assert [schedule.size(k) for k in range(120)] == [w[0] for w in want]
    np.testing.assert_array_equal(schedule.position(np.arange(120)), [w[1] for w in want])
    assert schedule.step_sizes(120).tolist() == [w[0] for w in want]
    for tokens in range(1, 600, 7):  # a token budget ends at the first step reaching it
        seen = np.cumsum([w[0] * SEQ for w in want])
        assert schedule.steps_for_tokens(tokens) == int(np.argmax(seen >= tokens)) + 1
    # OLMo-core's initial lr: x sqrt(new / old) at each change, in order, float64
    lr, current, lrs = 1e-3, reference * SEQ, []
    for size, _ in want:
        if size * SEQ != current:
            lr *= math.sqrt(size * SEQ / current)
            current = size * SEQ
        lrs.append(lr)
    assert schedule.initial_lrs(1e-3, 120).tolist() == lrs  # bitwise


def test_an_increase_waits_and_a_skipped_event_does_not_apply():
    s = BatchSizeSchedule.from_spec("64@0,128@48,512@160", SEQ, 16)
    sizes = s.step_sizes(12).tolist()
    # 128 tokens due at step 1 but position 16 is no multiple of 32: it waits one step
    assert sizes[:4] == [16, 16, 32, 32], sizes
    assert 128 in s.sizes and list(s.sizes) == [16, 32, 128]


def _loader(tmp_path, schedule, reference=4):
    path = tmp_path / "t.npy"
    write_token_file(path, np.arange(SEQ * 200) % 250, np.uint8)
    windows = TokenWindows([TokenFile(path, np.uint8, 256)], SEQ)
    return BatchLoader(windows, np.arange(len(windows)), reference, seed=3,
                       schedule=BatchSizeSchedule.from_spec(schedule, SEQ, reference) if schedule else None)


def test_the_loader_reads_consecutive_slices_and_checks_the_schedule_on_resume(tmp_path):
    spec = "8@0,32@40,64@300"
    loader, plain = _loader(tmp_path, spec), _loader(tmp_path, "")
    flat = np.concatenate([plain.batch(k) for k in range(60)])  # the stream, 4 at a time
    stream = loader.stream(prefetch=2)
    read = [next(stream) for _ in range(17)]  # 8 x 2 windows, 8 x 8 (waiting for 8), 16
    stream.close()
    assert [len(b) for _, b in read] == [loader.size(k) for k in range(17)]
    assert sorted({len(b) for _, b in read}) == [2, 8, 16]
    np.testing.assert_array_equal(np.concatenate([b for _, b in read]), flat[:sum(len(b) for _, b in read)])
    rows = {size: np.arange(size)[1::2] for size in loader.sizes}  # another process's rows
    saved = loader.state_dict()
    part = loader.stream(rows)
    step, batch = next(part)
    part.close()
    assert step == 17 and len(batch) == 8
    np.testing.assert_array_equal(batch, loader.batch(17)[1::2])
    assert saved["batch_size_schedule"] == spec and saved["step"] == 17
    _loader(tmp_path, spec).load_state_dict(saved)
    with pytest.raises(DataError, match="trainer.batch_size_schedule='8@0,32@40,64@300'"):
        _loader(tmp_path, "8@0,32@40").load_state_dict(saved)
    with pytest.raises(DataError, match="batch_size_schedule="):  # a checkpoint without one
        plain.load_state_dict(saved)
    with pytest.raises(DataError, match="batch_size_schedule=''"):  # saved before the field
        loader.load_state_dict({k: v for k, v in saved.items() if k != "batch_size_schedule"})


def test_the_lr_table_rescales_and_moves_t_max_as_olmo_core_does():
    s = BatchSizeSchedule.from_spec("8@0,16@24,32@80", SEQ, 4)
    n = 10
    tokens_S = s.step_sizes(n) * SEQ
    batches = schedulers.StepBatches(tokens_S, lambda lr: s.initial_lrs(lr, n))
    seen = np.cumsum(tokens_S)
    cos = schedulers.parse("cos_with_warmup(warmup=8, alpha_f=0.1, units='tokens')")
    # a run of n steps: OLMo-core's max_tokens is tokens seen + (n - k) x the current batch
    got = schedulers.lr_table(cos, 1e-2, n, 0, 0, batches)
    want = [cos.get_lr(float(s.initial_lrs(1e-2, n)[k]), int(seen[k]),
                       int(seen[k]) + (n - k - 1) * int(tokens_S[k])) for k in range(n)]
    assert got.tolist() == want
    # a run of max_tokens M: steps units see max_steps k + ceil((M - T_k) / B_k)
    wsd = schedulers.parse("wsd(warmup=2, decay=3, decay_fraction=None)")
    got = schedulers.lr_table(wsd, 1e-2, n, 0, int(seen[-1]) - 5, batches)
    want = [wsd.get_lr(float(s.initial_lrs(1e-2, n)[k]), k + 1,
                       k + 1 + math.ceil(max(int(seen[-1]) - 5 - int(seen[k]), 0) / int(tokens_S[k])))
            for k in range(n)]
    assert got.tolist() == want
    constant = schedulers.lr_table(schedulers.parse("constant()"), 1e-2, n, 0, 0, batches)
    assert constant.tolist() == s.initial_lrs(1e-2, n).tolist()
    assert constant[0] == pytest.approx(1e-2 * math.sqrt(0.5)) and constant[-1] == pytest.approx(1e-2 * math.sqrt(2))


def _cfg(**changes):
    cfg = config_lib.default_config()
    cfg.trainer.seq_len, cfg.trainer.global_batch_size = 16, 8
    for k, v in changes.items():
        config_lib.set_path(cfg, k, v)
    return cfg


@pytest.mark.parametrize("changes,message", [
    ({"trainer.batch_size_schedule": "128@0,256"}, "'256' is not TOKENS@START"),
    ({"trainer.batch_size_schedule": "128@10"}, "must start at 0"),
    ({"trainer.batch_size_schedule": "128@0,256@0"}, "must start after the one before"),
    ({"trainer.batch_size_schedule": "128@0,128@50"}, "duplicate batch size"),
    ({"trainer.batch_size_schedule": "100@0"}, "not a positive multiple of trainer.seq_len=16"),
    ({"trainer.batch_size_schedule": "256@0,128@100,384@1e3"}, "not integer multiples"),
    ({"trainer.batch_size_schedule": "128@0,256@1.5e3x"}, "is not a number"),
    ({"trainer.batch_size_schedule": "192@0", "trainer.global_batch_size": 24,
      "trainer.grad_accum": 3}, "no whole number of microbatches of 8"),
    ({"trainer.batch_size_schedule": "128@0", "parallel.pipe": 2}, "not supported with parallel.pipe=2"),
    ({"trainer.batch_size_schedule": "128@0", "optim.name": "muon"}, "optim.name='muon'"),
    ({"trainer.batch_size_schedule": "128@0", "trainer.max_tokens": 10_000, "trainer.max_steps": 0,
      "optim.scheduler": "cos_with_warmup(warmup=2)"}, "units must be 'tokens' unless it sets t_max"),
])
def test_bad_schedules_name_the_field_and_the_fix(changes, message):
    with pytest.raises(ConfigError, match=message):
        config_lib.validate(_cfg(**changes))


def test_durations_follow_the_schedule():
    t = config_lib.validate(_cfg(**{"trainer.batch_size_schedule": "64@0,256@256",
                                    "trainer.max_tokens": 2000, "trainer.max_steps": 0})).trainer
    # 4 x 64 tokens, then 256 a step: 256 + 7 x 256 = 2048 >= 2000 after 11 steps
    assert (t.total_steps, t.binds, t.budget_tokens, t.tokens_before(11)) == (11, "trainer.max_tokens", 2000, 2048)
    assert "duration: 11 steps, 2,048 tokens; trainer.max_tokens=2,000 binds" in t.duration_line()
    assert t.grad_accum_at(16) == 2 and t.grad_accum_at(4) == 1  # microbatches of 8 sequences
    accum = config_lib.validate(_cfg(**{"trainer.grad_accum": 2})).trainer
    assert (accum.grad_accum_at(32), accum.grad_accum_at(4), accum.grad_accum_at(8)) == (8, 1, 2)
    # the steps-unit scheduler with its own t_max (or a constant one) is fine
    config_lib.validate(_cfg(**{"trainer.batch_size_schedule": "128@0", "trainer.max_tokens": 10_000,
                                "trainer.max_steps": 0, "optim.scheduler": "cos_with_warmup(warmup=2, t_max=50)"}))
