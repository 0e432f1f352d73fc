"""What a dispatch backend hands the MoE layer: the buffer of rows the experts run on,
how its rows are grouped by expert, and the function that takes the experts' output
rows back to the tokens.

    d = backend(x_SD, routing, cfg, padding)       # moves tokens only
    y_RD = ffn.expert_ffn(d.x_RD, d.layout, ...)   # the MoE layer, once
    y_SD = d.combine(y_RD)                         # float32, router weights applied

Group layouts (sizes: olmo_jax/model/moe/sizing.py):
  Runs   dropless: group g's sizes_E[g] rows form one run, runs in group order, each
         padded with zero rows to a multiple of `multiple` rows (1: back to back);
         rows after the last run are zeros. `balanced_rows`: the rows the groups hold
         under balanced routing (the grouped-matmul kernels declare their cost over them:
         an expert-parallel buffer is sized for the worst case, olmo_jax/kernels/
         grouped_matmul.py `priced`); 0: the whole buffer.
  Slots  capacity: group g owns `capacity` rows, [g * capacity, (g + 1) * capacity);
         with `senders` S > 1 the rows are sender-major, [S, groups, capacity / S] (as
         an expert-parallel all_to_all delivers them, olmo_jax/kernels/slot_layout.py):
         group g owns slot g of every sender.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Runs:
    sizes_E: jax.Array  # int32 rows per group, before padding
    multiple: int = dataclasses.field(metadata={"static": True})
    balanced_rows: int = dataclasses.field(default=0, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    groups: int = dataclasses.field(metadata={"static": True})
    capacity: int = dataclasses.field(metadata={"static": True})  # rows per group
    senders: int = dataclasses.field(default=1, metadata={"static": True})


GroupLayout = Runs | Slots


class Dispatched(NamedTuple):
    x_RD: jax.Array  # the rows the experts run on, in the compute dtype
    layout: GroupLayout
    combine: Callable[[jax.Array], jax.Array]  # y_RD -> y_SD float32
    dropped: jax.Array  # float32 (token, choice) assignments dropped at capacity
