"""Shape annotations (olmo_jax/shapes.py): on in the tests, off (the function itself) in
production; letters bind once per call across arguments and results; a mis-shaped call
fails naming the function, the argument and the letter; the real model and kernels pass;
every annotation uses letters of the legend (olmo_jax/model/__init__.py)."""

import importlib
import pkgutil
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import olmo_jax.kernels
import olmo_jax.model
from olmo_jax import shapes
from olmo_jax.kernels import grouped_matmul as gm
from olmo_jax.kernels import mxfp8_quant as mx
from olmo_jax.model import MoEConfig, Transformer, TransformerConfig
from olmo_jax.model.attention import Attention, attention_impl
from olmo_jax.model.rope import rope_tables


def small_model(**kw):
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1, shared_hidden=16)
    cfg = TransformerConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            n_dense_layers=1, moe=moe, **kw)
    return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.fixture
def seen(monkeypatch):
    """The names of the checked functions called (each check builds one binding)."""
    names = []
    init = shapes._Binding.__init__

    def record(self, fn_name):
        names.append(fn_name)
        init(self, fn_name)

    monkeypatch.setattr(shapes._Binding, "__init__", record)
    return names


# ----------------------------------------------------------------------------- switch


def test_checks_are_on_in_the_tests():
    assert shapes.ENABLED  # tests/conftest.py sets OLMO_JAX_SHAPE_CHECKS=1
    assert hasattr(Transformer.__call__, "__wrapped__")
    assert hasattr(gm.grouped_matmul, "__wrapped__")


def test_off_the_function_itself():
    def f(x_BT):
        return x_BT

    g = shapes.check("-> B T", enabled=False)(f)
    assert g is f and f.__shapes__ == ("-> B T",)
    assert f(jnp.zeros((2, 3, 4))).shape == (2, 3, 4)  # nothing checked


def test_annotation_typos_fail_at_import():
    with pytest.raises(ValueError, match="names no argument y"):
        shapes.check("y: B")(lambda x_B: x_B)
    with pytest.raises(ValueError, match="not a letter"):
        shapes.check("-> B T%")
    with pytest.raises(ValueError, match="at most one"):
        shapes.check("-> ... B ...")


# ----------------------------------------------------------------------------- the checker


@shapes.check("w: G K N", "-> M N", enabled=True)
def _gmm(x_MK, w, group_sizes_G):
    return jnp.zeros((x_MK.shape[0], w.shape[2]))


def test_letters_bind_across_arguments_and_results():
    x, w, gs = jnp.zeros((8, 4)), jnp.zeros((3, 4, 5)), jnp.zeros((3,), jnp.int32)
    assert _gmm(x, w, gs).shape == (8, 5)
    with pytest.raises(shapes.ShapeError, match=r"_gmm: argument w has shape \(3, 6, 5\): axis 1 "
                                                r"is K=6 in 'G K N', but K=4 from argument x_MK"):
        _gmm(x, jnp.zeros((3, 6, 5)), gs)
    with pytest.raises(shapes.ShapeError, match="argument group_sizes_G .* G=2 .* G=3 from "
                                                "argument w"):
        _gmm(x, w, gs[:2])
    with pytest.raises(shapes.ShapeError, match="argument x_MK has shape .*: 3 axes, 'M K' wants 2"):
        _gmm(x[..., None], w, gs)


def test_results_expressions_ellipsis_fields_and_jit():
    @shapes.check("packed: S D+D/32", "-> S D, _", enabled=True)
    def f(x_SD, packed, n):
        return x_SD if n else x_SD[1:], None

    x = jnp.zeros((4, 64))
    assert jax.jit(f, static_argnums=2)(x, jnp.zeros((4, 66)), 1)[0].shape == (4, 64)
    with pytest.raises(shapes.ShapeError, match=r"'D\+D/32' in 'S D\+D/32' is 66 \(D=64\)"):
        f(x, jnp.zeros((4, 65)), 1)
    with pytest.raises(shapes.ShapeError, match="result 0 has shape .*S=3 .* S=4 from argument x_SD"):
        jax.jit(f, static_argnums=2)(x, jnp.zeros((4, 66)), 0)  # at trace time

    @shapes.check("-> ... D", enabled=True)
    def g(x):
        return x

    assert g(jnp.zeros((2, 3, 5))).shape == (2, 3, 5)
    with pytest.raises(shapes.ShapeError, match="wants at least 1"):
        g(jnp.zeros(()))

    from typing import NamedTuple

    class Out(NamedTuple):
        logits_BTV: jax.Array
        other: object

    @shapes.check("-> *", enabled=True)
    def h(tokens_BT, v):
        return Out(jnp.zeros((*tokens_BT.shape, v)), None)

    assert h(jnp.zeros((2, 3)), 7).logits_BTV.shape == (2, 3, 7)

    @shapes.check("-> *", enabled=True)
    def bad(tokens_BT):
        return Out(jnp.zeros((3, 2, 7)), None)

    with pytest.raises(shapes.ShapeError, match=r"the result.logits_BTV .* B=3 .* B=2 from "
                                                r"argument tokens_BT"):
        bad(jnp.zeros((2, 3)))


def test_names_give_the_axes():
    assert [a.value for a in shapes.dims_of_name("x_BTD").axes] == ["B", "T", "D"]
    assert [a.value for a in shapes.dims_of_name("idx_Sk").axes] == ["S", "k"]
    assert [a.value for a in shapes.dims_of_name("m_BKM1").axes] == ["B", "K", "M", 1]
    assert shapes.dims_of_name("n_rows") is None and shapes.dims_of_name("cfg") is None


# ----------------------------------------------------------------------------- real code


def test_real_model_passes_with_the_checks(seen):
    model = small_model()
    tokens_BT = jax.random.randint(jax.random.key(0), (2, 16), 0, 128)
    # The checks run when a function is traced: tracing the training forward is enough.
    out = nnx.eval_shape(lambda m, t: m(t, rng=jax.random.key(1)), model, tokens_BT)
    assert out.logits_BTV.shape == (2, 16, 128)
    checked = {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in seen}
    # float32 on a CPU: the attention block's element-wise work and core are the FFI
    # kernels' (attention_impl=auto -> blas), elsewhere jnp's RoPE
    blas = attention_impl("auto", jnp.float32) == "blas"
    attention = (("cpu_attention.qk_prep", "cpu_attention.causal_attention") if blas
                 else ("rope.apply_rope",))
    for want in ("Transformer.__call__", "Transformer.embed", "Transformer.blocks",
                 "Transformer.head", "transformer.run_blocks", "Block.__call__",
                 "Attention.__call__", "rope.rope_tables", *attention, "MLP.__call__",
                 "mlp.swiglu"):
        assert want in checked, (want, sorted(checked))


def test_a_mis_shaped_call_into_the_model_names_the_letter():
    model = small_model()
    attn = Attention(model.cfg, rngs=nnx.Rngs(0))
    x_BTD = jnp.zeros((2, 16, 32))
    cos_TH, sin_TH = rope_tables(jnp.arange(8), model.cfg.head_size, model.cfg.rope_theta)
    with pytest.raises(shapes.ShapeError, match=r"Attention.__call__: argument cos_TH has shape "
                                                r"\(8, 8\): axis 0 is T=8 in '\.\.\. T H', but T=16 from "
                                                r"argument x_BTD"):
        attn(x_BTD, cos_TH, sin_TH)
    with pytest.raises(shapes.ShapeError, match="Transformer.embed: argument tokens_BT .* 3 axes"):
        model.embed(jnp.zeros((2, 16, 1), jnp.int32))


def test_the_checks_catch_what_jax_lets_through():
    """gmm_reference with one group size too few: jnp clamps the out-of-range group mask
    index and returns a wrong product silently; the annotation names the letter."""
    x_MK = jnp.ones((8, 4))
    w_GKN = jnp.ones((3, 4, 5))
    short_G = jnp.array([3, 5], jnp.int32)
    y = gm.gmm_reference.__wrapped__(x_MK, w_GKN, short_G)  # unchecked: no error
    assert y.shape == (8, 5)
    with pytest.raises(shapes.ShapeError, match="gmm_reference: argument group_sizes_G has shape "
                                                r"\(2,\): axis 0 is G=2 in 'G', but G=3 from "
                                                "argument w_GKN"):
        gm.gmm_reference(x_MK, w_GKN, short_G)


def test_kernel_boundaries_are_checked(seen):
    x_MK = jax.random.normal(jax.random.key(0), (64, 128))
    q_row, s_row, q_col, s_col = mx.quantize_rowcol(x_MK)
    assert s_row.shape == (64, 4) and s_col.shape == (2, 128)
    packed = mx.pack_rows(x_MK)
    assert packed.shape == (64, 132) and mx.unpack_rows(packed).shape == (64, 128)
    with pytest.raises(shapes.ShapeError, match="tgmm_reference: argument dy_MN .* M=32 .* M=64"):
        gm.tgmm_reference(x_MK, x_MK[:32], jnp.array([64], jnp.int32))
    names = {n.rsplit(".", 1)[-1] for n in seen}
    assert {"quantize_rowcol", "pack_rows", "unpack_rows", "tgmm_reference"} <= names


# ----------------------------------------------------------------------------- legend


def _legend_letters() -> set[str]:
    doc = olmo_jax.model.__doc__
    return set(re.findall(r"^  ([A-Za-z]) {6}", doc, flags=re.M))


def _annotated(package):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            for fn in [obj, *vars(obj).values()] if isinstance(obj, type) else [obj]:
                fn = getattr(fn, "__wrapped__", fn)
                if callable(fn) and hasattr(fn, "__shapes__") and fn.__module__ == info.name:
                    yield fn


def test_every_annotation_uses_legend_letters():
    legend = _legend_letters()
    assert len(legend) == 30 and "S" in legend and "k" in legend  # the table parsed
    fns = {f"{f.__module__}.{f.__qualname__}": f for p in (olmo_jax.model, olmo_jax.kernels)
           for f in _annotated(p)}
    assert "olmo_jax.kernels.grouped_matmul.grouped_matmul" in fns
    assert "olmo_jax.model.transformer.Transformer.__call__" in fns
    import inspect

    for name, fn in fns.items():
        letters = set()
        for item in fn.__shapes__:
            dims = item.split("->", 1)[-1].split(":")[-1]
            letters |= set(re.findall(r"(?<![A-Za-z_])[A-Za-z](?![A-Za-z_])", dims))
        for p in inspect.signature(fn).parameters:
            d = shapes.dims_of_name(p)
            letters |= {a.value for a in d.axes if a.kind == "letter"} if d else set()
        assert letters <= legend, (name, letters - legend)
