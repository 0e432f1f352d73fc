"""Hugging Face OLMoE (`OlmoeForCausalLM`) <-> olmo_jax weights, both ways, exactly.

Tensor map (HF [out, in] Linear weights; ours stacked over layers, leading `L`):
  model.embed_tokens.weight [V, D]                 -> embedding [V, D]
  lm_head.weight [V, D] (absent when tied)         -> lm_head [D, V] (transposed)
  model.norm.weight [D]                            -> final_norm/weight
  layers.l.input_layernorm / post_attention_layernorm [D] -> attn_norm / ffn_norm [L, D]
  layers.l.self_attn.{q,k,v}_proj.weight [N*H|K*H, D]     -> attn/{q,k,v}_proj [L, D, N|K, H]
  layers.l.self_attn.o_proj.weight [D, N*H]        -> attn/o_proj [L, N, H, D]
  layers.l.self_attn.{q,k}_norm.weight [N*H|K*H]   -> attn/{q,k}_norm/weight [L, N|K, H]
      (HF normalizes q and k across all heads at once; so does our RMSNorm over (heads, H))
  layers.l.mlp.gate.weight [E, D]                  -> ffn/router/weight [L, D, E]
  experts, per expert (what save_pretrained writes):
    layers.l.mlp.experts.e.{gate,up}_proj.weight [F, D], .down_proj.weight [D, F]
  or packed (transformers 5 in memory, also accepted by from_pretrained):
    layers.l.mlp.experts.gate_up_proj [E, 2F, D] (gate rows first), .down_proj [E, D, F]
      -> ffn/experts/w_gate, w_up [L, E, D, F], w_down [L, E, F, D]
Reading accepts both expert layouts; writing produces the per-expert one. Every tensor is
moved, never recomputed, so HF -> olmo_jax -> HF is bitwise for float32 weights.

Python API: `load_model(hf_dir)` -> HFModel (call it on int32 ids [B, T] for float32
logits [B, T, V]); `save_model(model, out_dir)`; `hf_to_orbax` / `orbax_to_hf` back
`python -m olmo_jax.convert`.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from olmo_jax.checkpoint import manager as m
from olmo_jax.checkpoint import safetensors_io
from olmo_jax.checkpoint.hf_config import from_hf_config, to_hf_config
from olmo_jax.checkpoint.tree import check_fits, flatten_named, nest, unflatten_named
from olmo_jax.errors import CheckpointError
from olmo_jax.model import Transformer, TransformerConfig
from olmo_jax.model.abstract import abstract_model
from olmo_jax.model.config import DTYPES

_LAYER = "model.layers.{l}."
_EXPERT = _LAYER + "mlp.experts.{e}."


class Tensors:
    """Takes named tensors out of a checkpoint, checking shapes; reports leftovers."""

    def __init__(self, tensors: dict[str, np.ndarray], where: str):
        self.left = dict(tensors)
        self.where = where

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.left:
            raise CheckpointError(f"{self.where}: tensor '{name}' (shape {shape}) is missing")
        t = self.left.pop(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.where}: tensor '{name}' has shape {tuple(t.shape)} but config.json "
                f"implies {tuple(shape)}"
            )
        return np.asarray(t).astype(np.float32)

    def finish(self) -> None:
        if self.left:
            name = sorted(self.left)[0]
            raise CheckpointError(
                f"{self.where}: unexpected tensor '{name}' (shape {tuple(self.left[name].shape)})"
                + (f" and {len(self.left) - 1} more" if len(self.left) > 1 else "")
                + "; OlmoeForCausalLM (as olmo_jax reads it) has no such weight"
            )


def hf_to_params(tensors: dict[str, np.ndarray], cfg: TransformerConfig, where: str) -> dict:
    """The nested dict of our (float32) parameters from HF tensors."""
    t = Tensors(tensors, where)
    L, V, D = cfg.n_layers, cfg.vocab_size, cfg.d_model
    N, K, H = cfg.n_heads, cfg.kv_heads, cfg.head_size
    E, F = cfg.moe.num_experts, cfg.moe.expert_hidden

    def per_layer(fn):
        return np.stack([fn(_LAYER.format(l=l)) for l in range(L)])

    def experts(l: int):
        p = _LAYER.format(l=l) + "mlp.experts."
        if p + "gate_up_proj" in t.left:
            gate_up_E2FD = t.take(p + "gate_up_proj", (E, 2 * F, D))
            down_EDF = t.take(p + "down_proj", (E, D, F))
            gate_EFD, up_EFD = gate_up_E2FD[:, :F], gate_up_E2FD[:, F:]
        else:

            def per_expert(name, shape):
                return np.stack([t.take(_EXPERT.format(l=l, e=e) + name, shape) for e in range(E)])

            gate_EFD = per_expert("gate_proj.weight", (F, D))
            up_EFD = per_expert("up_proj.weight", (F, D))
            down_EDF = per_expert("down_proj.weight", (D, F))
        return gate_EFD.transpose(0, 2, 1), up_EFD.transpose(0, 2, 1), down_EDF.transpose(0, 2, 1)

    embedding = t.take("model.embed_tokens.weight", (V, D))
    moe_experts = [experts(l) for l in range(L)]
    params = {
        "embedding": embedding,
        "final_norm": {"weight": t.take("model.norm.weight", (D,))},
        "moe_blocks": {
            "attn_norm": {
                "weight": per_layer(lambda p: t.take(p + "input_layernorm.weight", (D,)))
            },
            "ffn_norm": {
                "weight": per_layer(lambda p: t.take(p + "post_attention_layernorm.weight", (D,)))
            },
            "attn": {
                "q_proj": per_layer(
                    lambda p: t.take(p + "self_attn.q_proj.weight", (N * H, D)).T.reshape(D, N, H)
                ),
                "k_proj": per_layer(
                    lambda p: t.take(p + "self_attn.k_proj.weight", (K * H, D)).T.reshape(D, K, H)
                ),
                "v_proj": per_layer(
                    lambda p: t.take(p + "self_attn.v_proj.weight", (K * H, D)).T.reshape(D, K, H)
                ),
                "o_proj": per_layer(
                    lambda p: t.take(p + "self_attn.o_proj.weight", (D, N * H)).T.reshape(N, H, D)
                ),
                "q_norm": {
                    "weight": per_layer(
                        lambda p: t.take(p + "self_attn.q_norm.weight", (N * H,)).reshape(N, H)
                    )
                },
                "k_norm": {
                    "weight": per_layer(
                        lambda p: t.take(p + "self_attn.k_norm.weight", (K * H,)).reshape(K, H)
                    )
                },
            },
            "ffn": {
                "router": {"weight": per_layer(lambda p: t.take(p + "mlp.gate.weight", (E, D)).T)},
                "experts": {
                    "w_gate": np.stack([x[0] for x in moe_experts]),
                    "w_up": np.stack([x[1] for x in moe_experts]),
                    "w_down": np.stack([x[2] for x in moe_experts]),
                },
            },
        },
    }
    if cfg.tie_embeddings:
        if "lm_head.weight" in t.left:  # some exports store the tied head too
            head = t.take("lm_head.weight", (V, D))
            if not np.array_equal(head, embedding):
                raise CheckpointError(
                    f"{where}: tie_word_embeddings=true but lm_head.weight differs from "
                    "model.embed_tokens.weight; set tie_word_embeddings=false in config.json"
                )
    else:
        params["lm_head"] = t.take("lm_head.weight", (V, D)).T
    t.finish()
    return jax.tree.map(np.ascontiguousarray, params)


def params_to_hf(params: dict, cfg: TransformerConfig, dtype=np.float32) -> dict[str, np.ndarray]:
    """HF tensors (per-expert layout) from the nested dict of our parameters."""
    p = jax.tree.map(np.asarray, params)
    L, D = cfg.n_layers, cfg.d_model
    N, K, H = cfg.n_heads, cfg.kv_heads, cfg.head_size
    blocks, out = p["moe_blocks"], {}
    out["model.embed_tokens.weight"] = p["embedding"]
    out["model.norm.weight"] = p["final_norm"]["weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"].T
    a, f = blocks["attn"], blocks["ffn"]
    for l in range(L):
        pre = _LAYER.format(l=l)
        out[pre + "input_layernorm.weight"] = blocks["attn_norm"]["weight"][l]
        out[pre + "post_attention_layernorm.weight"] = blocks["ffn_norm"]["weight"][l]
        out[pre + "self_attn.q_proj.weight"] = a["q_proj"][l].reshape(D, N * H).T
        out[pre + "self_attn.k_proj.weight"] = a["k_proj"][l].reshape(D, K * H).T
        out[pre + "self_attn.v_proj.weight"] = a["v_proj"][l].reshape(D, K * H).T
        out[pre + "self_attn.o_proj.weight"] = a["o_proj"][l].reshape(N * H, D).T
        out[pre + "self_attn.q_norm.weight"] = a["q_norm"]["weight"][l].reshape(N * H)
        out[pre + "self_attn.k_norm.weight"] = a["k_norm"]["weight"][l].reshape(K * H)
        out[pre + "mlp.gate.weight"] = f["router"]["weight"][l].T
        ex = f["experts"]
        for e in range(cfg.moe.num_experts):
            pe = _EXPERT.format(l=l, e=e)
            out[pe + "gate_proj.weight"] = ex["w_gate"][l, e].T
            out[pe + "up_proj.weight"] = ex["w_up"][l, e].T
            out[pe + "down_proj.weight"] = ex["w_down"][l, e].T
    return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}


@functools.lru_cache(maxsize=16)
def _forward_fn(config: TransformerConfig):
    """(graphdef, jitted logits function) per architecture: models of the same config
    share one compilation."""
    graphdef = abstract_model(config)[0]

    @jax.jit
    def forward(params, model_state, ids_BT):
        return nnx.merge(graphdef, params, model_state)(ids_BT).logits_BTV

    return graphdef, forward


class HFModel:
    """A model with its weights: `model(input_ids[B, T] int32)` -> float32 logits [B, T, V].

    `config` is its TransformerConfig; `params` / `model_state` its nnx states; `module`
    the nnx Transformer; `hf_config` the config.json it came from (None if it did not)."""

    def __init__(
        self,
        config: TransformerConfig,
        params: nnx.State,
        model_state: nnx.State,
        hf_config: dict | None = None,
    ):
        self.config, self.params, self.model_state, self.hf_config = (
            config,
            params,
            model_state,
            hf_config,
        )
        self.graphdef, self._forward = _forward_fn(config)

    @classmethod
    def from_params(
        cls, config: TransformerConfig, params: dict, hf_config: dict | None = None
    ) -> HFModel:
        """From a nested dict of parameter arrays (names as in `flatten_named`)."""
        _, abstract_params, model_state = abstract_model(config)
        state_leaves = flatten_named(model_state)
        if state_leaves:  # OLMoE has parameters only
            raise CheckpointError(
                f"the model has non-parameter state ('{next(iter(state_leaves))}') that "
                "Hugging Face OLMoE weights do not provide"
            )
        flat = {k: jnp.asarray(v) for k, v in flatten_named(params).items()}
        check_fits(flatten_named(abstract_params), flat, "parameters")
        return cls(config, unflatten_named(abstract_params, flat), model_state, hf_config)

    @property
    def module(self) -> Transformer:
        return nnx.merge(self.graphdef, self.params, self.model_state)

    def __call__(self, input_ids) -> jax.Array:
        return self._forward(self.params, self.model_state, jnp.asarray(input_ids, jnp.int32))


def load_folder(folder: str | Path, config_from, params_from) -> HFModel:
    """A config.json + safetensors folder as an HFModel: `config_from(hf_config, where)`
    reads its model config, `params_from(tensors, cfg, where)` its parameters."""
    folder = Path(folder)
    hf_config = safetensors_io.read_config(folder)
    cfg = config_from(hf_config, str(folder / "config.json"))
    params = params_from(safetensors_io.read_tensors(folder), cfg, str(folder))
    return HFModel.from_params(cfg, params, hf_config=hf_config)


def load_model(hf_dir: str | Path) -> HFModel:
    """A Hugging Face OLMoE folder (config.json + safetensors) as an HFModel."""
    return load_folder(hf_dir, from_hf_config, hf_to_params)


def split_module(model) -> tuple[TransformerConfig, nnx.State, nnx.State, dict | None]:
    if isinstance(model, HFModel):
        return model.config, model.params, model.model_state, model.hf_config
    if isinstance(model, Transformer):
        _, params, model_state = nnx.split(model, nnx.Param, ...)
        return model.cfg, params, model_state, None
    raise TypeError(
        f"save_model takes an HFModel or an olmo_jax Transformer, not {type(model).__name__}"
    )


def _export(cfg, params, model_state, hf_config, out_dir: Path, dtype: str | None) -> None:
    leftover = flatten_named(model_state)
    if leftover:
        raise CheckpointError(
            f"Hugging Face OLMoE export: the model has state OLMoE cannot hold "
            f"('{next(iter(leftover))}', e.g. router biases for aux-loss-free balancing)"
        )
    if dtype is None:
        dtype = str(
            (hf_config or {}).get("dtype") or (hf_config or {}).get("torch_dtype") or "float32"
        )
    check_dtype(dtype)
    config = to_hf_config(cfg, hf_config, dtype)
    pure = nest({k: np.asarray(jax.device_get(v)) for k, v in flatten_named(params).items()})
    safetensors_io.write_folder(out_dir, config, params_to_hf(pure, cfg, np.dtype(DTYPES[dtype])))


def check_dtype(dtype: str | None) -> None:
    """An export's tensor dtype: a name in model/config.py's DTYPES (None = the source's)."""
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")


def save_model(model, out_dir: str | Path, dtype: str | None = None) -> None:
    """Writes config.json + safetensors that `OlmoeForCausalLM.from_pretrained` loads.
    `dtype` (float32 | bfloat16 | float16) defaults to the source config's, else float32."""
    cfg, params, model_state, hf_config = split_module(model)
    _export(cfg, params, model_state, hf_config, Path(out_dir), dtype)


# ---- conversions between folders (python -m olmo_jax.convert) ------------------------
CONFIG_FILE = "config.py"

_CONFIG_PY = '''"""olmo_jax run config of the {what} from
{source}
by `python -m olmo_jax.convert {command}`. Its checkpoint is this folder; fine-tune with
    python -m olmo_jax.train --config={config_path} --config.trainer.init_from={out_dir} \\
        --config.data.paths=YOUR_TOKENS.npy
"""

import pathlib

from olmo_jax.config import default_config

HERE = pathlib.Path(__file__).resolve().parent


def get_config():
    c = default_config()
{assignments}
    c.trainer.init_from = str(HERE)
    return c
'''


# Model fields that are run settings, not properties of the converted weights: config.py
# leaves them at their defaults.
_RUN_SETTINGS = ("model.dtype", "model.remat", "model.moe.gmm_impl", "model.attention_impl",
                 "model.norm_impl", "model.mxfp8_gemm_impl", "model.lm_loss_chunk")


def _model_assignments(cfg: TransformerConfig) -> list[tuple[str, object]]:
    out = []
    for name, value in m.model_config_to_dict(cfg).items():
        if name == "moe":
            out += [(f"model.moe.{k}", v) for k, v in value.items()]
        else:
            out.append((f"model.{name}", value))
    return out


def run_config(cfg: TransformerConfig, tokenizer: str = "") -> dict:
    """The default run config with `cfg` as its model, resolved (RunConfig.to_dict(), as a
    run's config.json holds it)."""
    from olmo_jax.config import defaults

    changes = dict(_model_assignments(cfg))
    if tokenizer:
        changes["data.tokenizer"] = tokenizer
    return defaults().with_values(changes).to_dict()


def require_empty(path: Path, flag: str) -> None:
    if path.exists() and any(path.iterdir()):
        raise CheckpointError(f"{flag} {path} is not empty; choose a new folder or empty it")


def hf_to_orbax(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """{out}/checkpoints/0 (model weights, configs) and {out}/config.py; returns the
    config file's path. A tokenizer.json next to the weights is copied and configured."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir).absolute()
    require_empty(out_dir, "--out")
    model = load_model(hf_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = ""
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copy(hf_dir / "tokenizer.json", out_dir / "tokenizer.json")
        tokenizer = str(out_dir / "tokenizer.json")
    return save_init_checkpoint(out_dir, model, hf_dir.absolute(), "hf-to-orbax",
                                "Hugging Face OLMoE model converted", tokenizer)


def save_init_checkpoint(out_dir: Path, model: HFModel, source, command: str, what: str,
                         tokenizer: str = "") -> Path:
    """{out}/checkpoints/0 (weights only: no optimizer state) and {out}/config.py, whose
    trainer.init_from starts a fresh run from these weights; returns the config's path."""
    out_dir = Path(out_dir).absolute()
    run_cfg = run_config(model.config, tokenizer)
    ckpts = m.Checkpoints(out_dir / m.RUN_SUBDIR, async_save=False)
    json_items = {m.CONFIG: {"config": run_cfg,
                             "model": m.model_config_to_dict(model.config)}}
    if model.hf_config is not None:
        json_items[m.HF_CONFIG] = model.hf_config
    ckpts.save(0, model={"params": model.params, "model_state": model.model_state},
               json_items=json_items)
    ckpts.close()
    lines = [
        f"    c.{k} = {v!r}" for k, v in _model_assignments(model.config) if k not in _RUN_SETTINGS
    ]
    if tokenizer:
        lines.append('    c.data.tokenizer = str(HERE / "tokenizer.json")')
    config_path = out_dir / CONFIG_FILE
    config_path.write_text(
        _CONFIG_PY.format(
            what=what,
            source=source,
            command=command,
            config_path=config_path,
            out_dir=out_dir,
            assignments="\n".join(lines),
        )
    )
    return config_path


def load_checkpoint(ckpt: str | Path) -> HFModel:
    """The model of an olmo_jax checkpoint (a run folder, checkpoints folder or step
    folder; training or converted), in host (CPU) memory."""
    ckpts, step = m.resolve(ckpt)
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    with ckpts:
        cfg = m.saved_model_config(ckpts, step)
        _, abstract_params, abstract_state = abstract_model(cfg)
        like = {"params": abstract_params, "model_state": abstract_state}
        model = m.restore_tree(ckpts, step, m.MODEL, like, host)
        has_hf = ckpts.has_item(step, m.HF_CONFIG)
        hf_config = ckpts.read_json(step, m.HF_CONFIG) if has_hf else None
    return HFModel(cfg, model["params"], model["model_state"], hf_config)


def orbax_to_hf(ckpt: str | Path, out_dir: str | Path, dtype: str | None = None) -> None:
    out_dir = Path(out_dir)
    check_dtype(dtype)
    require_empty(out_dir, "--out")
    save_model(load_checkpoint(ckpt), out_dir, dtype)
