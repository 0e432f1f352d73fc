"""The embedded default corpus: the running Python's standard library, byte-tokenized.

No downloads: every `.py` file under `sysconfig.get_paths()["stdlib"]` (except
`site-packages` / `dist-packages`), in sorted relative-path order, is one document; its
bytes as stored are its tokens (for UTF-8 source, exactly `ByteTokenizer().encode(text)`),
and EOS follows each document. CPython 3.12 gives about 32M tokens.

`stdlib_corpus(cache_dir)` builds the uint16 token file once and caches it under a name
holding the Python version and a fingerprint of the file list (paths, sizes, mtimes), so
another Python, or an edited stdlib, builds its own file.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from pathlib import Path

import numpy as np

from olmo_jax.data.token_file import write_token_file
from olmo_jax.data.tokenizer import ByteTokenizer

CORPUS_DTYPE = np.dtype(np.uint16)
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path) -> list[Path]:
    """The corpus documents: `.py` files under `root`, sorted by relative path."""
    relative_paths = sorted(
        path.relative_to(root)
        for path in root.rglob("*.py")
        if path.is_file() and not EXCLUDED_DIRS.intersection(path.relative_to(root).parts)
    )
    return [root / rel for rel in relative_paths]


def corpus_fingerprint(root: Path, sources: list[Path]) -> str:
    """A hash of each source's relative path, size and mtime."""
    digest = hashlib.sha256()
    for path in sources:
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def stdlib_corpus(cache_dir: str | Path) -> Path:
    """The path of the cached stdlib token file under `cache_dir`, built if missing."""
    root = stdlib_root()
    sources = stdlib_sources(root)
    fingerprint = corpus_fingerprint(root, sources)
    path = Path(cache_dir) / f"stdlib-py{platform.python_version()}-{fingerprint}.uint16.npy"
    if path.is_file():
        return path
    eos = np.array([ByteTokenizer.eos_id], dtype=CORPUS_DTYPE)
    pieces: list[np.ndarray] = []
    for source in sources:
        pieces.append(np.frombuffer(source.read_bytes(), dtype=np.uint8))
        pieces.append(eos)
    write_token_file(path, np.concatenate(pieces, dtype=CORPUS_DTYPE), CORPUS_DTYPE)
    return path
