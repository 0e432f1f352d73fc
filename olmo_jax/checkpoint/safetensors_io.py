"""Reading and writing Hugging Face model folders with the safetensors numpy API (no
torch): config.json plus model.safetensors, or shards listed in
model.safetensors.index.json. bfloat16 tensors (which numpy cannot name) are read through
safetensors' flax backend and returned as ml_dtypes.bfloat16 numpy arrays.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from olmo_jax.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size


def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as e:  # the `hf` extra
        raise CheckpointError(
            "Hugging Face conversion needs the safetensors package: pip install 'olmo-jax[hf]'"
        ) from e
    return safetensors


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json: is it a Hugging Face model folder?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def safetensors_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder} has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); PyTorch "
            ".bin checkpoints are not read: re-save the model with safetensors"
        )
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{index} lists {f.name}, which does not exist")
    return files


def read_file(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, by name; CheckpointError naming the file when
    it is truncated or corrupt."""
    try:
        return _read_file(path)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' SafetensorError (and OSError) of a damaged file
        raise CheckpointError(
            f"safetensors file {path} is truncated or corrupt ({type(e).__name__}: {e}); "
            "download or copy it again"
        ) from e


def _read_file(path: Path) -> dict[str, np.ndarray]:
    st = _safetensors()
    tensors: dict[str, np.ndarray] = {}
    with st.safe_open(str(path), framework="numpy") as f:
        names = list(f.keys())
        bf16 = [n for n in names if f.get_slice(n).get_dtype() == "BF16"]
        for name in names:
            if name not in bf16:
                tensors[name] = f.get_tensor(name)
    if bf16:
        with st.safe_open(str(path), framework="flax") as f:
            for name in bf16:
                tensors[name] = np.asarray(f.get_tensor(name))
    return tensors


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors files, by name."""
    tensors: dict[str, np.ndarray] = {}
    for path in safetensors_files(folder):
        tensors.update(read_file(path))
    return tensors


def write_folder(
    folder: Path,
    config: dict,
    tensors: dict[str, np.ndarray],
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """config.json plus model.safetensors, or shards and an index past `max_shard_bytes`
    (the layout `save_pretrained` writes; metadata format=pt as transformers expects)."""
    st = _safetensors()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = np.ascontiguousarray(tensors[name])
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        st.numpy.save_file(shards[0], str(folder / SINGLE_FILE), metadata=metadata)
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        st.numpy.save_file(shard, str(folder / fname), metadata=metadata)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
