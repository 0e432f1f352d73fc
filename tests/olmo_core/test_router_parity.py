"""The router against OLMo-core's own `MoERouterV2` (ai2-olmo-core 3.0.0 in .venv-oracle,
by subprocess: `model_oracle.py --router`): for every gating (softmax, sigmoid,
topk_softmax), weight normalization (normalize_expert_weights 1 or none,
restore_weight_scale), routing mode (learned, random, uniform), group-limited routing and
LB granularity (local_batch, instance), the same experts, combine weights, LB and z
losses, and gradient of the router weight.

OLMo-core's `random` mode draws its U(0,1) scores with torch; olmo_jax draws them from its
key. The test hands OLMo-core's draw (the scores it returns) to olmo_jax's draw
(`jax.random.uniform` patched for that call), so everything after the draw is compared."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.model.moe.losses import load_balancing_loss, router_stats, z_loss
from olmo_jax.model.moe.router import route

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

B, S, D, E, K = 4, 16, 8, 8, 2


def _cases() -> dict[str, dict]:
    cases = {}
    for gating in ("softmax", "sigmoid", "topk_softmax"):
        for norm in (None, 1.0):
            for restore in (False, True):
                for granularity in ("local_batch", "instance"):
                    cases[f"{gating}-norm{norm}-restore{restore}-{granularity}"] = dict(
                        gating=gating, normalize_expert_weights=norm,
                        restore_weight_scale=restore, granularity=granularity)
    for gating in ("softmax", "sigmoid"):
        for norm in (None, 1.0):
            cases[f"random-{gating}-norm{norm}"] = dict(gating=gating, random=True,
                                                        normalize_expert_weights=norm)
            cases[f"groups-{gating}-norm{norm}"] = dict(gating=gating, n_group=4, topk_group=2,
                                                        normalize_expert_weights=norm)
        cases[f"random-groups-{gating}"] = dict(gating=gating, random=True, n_group=4,
                                                topk_group=2)
    for gating in ("softmax", "sigmoid", "topk_softmax"):
        cases[f"uniform-{gating}"] = dict(gating=gating, uniform=True,
                                          normalize_expert_weights=1.0)
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    out = tmp_path_factory.mktemp("router")
    rng = np.random.default_rng(0)
    spec = []
    for name, c in CASES.items():
        spec.append({"name": name, "num_experts": E, "top_k": K, "lb_weight": 1.0,
                     "z_weight": 1.0, **c,
                     "x": (2 * rng.normal(size=(B, S, D))).astype(np.float32).tolist(),
                     "weight_ED": (0.5 * rng.normal(size=(E, D))).astype(np.float32).tolist(),
                     "probe": rng.normal(size=(B, S, K)).astype(np.float32).tolist()})
    (out / "spec.json").write_text(json.dumps({"cases": spec}))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("model_oracle.py")), "--router",
                    str(out / "spec.json"), str(out / "out.npz")], check=True, timeout=300,
                   capture_output=True)
    return {c["name"]: c for c in spec}, np.load(out / "out.npz")


def _olmo_jax(c: dict, noise_SE):
    """olmo_jax's weights, ids, LB and z losses and router-weight gradient of the case."""
    sigmoid = c["gating"] == "sigmoid"
    renorm = c.get("normalize_expert_weights") is not None
    mode = "random" if c.get("random") else "uniform" if c.get("uniform") else "learned"
    x_SD = jnp.asarray(c["x"], jnp.float32).reshape(B * S, D)
    probe_Sk = jnp.asarray(c["probe"], jnp.float32).reshape(B * S, K)
    shards = B if c.get("granularity") == "instance" else 1

    def losses(w_DE):
        logits_SE = jnp.einsum("sd,de->se", x_SD, w_DE, precision=jax.lax.Precision.HIGHEST)
        r = route(logits_SE, top_k=K, gating=c["gating"], norm_topk_prob=renorm and not sigmoid,
                  sigmoid_renorm=renorm, sigmoid_eps=1e-7 if sigmoid else 0.0,
                  weight_scale=float(K) if c.get("restore_weight_scale") else 1.0,
                  n_group=c.get("n_group") or 1, topk_group=c.get("topk_group") or 1,
                  mode=mode, key=jax.random.key(0))
        stats = jax.tree.map(lambda a: a[None], router_stats(r.probs_SE, r.logits_SE, r.idx_Sk, E,
                                                             rows=B))
        lb = load_balancing_loss(stats, K, "per_layer", shards)
        z = z_loss(stats)
        return jnp.sum(r.weights_Sk * probe_Sk) + lb + z, (r, lb, z)

    w_DE = jnp.asarray(c["weight_ED"], jnp.float32).T
    real_uniform = jax.random.uniform
    if noise_SE is not None:  # OLMo-core's torch draw in place of olmo_jax's
        jax.random.uniform = lambda key, shape, dtype=jnp.float32, *a, **k: jnp.asarray(
            noise_SE, dtype).reshape(shape)
    try:
        grad_DE, (r, lb, z) = jax.grad(losses, has_aux=True)(w_DE)
    finally:
        jax.random.uniform = real_uniform
    return r, float(lb), float(z), np.asarray(grad_DE).T


def _err(got, want) -> tuple[float, float]:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    a = float(np.max(np.abs(got - want)))
    return a, a / max(float(np.max(np.abs(want))), 1e-30)


@pytest.mark.parametrize("name", list(CASES))
def test_router_matches_olmo_core(oracle, name):
    cases, out = oracle
    c = cases[name]
    noise = out[f"{name}/scores"].reshape(B * S, E) if c.get("random") else None
    r, lb, z, grad_ED = _olmo_jax(c, noise)
    np.testing.assert_array_equal(np.asarray(r.idx_Sk), out[f"{name}/idx"].reshape(B * S, K))
    errs = {"weights": _err(r.weights_Sk, out[f"{name}/weights"].reshape(B * S, K)),
            "lb": _err(lb, out[f"{name}/lb"]), "z": _err(z, out[f"{name}/z"]),
            "grad": _err(grad_ED, out[f"{name}/grad_ED"])}
    print(name, " ".join(f"{k} abs {a:.1e} rel {rr:.1e}" for k, (a, rr) in errs.items()))
    for what, (abs_err, _) in errs.items():
        assert abs_err <= 1e-5, (what, abs_err)
