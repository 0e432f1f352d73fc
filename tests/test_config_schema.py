"""One schema: the run config is generated from the typed section dataclasses, each choice
list is spelled once (in its section's config module, or the module implementing it) and
validated from there, one dtype table, one dotted-path walk, the typed sections record
exactly what the ConfigDict holds, and the command lines share olmo_jax/cli.py."""

import ast
import dataclasses
import json
import runpy
from pathlib import Path

import pytest

from olmo_jax import config as config_lib
from olmo_jax.checkpoint import hf
from olmo_jax.config import SECTIONS, default_config, get_path, has_path, parse, set_path, validate
from olmo_jax.errors import ConfigError
from olmo_jax.kernels import GMM_IMPLS
from olmo_jax.kernels.ring_attention import CONTEXT_ATTENTIONS, RING_HOPS
from olmo_jax.kernels.select import MXFP8_GEMM_IMPLS, NORM_IMPLS
from olmo_jax.labels import INSTANCES
from olmo_jax.model.config import (
    ATTENTION_IMPLS,
    COMPUTE_DTYPES,
    DTYPES,
    GATINGS,
    REMATS,
    ROPE_SCALING_LAYERS,
    ROPE_SCALINGS,
    ROUTING_MODES,
    RUN_DEFAULT,
    TransformerConfig,
)
from olmo_jax.model.moe.losses import LB_GRANULARITIES, LB_LOSS_TYPES
from olmo_jax.model.mxfp8_gemm import PRECISIONS
from olmo_jax.optim.optimizer import OPTIMIZERS
from olmo_jax.optim.schedules import LR_SCHEDULES
from olmo_jax.parallel.expert import BACKENDS
from olmo_jax.parallel.pipeline.schedule import PIPELINE_SCHEDULES
from olmo_jax.parallel.rules import STRATEGIES
from olmo_jax.trainer.config import LOGGERS, POLICIES, WANDB_MODES

PACKAGE = Path(__file__).resolve().parents[1] / "olmo_jax"
# Every choice field of the run config and the list (from its module) that validates it.
CHOICES = {
    "model.dtype": COMPUTE_DTYPES, "model.remat": REMATS, "model.attention_precision": PRECISIONS,
    "model.rope_scaling": ROPE_SCALINGS, "model.rope_scaling_layers": ROPE_SCALING_LAYERS,
    "model.attention_impl": ATTENTION_IMPLS, "model.norm_impl": NORM_IMPLS,
    "model.mxfp8_gemm_impl": MXFP8_GEMM_IMPLS, "model.moe.gating": GATINGS,
    "model.moe.routing_mode": ROUTING_MODES, "model.moe.gmm_impl": GMM_IMPLS,
    "model.moe.precision": PRECISIONS, "model.moe.lb_loss_type": LB_LOSS_TYPES,
    "model.moe.lb_granularity": LB_GRANULARITIES, "parallel.strategy": STRATEGIES,
    "parallel.dispatch": BACKENDS, "parallel.pipeline_schedule": PIPELINE_SCHEDULES,
    "optim.name": OPTIMIZERS, "optim.schedule": LR_SCHEDULES, "trainer.nan_policy": POLICIES,
    "trainer.wandb.mode": WANDB_MODES, "data.instances": INSTANCES,
    "model.context_attention": CONTEXT_ATTENTIONS, "model.context_ring_hops": RING_HOPS,
}


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def _defaults(schema) -> dict:
    out = {}
    for f in dataclasses.fields(schema):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else \
            f.metadata.get(RUN_DEFAULT, f.default)
        out[f.name] = _defaults(type(value)) if dataclasses.is_dataclass(value) else value
    return out


def test_default_config_is_the_dataclasses_fields_and_defaults():
    cfg = default_config()
    assert set(cfg.keys()) == set(SECTIONS)
    for name, schema in SECTIONS.items():
        assert cfg[name].to_dict() == _defaults(schema), name
    run = parse(cfg)
    assert run.model == TransformerConfig(vocab_size=0)  # the run's 0 = from the tokenizer
    assert all(getattr(run, s) == schema() for s, schema in SECTIONS.items() if s != "model")
    assert config_lib.model_config(cfg, 384) == TransformerConfig()
    validate(cfg)


def test_a_field_no_section_has_is_refused_by_name():
    cfg = default_config()
    cfg.optim.lr_peak = 1.0  # a config file may add fields to its unlocked ConfigDict
    with pytest.raises(ConfigError, match=r"unknown config field 'optim.lr_peak'"):
        validate(cfg)


@pytest.mark.parametrize("field", sorted(CHOICES))
def test_each_choice_field_takes_exactly_its_modules_list(field):
    for value in CHOICES[field]:
        cfg = default_config()
        set_path(cfg, field, value)
        if value == "mxfp8":  # needs widths in blocks of 32 (the defaults are)
            assert cfg.model.d_model % 32 == 0 and cfg.model.moe.expert_hidden % 32 == 0
        validate(cfg)
    cfg = default_config()
    set_path(cfg, field, "nonsense")
    with pytest.raises(ConfigError, match=rf"{field.replace('.', r'\.')}='nonsense': choose"):
        validate(cfg)


def _string_collections(tree):
    """(set of strings, line, is a dict) of every tuple / list / set literal of >= 2
    strings, and of every dict literal's string keys."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            elts = node.elts
        elif isinstance(node, ast.Dict):
            elts = [k for k in node.keys if k is not None]
        else:
            continue
        if len(elts) >= 2 and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
            yield frozenset(e.value for e in elts), node.lineno, isinstance(node, ast.Dict)


def test_every_choice_list_is_spelled_once_in_the_package():
    lists = {frozenset(v) for v in CHOICES.values()} | {frozenset(LOGGERS)}
    tables = {frozenset(DTYPES), frozenset(STRATEGIES)}  # dicts keyed by the choices (other dicts keyed by a few
    # of the names, e.g. peak FLOP/s per dtype, are data, not choice lists)
    seen = {}
    for path in _sources():
        for values, line, is_dict in _string_collections(ast.parse(path.read_text())):
            if values in (tables if is_dict else lists | tables):
                seen.setdefault(values, []).append(f"{path.relative_to(PACKAGE)}:{line}")
    spelled_twice = {tuple(sorted(v)): where for v, where in seen.items() if len(where) > 1}
    assert not spelled_twice, f"choice lists spelled more than once (import them): {spelled_twice}"
    assert set(seen) == lists | tables  # every list is spelled somewhere (the test sees them)


def test_one_dtype_table_float16_stores_but_does_not_compute():
    """float16 is an export (storage) dtype: the trainer has no loss scaling, so neither
    the run config nor a hand-built TransformerConfig computes in it."""
    assert hf.DTYPES is DTYPES and set(COMPUTE_DTYPES) < set(DTYPES) and "float16" in DTYPES
    hf.check_dtype("float16")
    with pytest.raises(hf.CheckpointError, match="choose one of float32, bfloat16, float16"):
        hf.check_dtype("int8")
    with pytest.raises(ConfigError, match="model.dtype='float16': choose one of float32, bfloat16"):
        TransformerConfig(dtype="float16").validate()
    cfg = default_config()
    cfg.model.dtype = "float16"
    with pytest.raises(ConfigError, match="model.dtype='float16'"):
        validate(cfg)


def test_dotted_paths_are_walked_in_one_place():
    cfg = default_config()
    assert get_path(cfg, "model.moe.top_k") == 2 and has_path(cfg, "trainer.wandb.mode")
    assert not has_path(cfg, "model.moe.top_kk") and not has_path(cfg, "model.d_model.x")
    set_path(cfg, "model.moe.top_k", 4)
    assert cfg.model.moe.top_k == 4
    walks = [f"{p.relative_to(PACKAGE)}" for p in _sources() if "node = node[part]" in p.read_text()]
    assert walks == ["config.py"], walks


def test_no_module_imports_another_modules_private_names():
    """The command lines share olmo_jax/cli.py instead of train.py's private helpers."""
    bad = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("olmo_jax"):
                bad += [f"{path.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and a.name != "__version__"]
            if isinstance(node, ast.Attribute) and node.attr in ("_CONFIG", "_fail", "_parse_flags"):
                bad.append(f"{path.relative_to(PACKAGE)}: .{node.attr}")
    assert not bad, bad


CONFIG_FILES = sorted(p for p in (PACKAGE.parent / "configs").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.stem for p in CONFIG_FILES])
def test_typed_sections_record_what_the_config_dict_holds(path):
    """config.json, a checkpoint's config and the sinks' copy come from RunConfig.to_dict():
    the same JSON, byte for byte, as the ConfigDict's; with_values / get walk dotted names."""
    cfg = runpy.run_path(str(path))["get_config"]()
    run = parse(cfg)
    assert json.dumps(run.to_dict(), default=str) == json.dumps(cfg.to_dict(), default=str)
    changed = run.with_values({"trainer.seed": 7, "model.moe.top_k": 1})
    assert changed.get("trainer.seed") == 7 and changed.model.moe.top_k == 1
    assert changed.parallel == run.parallel and run.trainer.seed == cfg.trainer.seed
    with pytest.raises(ConfigError, match="did you mean model.moe.top_k"):
        run.with_values({"model.moe.topk": 1})
