"""OLMo-core's BatchSizeSchedulerCallback and its data loader as the oracle (run in
.venv-oracle, never imported by the product): `python batch_size_oracle.py SPEC.json OUT.json`.

SPEC: {"paths": [...], "vocab_size": V, "seq_len": S, "work_dir": DIR, "seed": s,
"cases": [{"global_batch_size": tokens (the loader's configured size), "batch_sizes":
[tokens], "schedule": [start tokens], "lr": peak, "scheduler": "cos_with_warmup(...)"
(registry names, as scheduler_oracle.py), "duration": ["steps" | "tokens", value],
"steps": n}]}.

Each case runs OLMo-core's own pieces in the order its Trainer calls them: a
NumpyFSLDataset over the files and its NumpyFSLDataLoader (shuffled by seed, epoch 1), the
callback attached to a trainer whose max_steps / max_tokens / tokens_per_batch are the
Trainer class's own properties, with a TransformerTrainModule holding a torch AdamW and
the scheduler (post_attach; then per step pre_load_batch, the batch, the bookkeeping,
`Scheduler.set_lr` as optim_step does it, post_step).
OUT: per case, each step's batch size in tokens, the instance indices of its batch, its
input_ids, the learning rate set, the step at which max_duration is due, and the
epoch's global instance order (to turn indices into positions)."""

import json
import sys
import warnings

import numpy as np
import torch
from olmo_core.data.collator import DataCollator
from olmo_core.data.data_loader import NumpyFSLDataLoader
from olmo_core.data.numpy_dataset import NumpyFSLDataset, NumpyFSLDatasetConfig
from olmo_core.data.tokenizer import TokenizerConfig
from olmo_core.train.callbacks.batch_size_scheduler import BatchSizeSchedulerCallback
from olmo_core.train.common import Duration
from olmo_core.train.train_module import TransformerTrainModule
from olmo_core.train.trainer import Trainer
from scheduler_oracle import build


class OracleTrainer:
    """What the callback and the scheduler read of a Trainer, its properties borrowed."""
    max_steps = Trainer.max_steps
    max_tokens = Trainer.max_tokens
    _get_max_steps = Trainer._get_max_steps
    _get_max_tokens = Trainer._get_max_tokens
    tokens_per_batch = Trainer.tokens_per_batch
    global_batch_size = Trainer.global_batch_size

    def __init__(self, data_loader, train_module, max_duration):
        self.data_loader, self.train_module, self.max_duration = data_loader, train_module, max_duration
        self.global_step, self.global_train_tokens_seen, self.epoch = 0, 0, 1
        self.callbacks = {}
        self.metrics = []

    def record_metric(self, name, value, *args, **kwargs):
        self.metrics.append((self.global_step, name, value))


def run(spec: dict, case: dict) -> dict:
    tokenizer = TokenizerConfig(vocab_size=spec["vocab_size"], eos_token_id=0, pad_token_id=0)
    dtype = NumpyFSLDatasetConfig(tokenizer=tokenizer, sequence_length=spec["seq_len"]).get_dtype()
    dataset = NumpyFSLDataset(*spec["paths"], sequence_length=spec["seq_len"], pad_token_id=0,
                              eos_token_id=0, vocab_size=spec["vocab_size"], dtype=dtype)
    dataset.work_dir = spec["work_dir"]
    dataset.prepare()
    # num_threads=0 reads instances in this thread, in the same order as one data thread.
    # A data thread left blocked on its queue when the script exits aborts CPython's
    # shutdown ("terminate called without an active exception") about one run in four.
    loader = NumpyFSLDataLoader(dataset, collator=DataCollator(pad_token_id=0),
                                global_batch_size=case["global_batch_size"], work_dir=spec["work_dir"],
                                seed=spec["seed"], shuffle=True, num_threads=0, num_workers=0)
    module = TransformerTrainModule.__new__(TransformerTrainModule)
    module.optim = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=case["lr"])
    module.scheduler = build(case["scheduler"])
    unit, value = case["duration"]
    trainer = OracleTrainer(loader, module, Duration(value=value, unit=unit))
    callback = BatchSizeSchedulerCallback(
        batch_sizes=case["batch_sizes"],
        schedule=[Duration.tokens(t) for t in case["schedule"]])
    callback.trainer = trainer
    callback.post_attach()  # Trainer.__post_init__
    loader.reshuffle(epoch=1)  # Trainer._fit_epoch
    order = np.asarray(loader.get_global_indices()).tolist()
    batches = iter(loader)
    group = module.optim.param_groups[0]
    sizes, indices, input_ids, lrs, complete_at = [], [], [], [], None
    for _ in range(case["steps"]):
        callback.pre_load_batch()  # Trainer._iter_batches
        batch = next(batches)
        trainer.global_step += 1
        trainer.global_train_tokens_seen += loader.global_num_tokens_in_batch(batch)
        lrs.append(float(module.scheduler.set_lr(group, trainer)))  # optim_step
        callback.post_step()
        sizes.append(int(batch["input_ids"].numel()))
        indices.append(batch["index"].tolist())
        input_ids.append(batch["input_ids"].tolist())
        if complete_at is None and trainer.max_duration.due(
                step=trainer.global_step, tokens=trainer.global_train_tokens_seen, epoch=1):
            complete_at = trainer.global_step
    logged = [v for _, name, v in trainer.metrics if name == "train/global batch size"]
    return {"sizes": sizes, "indices": indices, "input_ids": input_ids, "lrs": lrs,
            "complete_at": complete_at, "order": order, "logged": [int(v) for v in logged]}


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    warnings.simplefilter("ignore")
    out = [run(spec, case) for case in spec["cases"]]
    open(out_path, "w").write(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
