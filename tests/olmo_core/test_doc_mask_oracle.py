"""Document masking's data and RoPE against OLMo-core's own (ai2-olmo-core in .venv-oracle,
by subprocess): on the same token files, olmo_jax's loader cuts each instance into the
documents `NumpyFSLDataset(generate_doc_lengths=True)` emits (`doc_lens`), the step's
segment ids (objective.document_segments) number the same documents, and the RoPE of the
packed rows (positions restarting at each document: rope.document_positions) equals
OLMo-core's `RotaryEmbedding` with the batch's `cu_doc_lens`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from olmo_jax.data import TokenFile, TokenWindows, dtype_for_vocab, write_token_file
from olmo_jax.data.loader import document_lengths
from olmo_jax.model.config import TransformerConfig
from olmo_jax.model.rope import apply_rope, document_positions, rope_tables_batch
from olmo_jax.objective import document_segments

ROOT = Path(__file__).resolve().parents[2]
ORACLE_PY = ROOT / ".venv-oracle" / "bin" / "python"
pytestmark = pytest.mark.skipif(not ORACLE_PY.exists(), reason="no .venv-oracle (make oracle)")

SEQ_LEN, VOCAB, EOS, HEADS, HEAD_SIZE, THETA = 48, 300, 7, 2, 16, 10_000.0


def test_document_lengths_segments_and_rope_match_olmo_core(tmp_path):
    rng = np.random.default_rng(29)
    paths = []
    for k, n_docs in enumerate([9, 23]):  # documents of 1 to 70 tokens, each ending in EOS
        docs = [np.append(rng.integers(EOS + 1, VOCAB, int(rng.integers(0, 70))), EOS)
                for _ in range(n_docs)]
        tokens = np.concatenate(docs)
        if k == 1:  # an instance ending in EOS, one starting with it, and EOS, EOS
            tokens[SEQ_LEN - 1] = tokens[2 * SEQ_LEN] = tokens[3 * SEQ_LEN + 5] = EOS
            tokens[3 * SEQ_LEN + 6] = EOS
        paths.append(str(tmp_path / f"part-{k}.npy"))
        write_token_file(paths[-1], tokens, dtype_for_vocab(VOCAB))
    windows = TokenWindows([TokenFile(p, dtype_for_vocab(VOCAB), VOCAB) for p in paths], SEQ_LEN)
    inputs_NT = windows.read(range(len(windows)))[:, :-1]
    N = len(inputs_NT)
    q, k = (rng.standard_normal((N, SEQ_LEN, HEADS, HEAD_SIZE)).astype(np.float32)
            for _ in range(2))
    np.savez(tmp_path / "in.npz", q=q, k=k)
    (tmp_path / "spec.json").write_text(json.dumps({
        "paths": paths, "vocab_size": VOCAB, "seq_len": SEQ_LEN, "eos": EOS,
        "head_size": HEAD_SIZE, "theta": THETA, "work_dir": str(tmp_path)}))
    subprocess.run([str(ORACLE_PY), str(Path(__file__).with_name("doc_oracle.py")),
                    str(tmp_path / "spec.json"), str(tmp_path / "in.npz"),
                    str(tmp_path / "out.npz")], check=True, cwd=tmp_path, timeout=300)
    ref = np.load(tmp_path / "out.npz")

    np.testing.assert_array_equal(inputs_NT, ref["input_ids"])  # the same instances
    segments_NT = np.asarray(document_segments(
        jnp.asarray(inputs_NT), TransformerConfig(vocab_size=VOCAB, doc_mask_eos=EOS)))
    for n in range(N):
        theirs = ref["doc_lens"][n][ref["doc_lens"][n] > 0]
        np.testing.assert_array_equal(document_lengths(inputs_NT[n], EOS), theirs)
        np.testing.assert_array_equal(np.bincount(segments_NT[n]), theirs)
    assert max(len(document_lengths(row, EOS)) for row in inputs_NT) >= 3  # packed rows

    cos, sin = rope_tables_batch(document_positions(jnp.asarray(segments_NT)), HEAD_SIZE, THETA)
    np.testing.assert_allclose(apply_rope(jnp.asarray(q), cos, sin), ref["q"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(apply_rope(jnp.asarray(k), cos, sin), ref["k"], atol=1e-6, rtol=0)
