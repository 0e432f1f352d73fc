"""The decoder: logical axis names on every parameter, dense-first and shared-expert
options, scan over layers (compile time flat in depth), remat options equal numerics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from olmo_jax.errors import ConfigError
from olmo_jax.model import MoEConfig, Transformer, TransformerConfig
from olmo_jax.model.mlp import swiglu

KNOWN_AXES = {"layers", "embed", "mlp", "expert", "router_expert", "vocab", "q_heads",
              "kv_heads", "head_dim"}


def small_cfg(**kw):
    moe = kw.pop("moe", MoEConfig(num_experts=4, top_k=2, expert_hidden=32))
    base = dict(vocab_size=128, d_model=32, n_layers=3, n_heads=4)
    return TransformerConfig(**{**base, **kw}, moe=moe)


def test_every_parameter_has_logical_axis_names():
    model = Transformer(small_cfg(n_dense_layers=1, tie_embeddings=False), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    for path, var in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]:
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var.ndim, path
        assert set(names) <= KNOWN_AXES, (path, names)
    stacked = model.moe_blocks.ffn.experts.w_gate
    assert stacked.get_metadata()["out_sharding"] == ("layers", "expert", "embed", "mlp")


def test_dense_first_layers_and_shared_experts_shapes():
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=2, shared_hidden=8)
    cfg = small_cfg(n_dense_layers=1, dense_hidden=40, moe=moe)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    assert model.dense_blocks.ffn.w_gate.shape == (1, 32, 40)
    assert model.moe_blocks.ffn.experts.w_gate.shape == (2, 4, 32, 32)
    assert model.moe_blocks.ffn.shared.w_gate.shape == (2, 32, 16)
    out = model(jnp.zeros((2, 8), jnp.int32))
    assert out.logits_BTV.shape == (2, 8, 128)
    assert out.router_stats.counts_E.shape == (2, 4)


def test_shared_experts_are_a_sum_of_swiglus():
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, n_shared_experts=2, shared_hidden=8)
    model = Transformer(small_cfg(n_layers=1, moe=moe), rngs=nnx.Rngs(0))
    shared = model.moe_blocks.ffn.shared
    g, u, d = (w[0] for w in (shared.w_gate, shared.w_up, shared.w_down))
    x = jax.random.normal(jax.random.key(0), (5, 32))
    two = swiglu(x, g[:, :8], u[:, :8], d[:8]) + swiglu(x, g[:, 8:], u[:, 8:], d[8:])
    np.testing.assert_allclose(swiglu(x, g, u, d), two, atol=1e-6)


def test_tied_embeddings_have_no_head():
    model = Transformer(small_cfg(tie_embeddings=True), rngs=nnx.Rngs(0))
    assert model.lm_head is None
    x = jnp.ones((1, 4), jnp.int32)
    h, _ = model.blocks(model.embed(x))
    ref = jnp.einsum("btd,vd->btv", model.final_norm(h), model.embedding[...])
    np.testing.assert_allclose(model(x).logits_BTV, ref, atol=1e-5)


@pytest.mark.parametrize("remat", ["block", "attention", "mlp", "dots"])
def test_remat_gives_equal_loss_and_grads(remat):
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)

    def loss_and_grads(cfg):
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)

        def loss(p):
            return jnp.mean(nnx.merge(graphdef, p)(tokens).logits_BTV ** 2)

        return jax.jit(jax.value_and_grad(loss))(params)

    base, g_base = loss_and_grads(small_cfg(n_dense_layers=1))
    other, g_other = loss_and_grads(small_cfg(n_dense_layers=1, remat=remat))
    np.testing.assert_allclose(other, base, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_other, g_base)


def _compiled_instructions(n_layers) -> int:
    """Instructions in the optimized HLO of the model's gradient at `n_layers` blocks."""
    cfg = small_cfg(n_layers=n_layers)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)

    def loss(p, tokens):
        return jnp.mean(nnx.merge(graphdef, p)(tokens).logits_BTV)

    text = jax.jit(jax.grad(loss)).lower(params, jnp.zeros((2, 16), jnp.int32)).compile().as_text()
    return sum(1 for line in text.splitlines() if " = " in line)


def test_compiled_program_does_not_grow_with_depth():
    """The blocks run under one lax.scan: 8 blocks compile to the program of 2 (the stacked
    weights' leading dimension aside; unrolled it would be ~4x), so compile time is flat in
    depth."""
    n2, n8 = _compiled_instructions(2), _compiled_instructions(8)
    assert abs(n8 - n2) <= 0.01 * n2, f"HLO instructions: 2 layers {n2}, 8 layers {n8}"


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(d_model=30, n_heads=4), "model.d_model"),
        (dict(n_heads=4, n_kv_heads=3), "model.n_kv_heads"),
        (dict(moe=MoEConfig(num_experts=4, top_k=5)), "model.moe.top_k"),
        (dict(n_dense_layers=9), "model.n_dense_layers"),
        (dict(dtype="float64"), "model.dtype"),
    ],
)
def test_bad_model_configs_name_the_field(kw, field):
    base = dict(vocab_size=128, d_model=32, n_layers=3, n_heads=4)
    base.update(kw)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        TransformerConfig(**base).validate()


def test_named_remat_policies_cut_the_compiled_temporaries():
    """model.remat = mlp (the feed-forward sub-layer recomputed) and dots (the block, keeping
    the weight GEMMs' outputs) hold fewer temporaries than none in the compiled gradient
    (tools/experiments/step_temporaries.py measures them at a larger shape)."""
    tokens = jnp.zeros((2, 256), jnp.int32)
    temps = {}
    for remat in ("none", "mlp", "dots"):
        cfg = small_cfg(n_layers=2, n_dense_layers=2, dense_hidden=128, remat=remat,
                        attention_impl="xla")  # dense blocks: a quick compile
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)

        def loss(p, tokens, graphdef=graphdef):
            return jnp.mean(nnx.merge(graphdef, p)(tokens).logits_BTV ** 2)

        compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
    print({k: f"{v / 2**20:.2f} MiB" for k, v in temps.items()})
    assert max(temps["mlp"], temps["dots"]) < temps["none"]
