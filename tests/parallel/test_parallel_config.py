"""The parallel plan refuses configs that cannot run, naming the field and the fix."""

import pytest

from olmo_jax.config import default_config, model_config, unknown_key_error, upgrade, validate
from olmo_jax.errors import ConfigError
from olmo_jax.model.config import MoEConfig
from olmo_jax.parallel.expert import ROWWISE_CAPACITY_FACTOR
from olmo_jax.parallel.mesh import mesh_shape
from tests.parallel.harness import make_cfg
from tests.sections import plan_for


def _plan(cfg):
    return plan_for(cfg, model_config(cfg))


def test_mesh_fill_and_product_errors():
    assert mesh_shape(1, -1, 4, 8) == (1, 2, 1, 4)
    assert mesh_shape(1, -1, 2, 8, context=2) == (1, 2, 2, 2)
    with pytest.raises(ConfigError, match=r"2 x 2 x 1 x 4 = 16 does not match the 8 available"):
        mesh_shape(2, 2, 4, 8)
    with pytest.raises(ConfigError, match="only one of parallel.pipe/data/expert may be -1"):
        mesh_shape(1, -1, -1, 8)
    with pytest.raises(ConfigError, match=r"parallel.data=-1 cannot fill 8 devices"):
        mesh_shape(1, -1, 3, 8)
    with pytest.raises(ConfigError, match="parallel.expert=0 must be a positive size"):
        mesh_shape(1, 8, 0, 8)


def test_experts_must_divide_over_the_expert_axis():
    cfg = make_cfg(data=2, expert=4)
    cfg.model.moe.num_experts = 6
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=6 is not divisible by "
                                          r"parallel.expert=4"):
        _plan(cfg)


def test_batch_must_divide_over_data_expert_and_microbatches():
    cfg = make_cfg(data=2, expert=4, grad_accum=2)  # batch 8 over 8 devices x 2 microbatches
    with pytest.raises(ConfigError, match=r"trainer.global_batch_size=8 must be divisible by "
                                          r"data x expert x trainer.grad_accum = 2 x 4 x 2 = 16"):
        _plan(cfg)
    plan = _plan(make_cfg(data=2, expert=4))
    with pytest.raises(ConfigError, match="the batch=4 must be divisible"):
        plan.place_batch([[0, 1]] * 4)


def test_other_refusals():
    cfg = make_cfg(data=2, expert=4, dispatch="ragged")
    cfg.model.moe.capacity_factor = 1.0
    with pytest.raises(ConfigError, match="model.moe.capacity_factor=1.0 sizes capacity buffers, "
                                          "but parallel.dispatch=ragged is dropless"):
        _plan(cfg)
    cfg = make_cfg(data=8, expert=1, strategy="zero3")  # the schema's check (build_plan takes it checked)
    with pytest.raises(ConfigError, match="parallel.strategy='zero3': choose one of ddp, fsdp"):
        validate(cfg)
    with pytest.raises(ConfigError, match="lb_granularity='rank': choose global, local or instance"):
        MoEConfig(lb_granularity="rank").validate()


def test_one_capacity_factor_sizes_rowwise_and_local_buffers():
    """model.moe.capacity_factor is the one capacity factor: rowwise's receive slots (0 =
    OLMo-core's 1.25 there), the local capacity buffers; parallel.capacity_factor is gone."""
    assert "capacity_factor" not in default_config().parallel
    cfg = make_cfg(data=2, expert=4, capacity_factor=2.0)
    assert _plan(cfg).dispatcher.__wrapped__.keywords["capacity_factor"] == 2.0
    cfg.model.moe.capacity_factor = 0.0
    assert _plan(cfg).dispatcher.__wrapped__.keywords["capacity_factor"] == ROWWISE_CAPACITY_FACTOR == 1.25
    old = default_config()
    old.parallel.capacity_factor = 1.5  # a config file written for the two-field schema
    with pytest.raises(ConfigError, match=r"'parallel.capacity_factor' was removed: it is "
                                          r"model.moe.capacity_factor now"):
        validate(old)
    with pytest.raises(ConfigError, match="model.moe.capacity_factor now"):
        raise unknown_key_error(default_config(), "parallel.capacity_factor")
    # An older run folder's config.json: the value moves where it sized rowwise dispatch.
    saved = make_cfg(data=2, expert=4).to_dict()
    saved["model"]["moe"]["capacity_factor"], saved["parallel"]["capacity_factor"] = 0.0, 2.0
    assert upgrade(saved)["model"]["moe"]["capacity_factor"] == 2.0
    saved["parallel"]["dispatch"] = "ragged"
    assert upgrade(saved)["model"]["moe"]["capacity_factor"] == 0.0
    assert "capacity_factor" not in upgrade(saved)["parallel"] and "capacity_factor" in saved["parallel"]
    # A run folder from before the layout fields and data.instances: today's defaults
    # (OLMo-core's post-norm layout, its instances) would describe another model and data.
    old = upgrade({"model": {"d_model": 64}, "data": {"paths": ""}})
    assert old["model"]["block_norm"] == "pre" and old["model"]["embedding_norm"] is False
    assert old["model"]["d_model"] == 64 and old["data"]["instances"] == "plus_one"
    assert upgrade({"model": {"block_norm": "peri"}})["model"]["block_norm"] == "peri"


def test_dispatcher_choice():
    assert _plan(make_cfg(data=2, expert=4, dispatch="ragged")).dispatch == "ragged"
    # No expert parallelism (expert=1) or FSDP: every device runs all experts locally.
    assert _plan(make_cfg(data=8, expert=1)).dispatcher is None
    assert _plan(make_cfg(data=2, expert=4, strategy="fsdp")).dispatcher is None
