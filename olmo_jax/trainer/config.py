"""The run config's `trainer` section as typed dataclasses (olmo_jax/config.py generates
the ConfigDict from them): steps and batch, logging and metric sinks, sampling,
checkpoints, reliability. The choice lists and field parsers the schema checks are
declared here and imported by the modules that implement them (guard.py, sinks.py,
profiler.py), so this module imports nothing of the trainer."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal, get_args

from olmo_jax import storage
from olmo_jax.data.batch_schedule import BatchSizeSchedule
from olmo_jax.errors import ConfigError, check_choice
from olmo_jax.host_memory import MODES as HOST_MALLOC_MODES

NanPolicy = Literal["skip", "halt"]  # trainer.nan_policy (guard.py)
POLICIES = get_args(NanPolicy)
Logger = Literal["jsonl", "tensorboard", "wandb"]  # trainer.loggers (sinks.py)
LOGGERS = get_args(Logger)
_LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # logger -> module (extra)
WandbMode = Literal["online", "offline", "disabled"]  # trainer.wandb.mode (sinks.py)
WANDB_MODES = get_args(WandbMode)


def loggers(spec: str) -> tuple[str, ...]:
    """The metric sinks named by trainer.loggers (comma-separated), checked: known,
    installed, jsonl kept."""
    names = tuple(dict.fromkeys(x.strip() for x in spec.split(",") if x.strip()))
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(
                f"trainer.loggers={spec!r}: unknown logger {name!r}; choose from {', '.join(LOGGERS)}"
            )
    if "jsonl" not in names:
        raise ConfigError(
            f"trainer.loggers={spec!r} must include jsonl: metrics.jsonl is what resuming, "
            "the report and the summary read; e.g. trainer.loggers=jsonl,tensorboard"
        )
    for name in names:
        module = _LOGGER_PACKAGES.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"trainer.loggers includes {name}, but the {module} package is not installed; "
                f"pip install 'olmo-jax[{name}]' (or remove {name} from trainer.loggers)"
            )
    return names


def profile_window(spec: str) -> tuple[int, int] | None:
    """trainer.profile_steps 'START:END' -> (START, END): the steps START..END-1 (numbered
    as in metrics.jsonl, the first step is 1) are traced; '' -> None."""
    if not spec.strip():
        return None
    fix = "write it as START:END with 1 <= START < END, e.g. trainer.profile_steps=10:13"
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"trainer.profile_steps={spec!r} is not START:END; {fix}") from None
    if not 1 <= a < b:
        raise ConfigError(f"trainer.profile_steps={spec!r}: need 1 <= START < END; {fix}")
    return a, b


def downstream_labels(spec: str) -> list[str]:
    """trainer.downstream_evals as a list, each label supported (else a ConfigError naming
    it and the supported list)."""
    from olmo_jax.evals.tasks import check_labels

    return check_labels([s.strip() for s in spec.split(",") if s.strip()])


@dataclass(frozen=True)
class WandbConfig:
    mode: WandbMode = "offline"  # WANDB_MODES: online | offline (no network; `wandb sync` later) | disabled
    project: str = "olmo_jax"
    entity: str = ""  # "" = the W&B default
    name: str = ""  # "" = the run_dir's folder name
    group: str = ""
    tags: str = ""  # comma-separated


@dataclass(frozen=True)
class TrainerConfig:
    max_steps: int = 100  # 0 = no step limit (trainer.max_tokens ends the run)
    # > 0: the run's token budget (OLMo-core's Duration.tokens): it ends after
    # ceil(max_tokens / (global_batch_size * seq_len)) steps, or at max_steps if that comes first
    max_tokens: int = 0
    seed: int = 0
    run_dir: str = "runs/default"
    cache_dir: str = ".cache/olmo_jax"
    global_batch_size: int = 32
    seq_len: int = 256
    grad_accum: int = 1  # microbatches accumulated per step
    # Batch-size warmup (OLMo-core's BatchSizeSchedulerCallback; data/batch_schedule.py):
    # "TOKENS@START,..." = a global batch of TOKENS tokens from START tokens trained on, e.g.
    # "4096@0,8192@1000000"; the lr is optim.lr x sqrt(batch / (global_batch_size x seq_len))
    batch_size_schedule: str = ""
    log_every: int = 10
    eval_every: int = 50  # 0 = only at the end
    eval_batches: int = 4
    # Downstream evals (olmo_jax/evals, docs/evaluation.md), at the same steps: OLMo-core's task
    # labels, comma-separated (olmo_jax.evals.tasks.supported()), read with data.tokenizer
    downstream_evals: str = ""
    downstream_batch_size: int = 8  # queries per compiled batch (a multiple of the batch's devices)
    downstream_max_docs: int = 0  # > 0: only each task's first N documents
    downstream_bos_id: int = -1  # >= 0: prepended to every context (olmo_eval's bos_token_id)
    expert_counts_every: int = 0  # > 0: per-expert counts to {run_dir}/expert_counts.jsonl
    # Metric sinks (olmo_jax/trainer/sinks.py), comma-separated: jsonl (always) | tensorboard | wandb
    loggers: str = "jsonl"
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile_steps: str = ""  # "START:END": jax.profiler trace of steps [START, END) into {run_dir}/profile
    sample_prompt: str = "import os\nimport sys\n\n\ndef "
    sample_tokens: int = 120
    sample_temperature: float = 0.6  # 0 = greedy
    # Checkpoints (olmo_jax/checkpoint): {run_dir}/checkpoints, saved asynchronously.
    save_every: int = 100  # save every N steps (0 = only at the end / at hard_stop)
    keep_last: int = 3  # keep the N most recent checkpoints (0 = keep all)
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of K forever (0 = off)
    resume: bool = True  # continue from the latest complete checkpoint in run_dir, if any
    # A checkpoint (e.g. from `python -m olmo_jax.convert hf-to-orbax`) whose weights start a
    # fresh run (new optimizer state, step 0).
    init_from: str = ""
    hard_stop: int = 0  # stop (with a checkpoint) after this step, before max_steps (0 = off)
    overwrite: bool = False  # accept a config that differs from the one run_dir already holds
    # Reliability (olmo_jax/trainer/guard.py, preflight.py; olmo_jax/distributed).
    nan_policy: NanPolicy = "skip"  # POLICIES: skip | halt: a step with a non-finite loss or grad norm
    max_skipped: int = 10  # halt after this many skipped steps in a row (0 = never)
    spike_sigma: float = 0.0  # skip steps whose loss / grad norm is this many std above the mean (0 = off)
    spike_window: int = 128  # ... of the last N steps
    memory_limit_gb: float = 0.0  # per device; 0 = the device's memory (CPU: RAM / local devices); < 0 = no check
    peer_timeout_s: float = 60.0  # multi-process: a process silent this long is lost; the others exit
    # A run_dir in a bucket (s3://, gs://): its owner's lease (trainer/lease.py) is stale after this
    # many seconds without a heartbeat (on the store's clock); keep it above any pause of the run
    lease_ttl_s: float = 60.0
    # olmo_jax/host_memory.py: auto (retain where JAX computes on one CPU device) | retain
    # (glibc keeps freed blocks for reuse: no page faults refilling each step's buffers) | system
    host_malloc: str = "auto"

    def validate(self, prefix: str = "trainer") -> TrainerConfig:
        check_choice(f"{prefix}.nan_policy", self.nan_policy, POLICIES)
        check_choice(f"{prefix}.wandb.mode", self.wandb.mode, WANDB_MODES)
        check_choice(f"{prefix}.host_malloc", self.host_malloc, HOST_MALLOC_MODES)
        for name in ("global_batch_size", "seq_len", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens < 0:
            raise ConfigError(f"{prefix}.max_tokens must be >= 0 (0 = off), got {self.max_tokens}")
        for name in ("run_dir", "init_from"):
            value = getattr(self, name)
            if storage.scheme(value) == "gcs":  # orbax's paths know gs:// only
                raise ConfigError(
                    f"{prefix}.{name}={value}: write a GCS bucket as gs://{value.partition('://')[2]}")
        if self.lease_ttl_s <= 0:
            raise ConfigError(f"{prefix}.lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.max_steps < (0 if self.max_tokens else 1):
            raise ConfigError(
                f"{prefix}.max_steps must be >= 1, got {self.max_steps} (0 = no step limit "
                f"needs {prefix}.max_tokens > 0)")
        if self.expert_counts_every < 0:
            raise ConfigError(
                f"{prefix}.expert_counts_every must be >= 0 (0 = off), got {self.expert_counts_every}"
            )
        if self.global_batch_size % self.grad_accum:
            raise ConfigError(
                f"{prefix}.grad_accum={self.grad_accum} must divide {prefix}.global_batch_size="
                f"{self.global_batch_size}"
            )
        if self.batch_schedule is not None:
            for size in self.batch_schedule.sizes:
                self.grad_accum_at(int(size))
        for name in ("save_every", "keep_last", "keep_every", "hard_stop"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{prefix}.{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.hard_stop and self.hard_stop >= self.total_steps:
            end = (f"{prefix}.max_steps={self.max_steps}" if self.binds == "trainer.max_steps"
                   else f"the {self.total_steps} steps of {prefix}.max_tokens={self.max_tokens}")
            raise ConfigError(
                f"{prefix}.hard_stop={self.hard_stop} must be below {end} (or 0 = run to the end)"
            )
        if self.max_skipped < 0:
            raise ConfigError(f"{prefix}.max_skipped must be >= 0 (0 = never halt), got {self.max_skipped}")
        if self.spike_sigma < 0:
            raise ConfigError(f"{prefix}.spike_sigma must be >= 0 (0 = off), got {self.spike_sigma}")
        if self.spike_window < 2:
            raise ConfigError(f"{prefix}.spike_window must be >= 2, got {self.spike_window}")
        if self.peer_timeout_s <= 0:
            raise ConfigError(f"{prefix}.peer_timeout_s must be > 0, got {self.peer_timeout_s}")
        loggers(self.loggers)
        profile_window(self.profile_steps)
        downstream_labels(self.downstream_evals)
        if self.downstream_batch_size < 1:
            raise ConfigError(f"{prefix}.downstream_batch_size must be >= 1, got {self.downstream_batch_size}")
        if self.downstream_max_docs < 0:
            raise ConfigError(f"{prefix}.downstream_max_docs must be >= 0 (0 = all), got {self.downstream_max_docs}")
        return self

    @property
    def downstream_labels(self) -> list[str]:
        return downstream_labels(self.downstream_evals)

    @property
    def tokens_per_step(self) -> int:
        """Tokens in a batch of trainer.global_batch_size (every step's without a
        batch_size_schedule)."""
        return self.global_batch_size * self.seq_len

    @property
    def batch_schedule(self) -> BatchSizeSchedule | None:
        """trainer.batch_size_schedule checked (None when it is empty)."""
        return BatchSizeSchedule.from_spec(self.batch_size_schedule, self.seq_len, self.global_batch_size)

    def grad_accum_at(self, size: int) -> int:
        """Microbatches of a step of `size` sequences: the microbatch of global_batch_size /
        grad_accum sequences is kept (OLMo-core's fixed rank_microbatch_size), so a larger
        batch accumulates more of them; a batch below one microbatch is one."""
        micro = self.global_batch_size // self.grad_accum
        if size <= micro:
            return 1
        if size % micro:
            raise ConfigError(
                f"trainer.batch_size_schedule: a batch of {size} sequences is no whole number of "
                f"microbatches of {micro} (trainer.global_batch_size / trainer.grad_accum = "
                f"{self.global_batch_size} / {self.grad_accum}); choose sizes that are multiples "
                "of it, or another trainer.grad_accum")
        return size // micro

    def tokens_before(self, step: int) -> int:
        """Tokens trained on in the run's first `step` steps."""
        schedule = self.batch_schedule
        return step * self.tokens_per_step if schedule is None else schedule.tokens_before(step)

    def _token_steps(self) -> int:
        """The steps max_tokens takes (the first whose tokens reach it)."""
        schedule = self.batch_schedule
        if schedule is None:
            return -(-self.max_tokens // self.tokens_per_step)
        return schedule.steps_for_tokens(self.max_tokens)

    @property
    def total_steps(self) -> int:
        """The run's length in steps: max_steps, or the steps of max_tokens if fewer."""
        if not self.max_tokens:
            return self.max_steps
        token_steps = self._token_steps()
        return min(self.max_steps, token_steps) if self.max_steps else token_steps

    @property
    def binds(self) -> str:
        """Which limit ends the run: "trainer.max_steps" or "trainer.max_tokens"."""
        if self.max_tokens and (not self.max_steps or self._token_steps() <= self.max_steps):
            return "trainer.max_tokens"
        return "trainer.max_steps"

    @property
    def budget_tokens(self) -> int:
        """The run's tokens as OLMo-core's trainer counts them for a token-unit scheduler:
        max_tokens where it ends the run, else the tokens of its total_steps."""
        if self.binds == "trainer.max_tokens":
            return self.max_tokens
        return self.tokens_before(self.total_steps)

    def duration_line(self) -> str:
        """The start-up banner's line on the run's length and which limit binds."""
        steps, tpb = self.total_steps, self.tokens_per_step
        scheduled = self.batch_schedule is not None
        if self.binds == "trainer.max_tokens":
            why = (f"trainer.max_tokens={self.max_tokens:,} binds"
                   + (" (trainer.batch_size_schedule)" if scheduled else
                      f" (ceil of {self.max_tokens:,} / {tpb:,} tokens per step)"))
            if self.max_steps:
                why += f"; trainer.max_steps={self.max_steps:,} is not reached"
        else:
            why = f"trainer.max_steps={self.max_steps:,} binds"
            if self.max_tokens:
                why += f" before trainer.max_tokens={self.max_tokens:,}"
        if scheduled:
            return f"duration: {steps:,} steps, {self.tokens_before(steps):,} tokens; {why}"
        return f"duration: {steps:,} steps x {tpb:,} tokens = {steps * tpb:,} tokens; {why}"
