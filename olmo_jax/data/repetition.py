"""OLMo-core's instance repetition filter: an instance is dropped from the loss when some
token pattern of period in [min_period, max_period] repeats `max_count` times or more in a
row (`InstanceFilterConfig` in olmo_core.data.numpy_dataset; defaults 13 / 1 / 32).

`periodic_runs` is the same detector as OLMo-core's `find_periodic_sequences`: for each
period p the instance is cut into rows of p tokens (the tail padded with -1); a run of
rows each equal to the row before it is a periodic stretch, extended by the matching
suffix of the row before the run and the matching prefix of the row after it. Stretches
that repeat fewer than 3 times are not reported (the detector cannot tell their period).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

PAD = -1  # the pad value: never a token id


class PeriodicRun(NamedTuple):
    start: int  # first token of the stretch
    end: int  # one past its last token
    period: int
    times: int  # whole repetitions of the period in [start, end)


@dataclass(frozen=True)
class RepetitionFilter:
    """OLMo-core's `InstanceFilterConfig` (its defaults)."""

    max_period: int = 13
    min_period: int = 1
    max_count: int = 32

    def problem(self) -> str | None:
        """What is wrong with these settings (None: nothing), as data.* field names."""
        if 1 <= self.min_period <= self.max_period and self.max_count >= 3:
            return None
        return (f"data.repetition_min_period={self.min_period}, data.repetition_max_period="
                f"{self.max_period}, data.repetition_max_count={self.max_count}: need "
                "1 <= min_period <= max_period and max_count >= 3 (a stretch is detected from "
                "3 repeats on)")

    def keeps(self, tokens_T: np.ndarray) -> bool:
        """False when `tokens_T` holds a stretch repeated `max_count` times or more."""
        return all(run.times < self.max_count
                   for run in periodic_runs(tokens_T, self.max_period, self.min_period))


def _leading_true(row: np.ndarray) -> int:
    """How many entries at the start of `row` are True."""
    false_at = np.flatnonzero(~row)
    return len(row) if len(false_at) == 0 else int(false_at[0])


def periodic_runs(tokens_T: np.ndarray, max_period: int, min_period: int = 1):
    """The periodic stretches of `tokens_T` (int, no negative ids), period by period."""
    tokens_T = np.asarray(tokens_T, dtype=np.int64)
    if (tokens_T == PAD).any():
        raise ValueError(f"token ids must not be {PAD}")
    for period in range(min_period, min(max_period, len(tokens_T) // 3) + 1):
        pad = period - len(tokens_T) % period  # always >= 1: the last row never matches
        rows_RP = np.pad(tokens_T, (0, pad), constant_values=PAD).reshape(-1, period)
        same_RP = rows_RP == np.roll(rows_RP, 1, axis=0)  # equal to the row before
        repeated_R = np.flatnonzero(same_RP.all(axis=1))
        if len(repeated_R) == 0:
            continue
        for run_R in np.split(repeated_R, np.flatnonzero(np.diff(repeated_R) != 1) + 1):
            first, last = int(run_R[0]), int(run_R[-1])
            # The row before the run: its matching suffix belongs to the stretch. (OLMo-core
            # counts the suffix from the row's last False; a row ending in False adds none.)
            before_P = same_RP[first - 1]
            suffix = 0 if not before_P[-1] else _leading_true(before_P[::-1])
            start = (first - 1) * period - suffix
            end = (last + 1) * period + _leading_true(same_RP[last + 1])
            run = PeriodicRun(start, end, period, (end - start) // period)
            if run.times > 2:
                yield run
