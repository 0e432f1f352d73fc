"""The per-layer windows of model.window_pattern against OLMo-core's own resolution
(ai2-olmo-core in .venv-oracle, by subprocess: the window_size each layer's Attention is
built with, window_pattern_oracle.py) over patterns, depths and both forced-full flags;
and configs/olmoe3_47b_long.py's window settings are OLMo-core's OLMo 3 preset's."""

from __future__ import annotations

import itertools
import json
import runpy
import subprocess
from pathlib import Path

import pytest

from olmo_jax import metrics
from olmo_jax.config import model_config
from olmo_jax.model.config import TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

PATTERNS = [(4096, 4096, 4096, -1), (8, -1), (16,), (-1, 32, 64), (5, 5, -1, 7, -1)]
CASES = [dict(n_layers=n, pattern=list(p), first=f, last=last)
         for p, n, f, last in itertools.product(PATTERNS, (1, 2, 5, 8, 63), (True, False),
                                                (True, False))]
POSITIONS = [[s, w] for s in (1, 7, 64, 65_536) for w in (0, 1, 3, 64, 4096, 100_000)]


def test_layer_windows_match_olmo_core(tmp_path):
    (tmp_path / "in.json").write_text(json.dumps({"cases": CASES, "positions": POSITIONS}))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("window_pattern_oracle.py")),
                    str(tmp_path / "in.json"), str(tmp_path / "out.json")], check=True,
                   cwd=tmp_path, timeout=300)
    out = json.loads((tmp_path / "out.json").read_text())
    for case, want in zip(CASES, out["cases"], strict=True):
        cfg = TransformerConfig(n_layers=case["n_layers"], window_pattern=tuple(case["pattern"]),
                                window_full_first=case["first"], window_full_last=case["last"])
        assert list(cfg.validate().layer_windows) == [0 if w == -1 else w for w in want], case
    assert any(-1 in w and any(x > 0 for x in w) for w in out["cases"])  # mixed layers
    # the (query, key) pairs the FLOPs count (olmo_jax/metrics.py)
    assert [metrics.attention_positions(s, w) for s, w in POSITIONS] == out["positions"]
    # the long-context config follows OLMo 3's preset
    long = model_config(runpy.run_path(str(ROOT / "configs" / "olmoe3_47b_long.py"))[
        "get_config"](), 100_352)
    preset = out["olmo3_7B"]
    assert (list(long.window_pattern), long.window_full_first, long.window_full_last) == (
        preset["pattern"], preset["first"], preset["last"])
