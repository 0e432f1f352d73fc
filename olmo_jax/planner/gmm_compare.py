"""`model.moe.gmm_impl=auto` against every grouped matmul a target accepts, planned: what
the kernel table (olmo_jax/kernels/select.py) resolves `auto` to, and each accepted
implementation's projected step, so a test or `tools/bench/gmm_auto.py` can check that
`auto` is (within a tolerance) the fastest that exists.

Every figure is the planner's projection "as the compiler scheduled it" (planner/overlap.py)
of the real train step compiled for abstract devices of the kind: for a GPU kind an
XLA:GPU roofline of a deviceless compile, not a measurement.

Which implementations are planned (`candidates`): each concrete model.moe.gmm_impl the
table accepts for the config on the target (an explicit choice it refuses, e.g. pallas on
Blackwell or blas on a GPU, is left out with the refusal), except `tiled`, which the
planner cannot price: its per-expert loops' trip counts are the routing's, and the HLO
walk counts each loop body once (planner/plan_build.py `expert_buffer_factor`). `auto`
is not compiled again: it is the implementation it resolves to, compiled once.
"""

from __future__ import annotations

import dataclasses

from olmo_jax import targets
from olmo_jax.config import RunConfig
from olmo_jax.kernels import platform, select
from olmo_jax.planner.compile import model_config

UNPRICED = {"tiled": "per-expert loops whose trip counts are the routing's: the HLO walk "
                     "counts each loop body once, so the planner cannot price it"}


@dataclasses.dataclass(frozen=True)
class Candidates:
    auto: str  # what gmm_impl=auto resolves to on the target
    planned: tuple[str, ...]  # the concrete implementations to plan (auto's among them)
    left_out: dict[str, str]  # implementation -> why it is not planned


def target_of_kind(kind: str) -> platform.Target:
    """The kernel table's Target for a device kind: an abstract GPU of targets.KINDS, or
    the CPU."""
    if kind not in targets.KINDS:
        return platform.Target("cpu")
    g = targets.spec(kind)
    return platform.Target("gpu", g.capability, g.num_sms, abstract=True)


def candidates(run: RunConfig, kind: str) -> Candidates:
    """What to plan for `run` on device kind `kind` (module docstring)."""
    target = target_of_kind(kind)
    model = model_config(run)
    resolve = lambda impl: select.resolve_kernels(  # noqa: E731
        dataclasses.replace(model, moe=dataclasses.replace(model.moe, gmm_impl=impl)),
        target).gmm
    auto = resolve("auto")
    planned, left_out = [], {}
    for impl in select.GMM_IMPLS:
        if impl == "auto":
            continue
        try:
            resolve(impl)
        except ValueError as e:
            left_out[impl] = f"refused: {str(e).splitlines()[0]}"
            continue
        if impl in UNPRICED:
            left_out[impl] = UNPRICED[impl]
        else:
            planned.append(impl)
    if auto not in planned:
        raise ValueError(f"gmm_impl=auto resolves to {auto} on {kind}, which the planner "
                         f"cannot price ({left_out.get(auto, 'not accepted')})")
    return Candidates(auto, tuple(planned), left_out)


@dataclasses.dataclass
class Comparison:
    kind: str
    n_devices: int
    candidates: Candidates
    plans: dict[str, dict]  # implementation -> its plan's JSON (Plan.to_json)

    def tokens_per_s(self, impl: str) -> float:
        """Projected tokens/s/device as scheduled of `impl` ("auto": what it resolves to)."""
        impl = self.candidates.auto if impl == "auto" else impl
        return self.plans[impl]["tokens_per_s_per_device_scheduled"]

    @property
    def best(self) -> str:
        return max(self.plans, key=self.tokens_per_s)

    @property
    def auto_vs_best(self) -> float:
        """auto's projected tokens/s over the best implementation's (1: auto is the best)."""
        return self.tokens_per_s("auto") / self.tokens_per_s(self.best)

    def to_json(self) -> dict:
        return {"kind": self.kind, "devices": self.n_devices, "auto": self.candidates.auto,
                "best": self.best, "auto_vs_best": self.auto_vs_best,
                "left_out": self.candidates.left_out,
                "impls": {i: {k: p[k] for k in (
                    "tokens_per_s_per_device_scheduled", "mfu_scheduled", "allocated_bytes",
                    "buffer_factor", "errors", "compiler")} for i, p in self.plans.items()}}


def compare(run: RunConfig, n_devices: int, kind: str, plan=None) -> Comparison:
    """Plans `run` on `n_devices` of `kind` with every candidate implementation. `plan`:
    (run, n_devices, kind) -> the plan's JSON (default: planner.api.plan_config, which
    compiles on XLA:GPU for a GPU kind where it can)."""
    if plan is None:
        from olmo_jax.planner import api

        def plan(r, n, k):
            return api.plan_config(r, n, k)["json"]["plan"]
    cands = candidates(run, kind)
    plans = {impl: plan(run.with_values({"model.moe.gmm_impl": impl}), n_devices, kind)
             for impl in cands.planned}
    return Comparison(kind, n_devices, cands, plans)
