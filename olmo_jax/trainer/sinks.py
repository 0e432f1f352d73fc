"""Metric sinks: where a run's logged records go, chosen by `trainer.loggers`.

    jsonl        {run_dir}/metrics.jsonl and expert_counts.jsonl (always on: resuming, the
                 report and the summary read them)
    tensorboard  {run_dir}/tensorboard/events.out.tfevents.*  (the `tensorboard` extra):
                 every scalar under its metrics.jsonl name, the resolved config as text,
                 per-expert routed counts as one histogram per MoE block
    wandb        a Weights & Biases run (the `wandb` extra) in {run_dir}/wandb, mode
                 trainer.wandb.mode: offline (default, no network; `wandb sync` uploads it
                 later), online, or disabled; the resolved config as the run's config

Every sink takes the same calls: `scalars(step, record)` at each logged step,
`expert_counts(step, blocks, counts_LE)` every trainer.expert_counts_every steps, `flush()`
after each logged step (so a watcher sees each log_every interval as it completes), and
`close()`. Only process 0 of a multi-process run builds any sink (`build_sinks(main=False)`
returns none). On resume from the checkpoint of step S, what the lost process logged
after S is dropped: metrics.jsonl is truncated (trainer/checkpoints.py), TensorBoard gets a
SessionLog START at step S + 1 (its readers purge the older events from there on), and the
W&B run is continued by id (its id is kept in {run_dir}/wandb/run_id).
"""

from __future__ import annotations

import json
import secrets
import string
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from olmo_jax.trainer.config import TrainerConfig, WandbConfig, loggers
from olmo_jax.trainer.logger import ExpertCountsLog, MetricsLog


class MetricSink(Protocol):
    def scalars(self, step: int, record: dict[str, float]) -> None: ...

    def expert_counts(self, step: int, blocks: list[int], counts_LE: np.ndarray) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _scalars(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if k != "step"}


class JsonlSink:
    """metrics.jsonl (one object per logged step) and expert_counts.jsonl."""

    def __init__(self, run_dir: Path, first_block: int, append: bool):
        self.metrics = MetricsLog(Path(run_dir) / "metrics.jsonl", append=append)
        self.counts = ExpertCountsLog(run_dir, 1, first_block, append=append)

    def scalars(self, step: int, record: dict[str, float]) -> None:
        self.metrics.write({"step": step, **record})

    def expert_counts(self, step: int, blocks: list[int], counts_LE: np.ndarray) -> None:
        self.counts.maybe_write(step, {"expert_counts": counts_LE})

    def flush(self) -> None:  # both files are line-buffered
        pass

    def close(self) -> None:
        self.metrics.close()
        self.counts.close()


def _expert_histogram(counts_E: np.ndarray):
    """A TensorBoard HistogramProto of the expert ids of one block's routed assignments:
    bucket e (upper edge e + 0.5) holds expert e's count."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    counts_E = np.asarray(counts_E, np.float64)
    experts_E = np.arange(len(counts_E), dtype=np.float64)
    return HistogramProto(
        min=0.0, max=float(len(counts_E) - 1), num=float(counts_E.sum()),
        sum=float(counts_E @ experts_E), sum_squares=float(counts_E @ experts_E**2),
        bucket_limit=list(experts_E + 0.5), bucket=list(counts_E),
    )


class TensorBoardSink:
    """Event files in `logdir` written with tensorboard's own EventFileWriter."""

    def __init__(self, logdir: Path, config: dict, resume_step: int | None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2, summary_pb2
        self.writer = EventFileWriter(str(logdir), max_queue_size=1000, flush_secs=3600)
        if resume_step is not None:  # readers drop the older files' events of steps > S
            self.writer.add_event(event_pb2.Event(
                wall_time=time.time(), step=resume_step + 1,
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        text = "```json\n" + json.dumps(config, indent=2, default=str) + "\n```"
        tensor = TensorProto(dtype=7, string_val=[text.encode()],  # 7 = DT_STRING
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        value = summary_pb2.Summary.Value(
            tag="config", tensor=tensor,
            metadata=text_metadata.create_summary_metadata("config", "the resolved run config"))
        self._add(resume_step or 0, [value])
        self.flush()

    def _add(self, step: int, values) -> None:
        self.writer.add_event(self._event.Event(
            wall_time=time.time(), step=step, summary=self._summary.Summary(value=values)))

    def scalars(self, step: int, record: dict[str, float]) -> None:
        self._add(step, [self._summary.Summary.Value(tag=k, simple_value=v)
                         for k, v in record.items()])

    def expert_counts(self, step: int, blocks: list[int], counts_LE: np.ndarray) -> None:
        self._add(step, [self._summary.Summary.Value(tag=f"expert_counts/block{b}",
                                                     histo=_expert_histogram(counts_E))
                         for b, counts_E in zip(blocks, counts_LE, strict=True)])

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _new_run_id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbSink:
    """One W&B run per run_dir (continued by id on resume), in {run_dir}/wandb."""

    def __init__(self, run_dir: Path, w: WandbConfig, run_config: dict, resumed: bool):
        import wandb

        root = Path(run_dir) / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run_id"
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else _new_run_id()
        id_file.write_text(run_id)
        self._wandb = wandb
        self.run = wandb.init(
            mode=w.mode, dir=str(run_dir), id=run_id, resume="allow",
            project=w.project, entity=w.entity or None, name=w.name or Path(run_dir).name,
            group=w.group or None, tags=[t.strip() for t in w.tags.split(",") if t.strip()] or None,
            config=run_config,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def scalars(self, step: int, record: dict[str, float]) -> None:
        self.run.log(record, step=step)

    def expert_counts(self, step: int, blocks: list[int], counts_LE: np.ndarray) -> None:
        edges = np.arange(counts_LE.shape[1] + 1) - 0.5  # bin e = expert e
        self.run.log({f"expert_counts/block{b}": self._wandb.Histogram(np_histogram=(c, edges))
                      for b, c in zip(blocks, np.asarray(counts_LE).tolist(), strict=True)},
                     step=step)

    def flush(self) -> None:  # run.log hands each record to W&B's writer process at once
        pass

    def close(self) -> None:
        self.run.finish()
        self._wandb.teardown()  # stops W&B's writer process: the run file is complete on disk


class Sinks:
    """All of a run's sinks, written together."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    def scalars(self, step: int, record: dict) -> None:
        values = _scalars(record)
        for sink in self.sinks:
            sink.scalars(step, values)
        for sink in self.sinks:
            sink.flush()

    def expert_counts(self, step: int, blocks: list[int], counts_LE: np.ndarray) -> None:
        counts_LE = np.asarray(counts_LE).astype(np.int64)
        for sink in self.sinks:
            sink.expert_counts(step, blocks, counts_LE)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_sinks(trainer: TrainerConfig, run_config: dict, run_dir: Path, first_block: int,
                resume_step: int | None, main: bool) -> Sinks:
    """The sinks of trainer.loggers (none when `main` is False: process 0 alone writes),
    each recording `run_config` (RunConfig.to_dict()) where it keeps the run's config.
    `resume_step`: the checkpoint step this launch resumed from (None: a fresh run)."""
    if not main:
        return Sinks([])
    names = loggers(trainer.loggers)
    resumed = resume_step is not None
    sinks: list[MetricSink] = [JsonlSink(run_dir, first_block, append=resumed)]
    try:
        if "tensorboard" in names:
            sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard", run_config, resume_step))
        if "wandb" in names and trainer.wandb.mode != "disabled":
            sinks.append(WandbSink(run_dir, trainer.wandb, run_config, resumed))
    except BaseException:
        Sinks(sinks).close()
        raise
    return Sinks(sinks)
