"""The checkpoint fields of the run config (trainer.save_every, keep_last, keep_every,
resume, init_from, hard_stop): defaults and validation errors that name the field."""

import pytest

from olmo_jax.config import default_config, validate
from olmo_jax.errors import ConfigError


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


def test_a_saved_model_config_without_the_layout_fields_reads_as_the_pre_norm_model():
    """Checkpoints written before model.block_norm, head_qk_norm, embed_scale, embedding_norm
    and lm_z_loss_coef existed hold pre-norm models without those norms; reading one must not
    give it today's defaults (OLMo-core's layout), whose parameters differ."""
    import dataclasses

    from olmo_jax.checkpoint.manager import model_config_from_dict, model_config_to_dict
    from olmo_jax.model.config import ABSENT_FIELD_MEANING, TransformerConfig

    today = TransformerConfig(d_model=32, n_heads=4)
    assert model_config_from_dict(model_config_to_dict(today)) == today  # present fields win
    old = {k: v for k, v in model_config_to_dict(today).items() if k not in ABSENT_FIELD_MEANING}
    read = model_config_from_dict(old)
    assert (read.block_norm, read.head_qk_norm, read.embedding_scale, read.embedding_norm,
            read.lm_z_loss_coef) == ("pre", False, 0.0, False, 0.0)
    assert dataclasses.replace(read, **{k: getattr(today, k) for k in ABSENT_FIELD_MEANING}) == today


def test_the_kernel_choices_are_free_and_a_config_saved_without_them_reads_as_auto():
    """model.attention_impl, norm_impl, mxfp8_gemm_impl and moe.gmm_impl choose kernels,
    not what the weights mean: a checkpoint resumes with other values, and one saved
    before norm_impl and mxfp8_gemm_impl existed reads them as auto."""
    import dataclasses

    from olmo_jax.checkpoint.manager import model_config_from_dict, model_config_to_dict
    from olmo_jax.model.config import TransformerConfig
    from olmo_jax.trainer.checkpoints import architecture_difference
    from olmo_jax.trainer.run_dir import _is_free

    today = TransformerConfig(d_model=32, n_heads=4)
    new = ("norm_impl", "mxfp8_gemm_impl")
    old = {k: v for k, v in model_config_to_dict(today).items() if k not in new}
    read = model_config_from_dict(old)
    assert (read.norm_impl, read.mxfp8_gemm_impl) == ("auto", "auto") and read == today
    run = today.replace(attention_impl="xla", norm_impl="xla", mxfp8_gemm_impl="dequantize",
                        moe=dataclasses.replace(today.moe, gmm_impl="einsum"))
    assert architecture_difference(read, run) is None
    assert architecture_difference(read, today.replace(n_heads=2)) == ("model.n_heads", 4, 2)
    assert all(_is_free(f"model.{name}") for name in ("attention_impl", *new, "moe.gmm_impl"))


def test_a_checkpoint_is_continued_with_a_new_rope_scaling():
    """Long-context extension starts from a trained checkpoint with a RoPE scaling (the
    rope_scaling* fields are free, as the kernel choices are); rope_theta stays the
    architecture's."""
    from olmo_jax.model.config import TransformerConfig
    from olmo_jax.trainer.checkpoints import architecture_difference
    from olmo_jax.trainer.run_dir import _is_free

    saved = TransformerConfig(d_model=32, n_heads=4)
    longer = saved.replace(rope_scaling="yarn", rope_scaling_factor=8.0, rope_old_context_len=4096,
                           rope_attention_factor=1.5, rope_scaling_layers="all",
                           lm_loss_chunk=1024, remat="dots")
    assert architecture_difference(saved, longer) is None
    assert architecture_difference(saved, saved.replace(rope_theta=1e4)) == (
        "model.rope_theta", 500_000.0, 1e4)
    assert _is_free("model.rope_scaling") and not _is_free("model.rope_theta")

