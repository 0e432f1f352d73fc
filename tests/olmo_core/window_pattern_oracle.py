"""OLMo-core's per-layer sliding-window resolution as the oracle (run in .venv-oracle,
never imported by the product): `python window_pattern_oracle.py IN.json OUT.json`.

IN: a list of cases {n_layers, pattern, first, last}. OUT: per case, each layer's window as
OLMo-core's AttentionConfig builds that layer's Attention with
`sliding_window=SlidingWindowAttentionConfig(pattern, force_full_attention_on_first_layer=
first, force_full_attention_on_last_layer=last)` (its `window_size`, -1 where the layer is
full); under "olmo3_7B" the sliding-window settings of OLMo-core's OLMo 3 7B preset; under
"positions" its `_causal_attention_positions(s, w)` (the pairs its FLOPs count) for the
(s, w) of IN's "positions" (w 0 = None)."""

import json
import sys

from olmo_core.nn.attention import (
    AttentionConfig,
    SlidingWindowAttentionConfig,
    _causal_attention_positions,
)
from olmo_core.nn.transformer import TransformerConfig


def layer_windows(n_layers, pattern, first, last):
    swa = SlidingWindowAttentionConfig(pattern=list(pattern),
                                       force_full_attention_on_first_layer=first,
                                       force_full_attention_on_last_layer=last)
    cfg = AttentionConfig(n_heads=2, sliding_window=swa)
    out = []
    for i in range(n_layers):
        attn = cfg.build(16, layer_idx=i, n_layers=n_layers, init_device="meta")
        out.append(attn.window_size if attn.window_size is not None else -1)
    return out


def main(in_path: str, out_path: str) -> None:
    spec = json.load(open(in_path))
    cases = spec["cases"]
    swa = TransformerConfig.olmo3_7B(vocab_size=100_352).block.sequence_mixer.sliding_window
    result = {
        "cases": [layer_windows(c["n_layers"], c["pattern"], c["first"], c["last"])
                  for c in cases],
        "olmo3_7B": {"pattern": list(swa.pattern),
                     "first": swa.force_full_attention_on_first_layer,
                     "last": swa.force_full_attention_on_last_layer},
        "positions": [_causal_attention_positions(s, w or None) for s, w in spec["positions"]],
    }
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
