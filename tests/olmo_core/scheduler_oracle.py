"""OLMo-core's learning-rate schedulers as the oracle (run in .venv-oracle, never imported by
the product): `python scheduler_oracle.py SPEC.json OUT.json`.

SPEC: {"lr": peak, "cases": [{"spec": "cos_with_warmup(warmup=10)", "max_steps": N,
"max_tokens": T, "tokens_per_step": B}], "bad": ["wsd(warmup=1, decay=2, decay_fraction=0.1)"]}.
Each spec is evaluated with OLMo-core's own classes (registry names; `stage` and
`override_decay` build ComposableSchedulerStage / OverrideDecay), and its learning rate is
set, through `Scheduler.set_lr`, on a param group at every step of a run as OLMo-core's
trainer counts it (global_step 1..N, global_train_tokens_seen k * B).
OUT: {"lrs": [[lr per step] per case], "errors": [OLMo-core's message per bad spec]}."""

import json
import sys
import warnings
from types import SimpleNamespace

from olmo_core.exceptions import OLMoConfigurationError
from olmo_core.optim.scheduler import ComposableSchedulerStage, OverrideDecay, Scheduler

NAMES = ("constant", "constant_with_warmup", "linear_with_warmup", "inv_sqrt_with_warmup",
         "cos_with_warmup", "half_cos_with_warmup", "cos_with_warmup_and_linear_decay", "wsd",
         "wsds", "power_lr", "exponential", "sequential", "composable")


def namespace():
    ns = {name: Scheduler.get_registered_class(name) for name in NAMES}
    ns.update(stage=ComposableSchedulerStage, override_decay=OverrideDecay)
    return ns


def build(spec: str):
    ns = namespace()
    return eval(spec if "(" in spec else spec + "()", {"__builtins__": {}}, ns)


def run(lr: float, case: dict) -> list[float]:
    sched = build(case["spec"])
    trainer = SimpleNamespace(max_steps=case["max_steps"], max_tokens=case["max_tokens"],
                              global_step=0, global_train_tokens_seen=0)
    group = {"lr": lr, "params": []}
    out = []
    for k in range(1, case["max_steps"] + 1):
        trainer.global_step = k
        trainer.global_train_tokens_seen = k * case["tokens_per_step"]
        out.append(float(sched.set_lr(group, trainer)))
    return out


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    warnings.simplefilter("ignore")
    errors = []
    for bad in spec["bad"]:
        try:
            build(bad)
        except OLMoConfigurationError as e:
            errors.append(str(e))
        else:
            errors.append(None)
    lrs = [run(spec["lr"], case) for case in spec["cases"]]
    open(out_path, "w").write(json.dumps({"lrs": lrs, "errors": errors}))


if __name__ == "__main__":
    main(*sys.argv[1:])
