"""Learning-rate schedules: warmup, cosine floor, WSD plateau and decay."""

import numpy as np
import pytest

from olmo_jax.optim import lr_schedule


def test_cosine_warmup_and_floor():
    s = lr_schedule("cosine", 1.0, 100, 10, min_lr_ratio=0.1)
    assert s(0) == pytest.approx(0.1)
    assert s(10) == pytest.approx(1.0)
    assert s(55) == pytest.approx(0.55, abs=1e-6)  # halfway through the cosine
    assert s(100) == pytest.approx(0.1)


def test_wsd_is_flat_then_decays_linearly():
    s = lr_schedule("wsd", 2.0, 110, 10, min_lr_ratio=0.0, decay_fraction=0.2)
    assert [float(s(i)) for i in (10, 50, 89)] == [2.0, 2.0, 2.0]
    assert float(s(100)) == pytest.approx(1.0)
    assert float(s(110)) == pytest.approx(0.0)
    assert np.all(np.diff([float(s(i)) for i in range(90, 111)]) <= 0)
