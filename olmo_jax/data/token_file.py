"""OLMo-core token files: flat, headerless arrays of token ids (the name usually ends in
`.npy`, but there is no NumPy header), of the smallest of uint8, uint16 and uint32 that
holds the vocabulary's largest id (OLMo-core's `get_dtype` rule). Documents inside a file
are separated by EOS.

`TokenFile` opens one read-only and checks it: size against the dtype on open, token ids
against the vocabulary on every read (and over the whole file on open for files under
`FULL_CHECK_BYTES`). Reads are `os.pread`s of the open file, after a check (`fstat`) that
it still has the size and modification time it was opened with: a file truncated,
extended or rewritten under a running job is a DataError naming it, never a SIGBUS of a
memory-mapped page past its end. `write_token_file` writes one atomically.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from olmo_jax import storage
from olmo_jax.errors import DataError

TOKEN_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))
FULL_CHECK_BYTES = 64 * 2**20  # files smaller than this are range-checked in full on open


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest token dtype holding id `vocab_size - 1` (OLMo-core: uint8 up to 256
    ids, uint16 up to 65,536, else uint32)."""
    if vocab_size <= 0:
        raise DataError(f"vocab_size={vocab_size} must be positive")
    fits = [d for d in TOKEN_DTYPES if vocab_size - 1 <= np.iinfo(d).max]
    if not fits:
        raise DataError(f"vocab_size={vocab_size} does not fit a uint32 token file")
    return fits[0]


def token_dtype(dtype: str | np.dtype | type) -> np.dtype:
    """The token dtype named by `dtype`, which must be uint8, uint16 or uint32."""
    names = ", ".join(f"'{d.name}'" for d in TOKEN_DTYPES)
    try:
        resolved = np.dtype(dtype)
    except TypeError as e:
        raise DataError(f"data.dtype={dtype!r} is not a dtype; use one of {names}") from e
    if resolved not in TOKEN_DTYPES:
        raise DataError(f"data.dtype={dtype!r}: token files are {names}")
    return resolved


class TokenFile:
    """A read-only memory map of one token file; `len()` tokens, `file[a:b]` reads int32."""

    def __init__(self, path: str | Path, dtype: str | np.dtype, vocab_size: int):
        self.path = Path(path)
        self.dtype = token_dtype(dtype)
        self.vocab_size = vocab_size
        if self.path.is_dir():
            raise DataError(
                f"token file {self.path} is a directory; list the token files in it, "
                f"e.g. {self.path}/part-0.npy (data.paths takes files)"
            )
        if not self.path.is_file():
            raise DataError(
                f"token file {self.path} does not exist; make one from text files with "
                "`python -m olmo_jax.tokenize INPUTS -o OUTPUT`"
            )
        n_bytes = self.path.stat().st_size
        if n_bytes == 0:
            raise DataError(f"token file {self.path} is empty; re-create it or remove it")
        if n_bytes % self.dtype.itemsize:
            others = [d.name for d in TOKEN_DTYPES
                      if d != self.dtype and n_bytes % d.itemsize == 0]
            hint = "it is truncated or not a token file; re-create it"
            if others:
                hint = (f"if it was written as {others[-1]}, set data.dtype='{others[-1]}'; "
                        f"otherwise {hint}")
            raise DataError(
                f"token file {self.path} has {n_bytes} bytes, not a whole number of "
                f"{self.dtype.name} tokens ({self.dtype.itemsize} bytes each); {hint}"
            )
        self._fd = os.open(self.path, os.O_RDONLY)
        opened = os.fstat(self._fd)
        self._opened = (opened.st_size, opened.st_mtime_ns)
        self._n = opened.st_size // self.dtype.itemsize
        if n_bytes < FULL_CHECK_BYTES:
            self[0:self._n]  # every token against the vocabulary

    @property
    def tokens(self) -> np.ndarray:
        """The whole file as a read-only array (a memory map: for inspection, not training)."""
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self._n,))

    def __len__(self) -> int:
        return self._n

    def _changed(self, detail: str) -> DataError:
        return DataError(
            f"token file {self.path} changed while the run was reading it ({detail}); a token "
            "file must not be rewritten or truncated during a run: restore it (the run resumes "
            "from its last checkpoint), or write new data to a new file and start a new run"
        )

    def __getitem__(self, span: slice) -> np.ndarray:
        """Tokens `span` (a slice with step 1) as int32, checked against the vocabulary;
        DataError if the file changed since it was opened."""
        start, stop, step = span.indices(self._n)
        if step != 1:
            raise ValueError(f"TokenFile reads contiguous slices; got step {step}")
        now = os.fstat(self._fd)
        if (now.st_size, now.st_mtime_ns) != self._opened:
            size = self._opened[0]
            raise self._changed(f"{size} bytes when opened, {now.st_size} now" if
                                now.st_size != size else "modified since it was opened")
        n_bytes = max(stop - start, 0) * self.dtype.itemsize
        data = os.pread(self._fd, n_bytes, start * self.dtype.itemsize)
        if len(data) != n_bytes:  # shrank between the check and the read
            raise self._changed(f"a read at token {start} came back short")
        tokens_N = np.frombuffer(data, self.dtype)
        self._check_vocab(tokens_N, offset=start)
        return tokens_N.astype(np.int32)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def _check_vocab(self, tokens_N: np.ndarray, offset: int) -> None:
        if len(tokens_N) == 0 or tokens_N.max() < self.vocab_size:
            return
        first_bad = int(np.argmax(tokens_N >= self.vocab_size))
        raise DataError(
            f"token file {self.path}: token {int(tokens_N[first_bad])} at offset "
            f"{offset + first_bad} is >= vocab_size {self.vocab_size}; the file was made with "
            f"a larger vocabulary (set data.vocab_size / data.tokenizer to match it) or is not "
            f"{self.dtype.name} (set data.dtype)"
        )

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self.dtype.name}, {len(self)} tokens)"


def write_token_file(
    path: str | Path, tokens: np.ndarray | Iterable[np.ndarray], dtype: str | np.dtype
) -> int:
    """Writes `tokens` (one array, or an iterable of arrays written back to back) to `path`
    as a headerless `dtype` array, atomically (a temp file in the same folder, then
    `os.replace`). Returns the number of tokens written."""
    path = Path(path)
    dtype = token_dtype(dtype)
    chunks = [tokens] if isinstance(tokens, np.ndarray) else tokens
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    n_tokens = 0
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                chunk_N = np.asarray(chunk)
                if chunk_N.size and (chunk_N.min() < 0 or chunk_N.max() > np.iinfo(dtype).max):
                    raise DataError(
                        f"writing {path}: token ids span [{chunk_N.min()}, {chunk_N.max()}], "
                        f"which does not fit {dtype.name}; use a wider token dtype (uint32 holds any vocabulary)"
                    )
                chunk_N.astype(dtype, copy=False).tofile(f)
                n_tokens += chunk_N.size
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return n_tokens


class RemoteTokenFile:
    """A token file in an object store (`s3://`, `gs://`), read like `TokenFile` (`len()`,
    `file[a:b]` as int32, checked against the vocabulary on every read) by byte ranges
    through a bounded `storage.RangeCache`: never downloaded whole."""

    def __init__(self, path: str, dtype: str | np.dtype, vocab_size: int,
                 cache: storage.RangeCache):
        self.path = str(path)
        self.dtype = token_dtype(dtype)
        self.vocab_size = vocab_size
        self.cache = cache
        try:
            self.n_bytes = storage.size(self.path)
        except (OSError, ValueError) as e:
            raise DataError(storage.storage_error(self.path, e, "token file")) from None
        if self.n_bytes == 0:
            raise DataError(f"token file {self.path} is empty; re-create it or remove it")
        if self.n_bytes % self.dtype.itemsize:
            raise DataError(
                f"token file {self.path} has {self.n_bytes} bytes, not a whole number of "
                f"{self.dtype.name} tokens ({self.dtype.itemsize} bytes each); set data.dtype "
                "to the dtype it was written with, or re-create it")

    def __len__(self) -> int:
        return self.n_bytes // self.dtype.itemsize

    def __getitem__(self, span: slice) -> np.ndarray:
        start, stop, step = span.indices(len(self))
        if step != 1:
            raise ValueError(f"RemoteTokenFile reads contiguous slices; got step {step}")
        size = self.dtype.itemsize
        try:
            raw = self.cache.read(self.path, start * size, max(start, stop) * size, self.n_bytes)
        except (OSError, ValueError) as e:
            raise DataError(storage.storage_error(self.path, e, "token file")) from None
        tokens_N = np.frombuffer(raw, dtype=self.dtype)
        TokenFile._check_vocab(self, tokens_N, offset=start)  # type: ignore[arg-type]
        return tokens_N.astype(np.int32)

    def prefetch(self, spans: list[tuple[int, int]]) -> None:
        """Fetches token ranges [start, stop) into the cache in one concurrent request
        batch (TokenWindows.read calls it with a batch's windows)."""
        size = self.dtype.itemsize
        try:
            self.cache.prefetch(self.path, [(a * size, min(b, len(self)) * size) for a, b in spans],
                                self.n_bytes)
        except (OSError, ValueError) as e:
            raise DataError(storage.storage_error(self.path, e, "token file")) from None

    def __repr__(self) -> str:
        return f"RemoteTokenFile({self.path!r}, {self.dtype.name}, {len(self)} tokens)"


def open_token_file(path: str | Path, dtype: str | np.dtype, vocab_size: int,
                    cache: storage.RangeCache | None = None) -> TokenFile | RemoteTokenFile:
    """`RemoteTokenFile` for an object-store URL (through `cache`), else `TokenFile`."""
    if storage.is_remote(path):
        return RemoteTokenFile(str(path), dtype, vocab_size,
                               cache if cache is not None else storage.RangeCache(256 << 20))
    return TokenFile(Path(path).expanduser(), dtype, vocab_size)
