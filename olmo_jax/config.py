"""The run config: its five sections, generated from their typed schemas, parsed and
validated into them, with clear errors.

A run's config is an `ml_collections.ConfigDict` with five sections, each the fields of
one frozen dataclass owned by the package that uses it (its defaults and docs live there,
once):

    model     olmo_jax/model/config.py    TransformerConfig (with model.moe: MoEConfig)
    parallel  olmo_jax/parallel/config.py ParallelConfig
    optim     olmo_jax/optim/config.py    OptimConfig
    data      olmo_jax/data/config.py     DataConfig
    trainer   olmo_jax/trainer/config.py  TrainerConfig (with trainer.wandb: WandbConfig)

`default_config()` returns that ConfigDict with every field present (types are locked by
ml_collections, so `--config.x=y` overrides are type-checked); files in configs/ derive
from it. `parse(cfg)` turns it into the typed sections (a `RunConfig`), `validate(cfg)`
checks every section and the cross-section rules (`check` of a `RunConfig`),
`model_config(cfg, vocab)` is the typed model of a run. The entry points validate once and
hand the `RunConfig` down, each builder taking the sections it needs: no module but this
one reads a ConfigDict. Each error names the field and the fix. `get_path` / `set_path` walk a dotted field
name ("model.moe.top_k") through a ConfigDict or dict; `upgrade` reads an older run's
saved config into this schema.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import NamedTuple

import ml_collections

from olmo_jax.data.config import DataConfig
from olmo_jax.errors import ConfigError
from olmo_jax.model.config import RUN_DEFAULT, TransformerConfig
from olmo_jax.optim import schedulers
from olmo_jax.optim.config import OptimConfig
from olmo_jax.parallel.config import ParallelConfig
from olmo_jax.trainer.config import TrainerConfig

SECTIONS = {"model": TransformerConfig, "parallel": ParallelConfig, "optim": OptimConfig,
            "data": DataConfig, "trainer": TrainerConfig}
# Fields that were removed, and where their setting lives now.
MOVED = {
    "parallel.capacity_factor": (
        "model.moe.capacity_factor",
        "one capacity factor sizes every dispatch's expert buffers: set "
        "model.moe.capacity_factor (0 = dropless where the dispatch can be; rowwise then "
        "uses 1.25)"),
}


class RunConfig(NamedTuple):
    """A run config's typed sections (`parse`, `validate`): what the entry points hand down,
    each builder taking the sections it needs."""
    model: TransformerConfig  # vocab_size 0 = from the tokenizer (model_config resolves it)
    parallel: ParallelConfig
    optim: OptimConfig
    data: DataConfig
    trainer: TrainerConfig

    def model_config(self, vocab_size: int | None = None, eos_id: int | None = None
                     ) -> TransformerConfig:
        """The run's typed model, validated (vocab from the data when model.vocab_size is 0;
        with data.doc_mask, model.doc_mask_eos = `eos_id`, default the tokenizer's)."""
        return _resolved_model(_doc_masked(self.model, self.data, eos_id), vocab_size)

    def to_dict(self) -> dict:
        """The sections as plain nested dicts, exactly as the ConfigDict's `to_dict()` gives
        them (keys sorted at every level): the run's config.json, the config saved with a
        checkpoint, the metric sinks' record of the config."""
        return _sorted({name: dataclasses.asdict(getattr(self, name)) for name in self._fields})

    def get(self, dotted: str):
        """The value of a dotted field name ("model.moe.top_k")."""
        return get_path(self.to_dict(), dotted)

    def with_values(self, changes: dict) -> RunConfig:
        """This config with the dotted fields of `changes` set, checked (`check`)."""
        d = self.to_dict()
        for dotted, value in changes.items():
            if not has_path(d, dotted):
                raise unknown_key_error(default_config(), dotted)
            set_path(d, dotted, value)
        return check(RunConfig(**{name: _typed(SECTIONS[name], d[name], name) for name in SECTIONS}))


def _sorted(d: dict) -> dict:
    return {k: _sorted(d[k]) if isinstance(d[k], dict) else d[k] for k in sorted(d)}


def get_path(cfg, dotted: str):
    """The value at a dotted field name ("model.moe.top_k") of a ConfigDict or dict; raises
    KeyError (or AttributeError / TypeError) where a part does not exist."""
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def set_path(cfg, dotted: str, value) -> None:
    """Sets the field at a dotted name of a ConfigDict or dict (its parents must exist)."""
    *parents, last = dotted.split(".")
    node = get_path(cfg, ".".join(parents)) if parents else cfg
    node[last] = value


def has_path(cfg, dotted: str) -> bool:
    try:
        get_path(cfg, dotted)
    except (KeyError, AttributeError, TypeError):
        return False
    return True


def _as_config_dict(schema) -> ml_collections.ConfigDict:
    """The ConfigDict of a section's defaults: one field per dataclass field (nested
    dataclasses and dicts become sub-ConfigDicts), at its run default."""
    out = ml_collections.ConfigDict()
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.metadata.get(RUN_DEFAULT, f.default)
        if dataclasses.is_dataclass(value):
            out[f.name] = _as_config_dict(type(value))
        elif isinstance(value, dict):
            out[f.name] = ml_collections.ConfigDict(value)
        else:
            out[f.name] = value
    return out


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    for name, schema in SECTIONS.items():
        c[name] = _as_config_dict(schema)
    return c


def defaults() -> RunConfig:
    """The typed sections at their run defaults (`default_config()`, parsed)."""
    return parse(default_config())


def _moved_error(dotted: str) -> ConfigError:
    where, why = MOVED[dotted]
    return ConfigError(f"config field '{dotted}' was removed: it is {where} now; {why}")


def unknown_key_error(cfg: ml_collections.ConfigDict, dotted: str) -> ConfigError:
    """A ConfigError for an override of a field that does not exist, with suggestions (or,
    for a removed field, where its setting lives now)."""
    if dotted in MOVED:
        return _moved_error(dotted)
    node, path = cfg, []
    for part in dotted.split("."):
        if isinstance(node, ml_collections.ConfigDict) and part in node:
            node, path = node[part], path + [part]
            continue
        options = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        near = difflib.get_close_matches(part, options, n=3)
        where = ".".join(path) or "the top level"
        hint = f"; did you mean {', '.join('.'.join(path + [n]) for n in near)}?" if near else ""
        return ConfigError(f"unknown config field '{dotted}': {where} has no field '{part}'{hint}")
    return ConfigError(f"config field '{dotted}' is not overridable")


def upgrade(saved: dict) -> dict:
    """A resolved config as an older olmo_jax wrote it (a run folder's config.json), in
    this schema: parallel.capacity_factor (rowwise receive slots, default 1.25) becomes
    model.moe.capacity_factor where it sized rowwise dispatch, and is dropped elsewhere; model
    and data fields added since take the meaning their absence had (model/config
    ABSENT_FIELD_MEANING, data.instances plus_one), as checkpoint/manager reads old models."""
    from olmo_jax.model.config import ABSENT_FIELD_MEANING
    from olmo_jax.parallel.expert import ROWWISE_CAPACITY_FACTOR

    d = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    # Fields added since: what their absence meant then (a pre-norm model; plus_one windows).
    if "model" in d:
        d["model"] = {**ABSENT_FIELD_MEANING, **d["model"]}
    if "data" in d:
        d["data"] = {"instances": "plus_one", **d["data"]}
    p = d.get("parallel", {})
    if "capacity_factor" in p:
        cf = p.pop("capacity_factor")
        rowwise = p.get("strategy") == "ddp" and p.get("expert") != 1 and p.get("dispatch") == "rowwise"
        moe = dict(d.get("model", {}).get("moe", {}))
        if rowwise and not moe.get("capacity_factor") and cf != ROWWISE_CAPACITY_FACTOR:
            d["model"] = {**d["model"], "moe": {**moe, "capacity_factor": cf}}
    return d


def from_saved(saved: dict) -> RunConfig:
    """The typed sections (not yet validated) of a resolved config as a run folder's
    config.json holds it, an older olmo_jax's too (`upgrade`), over this schema's defaults;
    a field the schema lacks raises KeyError or AttributeError."""
    cfg = default_config()
    cfg.lock()
    cfg.update(upgrade(saved))
    return parse(cfg)


def _typed(schema, values: dict, prefix: str):
    """A section's dataclass from its ConfigDict values; a field the schema lacks is a
    ConfigError naming it (a config file may add fields to its unlocked ConfigDict)."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for name in values:
        if name not in fields:
            raise unknown_key_error(default_config(), f"{prefix}.{name}")
    kw = {}
    for name, value in values.items():
        sub = fields[name].default_factory
        if sub is not dataclasses.MISSING and dataclasses.is_dataclass(sub):
            value = _typed(sub, value, f"{prefix}.{name}")
        kw[name] = value
    return schema(**kw)


def parse(cfg: ml_collections.ConfigDict) -> RunConfig:
    """The typed sections of a run config (not yet validated)."""
    d = cfg.to_dict()
    for name in d:
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section '{name}': choose from {', '.join(SECTIONS)}")
    return RunConfig(**{name: _typed(schema, d.get(name, {}), name) for name, schema in SECTIONS.items()})


def model_config(cfg: ml_collections.ConfigDict, vocab_size: int | None = None) -> TransformerConfig:
    """The typed model config for a run (vocab from the data when model.vocab_size is 0;
    data.doc_mask: `RunConfig.model_config`)."""
    data = _typed(DataConfig, cfg.data.to_dict(), "data") if "data" in cfg else DataConfig()
    model = _typed(TransformerConfig, cfg.model.to_dict(), "model")
    return _resolved_model(_doc_masked(model, data, None), vocab_size)


def _doc_masked(model: TransformerConfig, data: DataConfig, eos_id: int | None) -> TransformerConfig:
    """`model` with document masking at the EOS token when data.doc_mask is on."""
    if not data.doc_mask:
        return model
    if eos_id is None:
        from olmo_jax.data.tokenizer import load_tokenizer

        eos_id = load_tokenizer(data.tokenizer).eos_id
    return model.replace(doc_mask_eos=int(eos_id))


def _resolved_model(model: TransformerConfig, vocab_size: int | None) -> TransformerConfig:
    if not model.vocab_size:
        if vocab_size is None:
            raise ConfigError("model.vocab_size is 0 (= from the tokenizer) but no tokenizer vocab is known")
        model = model.replace(vocab_size=vocab_size)
    return model.validate()


def validate(cfg: ml_collections.ConfigDict) -> RunConfig:
    """Checks every section and the rules across sections; returns the typed sections.
    (model.vocab_size 0 = from the tokenizer: `model_config` checks the resolved vocab.)"""
    return check(parse(cfg))


def check(run: RunConfig) -> RunConfig:
    """`validate` of typed sections: each section's rules and those across sections."""
    run.model.replace(vocab_size=run.model.vocab_size or 1).validate()
    run.parallel.validate()
    run.trainer.validate()
    run.data.validate()
    run.optim.validate()
    _check_batch_size_schedule(run)
    if run.model.vocab_size and run.data.vocab_size and run.model.vocab_size < run.data.vocab_size:
        raise ConfigError(
            f"model.vocab_size={run.model.vocab_size} is smaller than data.vocab_size="
            f"{run.data.vocab_size}; raise model.vocab_size (or set it to 0 = from the data)"
        )
    return run


def _check_batch_size_schedule(run: RunConfig) -> None:
    """What trainer.batch_size_schedule does not support, as OLMo-core's callback refuses
    it (non-Adam optimizers; a step-unit scheduler whose end moves with the batch size) or
    as olmo_jax cannot run it (a pipeline's fixed microbatches)."""
    t = run.trainer
    if not t.batch_size_schedule:
        return
    if run.parallel.pipe > 1:
        raise ConfigError(
            f"trainer.batch_size_schedule is not supported with parallel.pipe={run.parallel.pipe}: "
            "a pipeline's microbatches (parallel.microbatches) are fixed per compiled schedule; "
            "set parallel.pipe=1 or trainer.batch_size_schedule=''")
    if run.optim.name != "adamw":
        raise ConfigError(
            f"trainer.batch_size_schedule rescales an AdamW learning rate by sqrt(batch ratio), "
            f"as OLMo-core's BatchSizeSchedulerCallback does (it refuses other optimizers); "
            f"optim.name={run.optim.name!r}: set optim.name=adamw or trainer.batch_size_schedule=''")
    if run.optim.scheduler and t.binds == "trainer.max_tokens":
        sched = schedulers.parse(run.optim.scheduler)
        if not schedulers.keeps_t_max(sched):
            raise ConfigError(
                f"optim.scheduler={run.optim.scheduler!r}: with trainer.batch_size_schedule and "
                f"a run measured in tokens (trainer.max_tokens binds), the scheduler's units "
                "must be 'tokens' unless it sets t_max (its end in steps would move with the "
                "batch size; OLMo-core's callback refuses it too); add units='tokens'")


def check_training(run: RunConfig) -> None:
    """The rules of a config that is about to be trained (not of one read for a report or
    a plan): the learning-rate warmup (and an OLMo-core scheduler's decay) fits in the run
    unless optim.shorten_warmup says a shortened one is intended."""
    if run.optim.shorten_warmup:
        return
    t = run.trainer
    if run.optim.scheduler:
        sched = schedulers.parse(run.optim.scheduler)
        tokens = sched.units == "tokens"
        t_max = t.budget_tokens if tokens else t.total_steps
        phases = schedulers.fixed_phases(sched, t_max)
        if phases and sum(phases.values()) > t_max:
            unit = "tokens" if tokens else "steps"
            parts = " + ".join(f"{k}={v}" for k, v in phases.items())
            raise ConfigError(
                f"optim.scheduler={run.optim.scheduler!r}: {parts} {unit} is longer than the run "
                f"({t_max} {unit}: {t.binds}); shorten them, or set "
                "--config.optim.shorten_warmup=True if that is intended")
        return
    warmup, steps = run.optim.warmup_steps, t.total_steps
    if warmup > steps:
        raise ConfigError(
            f"optim.warmup_steps={warmup} is longer than the run ({t.binds}: {steps} steps): "
            f"the warmup would be cut short; set --config.optim.warmup_steps to at most {steps} "
            "(e.g. a tenth of the run), or --config.optim.shorten_warmup=True if that is intended"
        )


__all__ = ["MOVED", "SECTIONS", "ConfigError", "RunConfig", "check", "check_training",
           "default_config", "defaults", "from_saved", "get_path", "has_path", "model_config", "parse", "set_path",
           "unknown_key_error", "upgrade", "validate"]
