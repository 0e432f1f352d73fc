"""Build, check and score a list of downstream tasks: `Suite(labels, tokenizer, ...)` builds
every task and refuses bad input before any compute (an unsupported label, a tokenizer
whose ids do not fit the model's vocabulary, a task whose queries exceed the eval context);
`suite.evaluate(scorer)` -> {label: {metric: value}} plus seconds per task."""

from __future__ import annotations

import time

from olmo_jax.errors import ConfigError
from olmo_jax.evals import metric, tasks


class Suite:
    def __init__(self, labels, tokenizer: tasks.Tokenizer, model_ctx_len: int, vocab_size: int,
                 limit_docs: int | None = None, field: str = "trainer.downstream_evals"):
        labels = list(labels)
        tasks.check_labels(labels, field)
        if tokenizer.vocab_size > vocab_size:
            raise ConfigError(f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids and the model's "
                              f"vocabulary {vocab_size}: use the tokenizer the model was trained with")
        self.tasks = {}
        for label in labels:
            task = tasks.build_task(label, tokenizer, model_ctx_len, max_docs=limit_docs)
            if task.max_sequence_length > model_ctx_len:  # OLMo-core's DownstreamEvaluator check
                raise ConfigError(f"{field}: task '{label}' needs {task.max_sequence_length} tokens per query "
                                  f"(its longest, rounded up to 128) and the eval context is {model_ctx_len}: "
                                  f"raise the eval context (trainer.seq_len) or drop the task")
            self.tasks[label] = task

    def evaluate(self, scorer) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """({label: ICLMetric.compute()}, {label: seconds})."""
        results, seconds = {}, {}
        for label, task in self.tasks.items():
            t0 = time.perf_counter()
            sums = scorer(task)
            results[label] = metric.compute(task.metric_type, metric.records(task.metric_type, task.samples, sums))
            seconds[label] = time.perf_counter() - t0
        return results, seconds
