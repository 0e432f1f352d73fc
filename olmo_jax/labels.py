"""The layout of a batch row: `INSTANCES`, the window layouts `data.instances` chooses
between (data/loader.py cuts them), and the label sentinels a row may end with.

A row holds `seq_len + 1` ints: inputs = row[:-1], targets = row[1:]. Under OLMo-core's
instance layout the last target has no token, so it holds a sentinel instead:
- `NO_LABEL`: the position has no label (OLMo-core's -100, `label_ignore_index`): no loss,
  not counted in the loss's denominator;
- `FILTERED`: the same, and the whole instance failed the repetition filter: its other
  labels add zero loss but are still counted in the denominator (OLMo-core counts a
  filtered instance's seq_len - 1 labels "so that each rank contributes fairly").
Token ids are never negative, so `targets >= 0` marks the labelled positions. The
objective (olmo_jax/objective.py) reads the sentinels; this module sits below it and the
data pipeline.
"""

INSTANCES = ("olmo_core", "plus_one")  # data.instances

NO_LABEL = -100
FILTERED = -101
