"""Single-device model math in Flax NNX; sharding appears only as logical axis names.

    from olmo_jax.model import Transformer, TransformerConfig, MoEConfig

Dimension legend (the one table for the whole package). A name's suffix after its last
`_` lists its axes in order, one letter per axis: `x_BTD` is [B, T, D], `idx_Sk` is
[S, k], `m_BKM1` is [B, K, M, 1]. Public functions declare these shapes with
`olmo_jax.shapes.check`, which tests verify at trace time (OLMO_JAX_SHAPE_CHECKS=1).

  A      attended (key/value) positions in attention (k_BAKH, scores s_BKMA)
  B      batch rows: the sequences of a (micro)batch, or of this process' slice of it
  C      capacity: rows per expert in a capacity buffer (x_ECD)
  D      d_model, the residual width
  E      experts held by the array: all of them, or an expert-parallel rank's local ones
  F      feed-forward hidden width (dense MLP, one expert, the shared experts)
  G      query heads per kv head in grouped-query attention (G = N / K)
  H      head dim (also the RoPE tables cos_TH)
  I      microbatches of a pipeline step
  J      a fused last axis of concatenated parts: [q|k|v] (N + 2K)·H, [gate|up] 2F, an
         MXFP8 payload row [values|scales] D + D/32 (any payload width)
  K      kv heads
  L      layers (stacked blocks; per-MoE-layer statistics)
  M      rows of one batched matmul: in attention a kv head's query rows (G heads x a
         chunk of positions)
  N      query heads
  P      parts: the ranks of a mesh axis (pipeline stages, all_to_all peers) or the
         shards of the batch rows
  Q      sub-parts of each part P (slices per peer of a ragged all_to_all; row groups
         within a device's shard)
  R      rows of an expert-grouped buffer: the rows the experts run on (sorted, padded,
         blocked or capacity layout; the receive buffer)
  S      tokens: a flat run of tokens (B·T in the model; a file's tokens in data/)
  T      positions in a sequence (attention: the query positions)
  U      blocks of the blocked dropless layout (each b rows, one expert)
  V      vocabulary
  W      steps: a window or record of training steps (the guard's ring buffers, logged
         steps)
  X      a data row: seq_len + 1 ints (a token window, or seq_len tokens + a label
         sentinel; batch_BX; inputs [:, :-1] and targets [:, 1:] are _BT)
  Y      rows a rank sends or gathers across the expert axis (the allgathered tokens,
         the ragged send/return buffers)
  Z      expert groups of group-limited routing
  k      top-k choices per token
  b      rows per block (blocked layout)
  z      expert groups kept per token (topk_group)
  e      experts per expert group (E / Z)
  h      half the head dim (RoPE frequencies, H / 2)
  digits a literal size: m_BKM1 keeps an axis of 1, best_SZ2 the top 2

GEMM scope, the one exception: inside olmo_jax/kernels/ (grouped_matmul.py, mxfp8_quant.py),
olmo_jax/model/mxfp8_gemm.py (the MXFP8 GEMM layouts) and olmo_jax/optim/muon.py, matrix
letters are used instead: M rows, K contracting dim, N columns of one GEMM, G groups (a
stack of matrices: the experts of a grouped matmul), T row tiles of grouped_matmul's
TileSchedule. A caller binds them to its own letters per call
(`grouped_matmul(x_RD, w_EDF, group_sizes_E)` binds M=R, K=D, N=F, G=E).
`process_I` in file-name templates is not a shape.
"""

from olmo_jax.model.config import MoEConfig, TransformerConfig
from olmo_jax.model.transformer import Output, Transformer

__all__ = ["MoEConfig", "Output", "Transformer", "TransformerConfig"]
