"""The checkpoint fields of the run config (trainer.save_every, keep_last, keep_every,
resume, init_from, hard_stop): defaults and validation errors that name the field."""

import pytest

from olmo_jax.config import default_config, validate
from olmo_jax.model.config import ConfigError


def test_defaults():
    t = default_config().trainer
    assert (t.save_every, t.keep_last, t.keep_every, t.resume, t.init_from, t.hard_stop) == (
        100,
        3,
        0,
        True,
        "",
        0,
    )


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("save_every", -1, "trainer.save_every must be >= 0"),
        ("keep_last", -2, "trainer.keep_last must be >= 0"),
        ("keep_every", -5, "trainer.keep_every must be >= 0"),
        ("hard_stop", -1, "trainer.hard_stop must be >= 0"),
        ("hard_stop", 100, "trainer.hard_stop=100 must be below trainer.max_steps=100"),
    ],
)
def test_bad_values_name_the_field(field, value, message):
    cfg = default_config()
    cfg.trainer[field] = value
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
