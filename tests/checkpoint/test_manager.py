"""orbax checkpoints of a full TrainState: restore onto another sharding of the 8 fake
devices (params replicated <-> experts split 8 ways) and between 1 and 8 devices, all
bitwise; asynchronous saves survive donation; keep_last + keep_every retention; a
mismatched or corrupt checkpoint fails naming the parameter (and both shapes)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from olmo_jax.checkpoint import manager as m
from olmo_jax.checkpoint.tree import flatten_named, unflatten_named
from olmo_jax.errors import CheckpointError
from olmo_jax.model import MoEConfig, TransformerConfig
from olmo_jax.model.abstract import abstract_model
from olmo_jax.parallel import mesh as mesh_lib
from olmo_jax.parallel import rules, strategy
from olmo_jax.trainer.checkpoints import model_tree, train_tree
from olmo_jax.trainer.state import TrainState

TX = optax.adamw(1e-3)


def small_cfg(**kw) -> TransformerConfig:
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=kw.pop("expert_hidden", 8))
    return TransformerConfig(
        vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_dense_layers=1, moe=moe, **kw
    )


def random_state(cfg: TransformerConfig, seed: int = 0) -> TrainState:
    """A TrainState whose every leaf (params, both Adam moments, counts, step, rng) is
    random, so a bitwise comparison means something. No model init is compiled."""
    rng = np.random.default_rng(seed)

    def fill(tree):
        flat = {}
        for name, x in flatten_named(tree).items():
            if jnp.issubdtype(x.dtype, jnp.integer):
                flat[name] = jnp.asarray(rng.integers(0, 1000, x.shape), x.dtype)
            else:
                flat[name] = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
        return unflatten_named(tree, flat)

    _, abstract_params, model_state = abstract_model(cfg)
    params = fill(abstract_params)
    return TrainState(
        step=jnp.asarray(7, jnp.int32),
        params=params,
        opt_state=fill(TX.init(params)),
        model_state=model_state,
        rng=jnp.asarray(rng.integers(0, 2**31, (2,)), jnp.uint32),
    )


def mesh_of(layout: str) -> Mesh:
    if layout == "single":
        return Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(mesh_lib.AXES)), mesh_lib.AXES)
    data, expert = {"replicated8": (8, 1), "expert8": (1, 8)}[layout]
    return mesh_lib.make_mesh(ml_collections.ConfigDict(dict(pipe=1, data=data, expert=expert, context=1)))


def state_shardings(state: TrainState, tx, mesh: Mesh) -> TrainState:
    """Parameters placed by the ddp rules table (experts over `expert`), moments alike."""
    return strategy.state_shardings(state, tx, mesh, rules.param_shardings(state.params, mesh))


def save_state(directory, state: TrainState, **kw) -> m.Checkpoints:
    ckpts = m.Checkpoints(directory, **kw)
    ckpts.save(int(state.step), model=model_tree(state), train=train_tree(state))
    return ckpts


def restore_state(ckpts: m.Checkpoints, step: int, like: TrainState, shardings: TrainState):
    model = m.restore_tree(ckpts, step, m.MODEL, model_tree(like), model_tree(shardings))
    train = m.restore_tree(ckpts, step, m.TRAIN, train_tree(like), train_tree(shardings))
    return TrainState(
        train["step"], model["params"], train["opt_state"], model["model_state"], train["rng"]
    )


@pytest.mark.parametrize(
    "src,dst",
    [
        ("replicated8", "expert8"),
        ("expert8", "replicated8"),
        ("single", "expert8"),
        ("expert8", "single"),
    ],
)
def test_restore_onto_another_sharding_is_bitwise(tmp_path, src, dst):
    host = random_state(small_cfg())
    src_sh = state_shardings(host, TX, mesh_of(src))
    dst_sh = state_shardings(host, TX, mesh_of(dst))
    save_state(tmp_path, jax.device_put(host, src_sh)).close()
    with m.Checkpoints(tmp_path, read_only=True) as reader:
        restored = restore_state(reader, 7, host, dst_sh)
    want, got, sh = flatten_named(host), flatten_named(restored), flatten_named(dst_sh)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
        assert got[name].sharding.is_equivalent_to(sh[name], got[name].ndim), name
    w_gate = got["params/moe_blocks/ffn/experts/w_gate"]  # [L, E, D, F]
    local_experts = {"expert8": 1, "replicated8": 8, "single": 8}[dst]
    assert {s.data.shape[1] for s in w_gate.addressable_shards} == {local_experts}
    assert len(w_gate.sharding.device_set) == (1 if dst == "single" else 8)


def test_async_save_survives_donation_of_the_saved_arrays(tmp_path):
    host = random_state(small_cfg(), seed=1)
    expected = [np.asarray(x).copy() for x in jax.tree.leaves(host)]
    state = jax.device_put(host, state_shardings(host, TX, mesh_of("expert8")))
    ckpts = save_state(tmp_path, state)  # asynchronous
    for leaf in jax.tree.leaves(state):  # what the next, donating train step does
        leaf.delete()
    ckpts.close()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
    with m.Checkpoints(tmp_path, read_only=True) as reader:
        restored = restore_state(reader, 7, like, jax.tree.map(lambda _: one, host))
    for a, b in zip(expected, jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_keep_last_plus_permanent_every_k(tmp_path):
    ckpts = m.Checkpoints(tmp_path, keep_last=2, keep_every=4)
    for step in range(1, 10):
        ckpts.save(step, model={"w": jnp.full((3,), step, jnp.float32)})
    ckpts.close()
    with m.Checkpoints(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [4, 8, 9] and reader.latest_step() == 9


def _restore_into(tmp_path, saved_cfg, model_cfg):
    saved = random_state(saved_cfg)
    save_state(tmp_path, saved, async_save=False).close()
    like = random_state(model_cfg)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with m.Checkpoints(tmp_path, read_only=True) as reader:
        restore_state(reader, 7, like, jax.tree.map(lambda _: one, like))


def test_wrong_shape_names_first_parameter_and_both_shapes(tmp_path):
    with pytest.raises(CheckpointError) as e:
        _restore_into(tmp_path, small_cfg(expert_hidden=8), small_cfg(expert_hidden=12))
    msg = str(e.value)
    assert "'params/moe_blocks/ffn/experts/w_down'" in msg, msg
    assert "(1, 8, 8, 16)" in msg and "(1, 8, 12, 16)" in msg, msg


def test_missing_and_unexpected_parameters_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"'params/lm_head' is missing .*\(16, 64\)"):
        _restore_into(tmp_path / "a", small_cfg(tie_embeddings=True), small_cfg())
    unexpected = r"has parameter 'params/lm_head' \(shape \(16, 64\)\)"
    with pytest.raises(CheckpointError, match=unexpected):
        _restore_into(tmp_path / "b", small_cfg(), small_cfg(tie_embeddings=True))


# A failed read leaves tensorstore callbacks aimed at orbax's closed event loop (noise
# from orbax's error path, reported by pytest as an unraisable exception).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_checkpoint_fails_with_its_path(tmp_path):
    state = random_state(small_cfg())
    save_state(tmp_path, state, async_save=False).close()
    for f in (tmp_path / "7" / "model").rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the array data
            f.write_bytes(b"garbage")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(CheckpointError, match=r"cannot read .*7/model.*corrupt"):
        with m.Checkpoints(tmp_path, read_only=True) as reader:
            restore_state(reader, 7, state, jax.tree.map(lambda _: one, state))
    (tmp_path / "7" / "model" / "_METADATA").write_text("{")
    with pytest.raises(CheckpointError, match=r"7/model.*corrupt"):
        with m.Checkpoints(tmp_path, read_only=True) as reader:
            reader.array_metadata(7, m.MODEL)
