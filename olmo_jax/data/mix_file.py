"""OLMo-core's mix files (`olmo_core/data/mixes/*.txt`) for `data.mix`.

A mix file lists one token file a line as `label,path`, the path relative to a root
(`data.mix_root`, OLMo-core's `mix_base_dir`) and usually holding a `{TOKENIZER}`
placeholder for the tokenizer's folder name (`data.mix_tokenizer`); blank lines and lines
starting with `#` are skipped. `data.mix` is a path to such a file, or the name of one that
OLMo-core ships (`OLMo-mix-0925-official`), read from the installed `ai2-olmo-core` package
when there is one: it is located, never imported, and nothing is copied from it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from olmo_jax import storage
from olmo_jax.errors import DataError

PLACEHOLDER = "{TOKENIZER}"
MAX_LISTED = 5  # missing files named in the error


@dataclass(frozen=True)
class MixLine:
    label: str
    path: str  # resolved: root joined, {TOKENIZER} substituted
    line: int  # 1-based line number in the mix file
    text: str  # the line as written


def shipped_mix_dir() -> Path | None:
    """`olmo_core/data/mixes` of the installed ai2-olmo-core, found without importing it
    (OLMo-core imports torch); None when it is not installed."""
    try:
        spec = importlib.util.find_spec("olmo_core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "mixes"
    return folder if folder.is_dir() else None


def shipped_mixes() -> list[str]:
    folder = shipped_mix_dir()
    return sorted(p.stem for p in folder.glob("*.txt")) if folder else []


def find_mix(name_or_file: str) -> Path:
    """The mix file `data.mix` names: an existing file, else a mix shipped with the
    installed OLMo-core."""
    if storage.is_remote(name_or_file):  # a mix file in a bucket
        return name_or_file  # type: ignore[return-value]
    path = Path(name_or_file).expanduser()
    if path.is_file():
        return path
    folder = shipped_mix_dir()
    if folder is not None and (folder / f"{os.path.basename(name_or_file)}.txt").is_file():
        return folder / f"{os.path.basename(name_or_file)}.txt"
    if folder is None:
        where = ("ai2-olmo-core is not installed, so OLMo-core's shipped mixes cannot be "
                 "named; install it (pip install ai2-olmo-core) or give the path of a mix file")
    else:
        where = f"OLMo-core's shipped mixes ({folder}) are: {', '.join(shipped_mixes())}"
    raise DataError(f"data.mix={name_or_file!r} is neither a file nor a mix OLMo-core ships; "
                    f"{where}")


def read_mix(name_or_file: str, root: str, tokenizer: str) -> list[MixLine]:
    """The lines of mix `name_or_file`, each path joined to `root` with `{TOKENIZER}`
    replaced by `tokenizer`. Errors name the field, the file and the line."""
    mix_path = find_mix(name_or_file)
    if not root:
        raise DataError(f"data.mix={name_or_file!r} lists paths relative to a root; set "
                        "data.mix_root to the folder that holds them (OLMo-core's mix_base_dir)")
    lines = []
    try:
        mix_text = storage.read_text(mix_path)
    except (OSError, ValueError) as e:
        raise DataError(f"data.mix={name_or_file!r}: " + storage.storage_error(mix_path, e)) from None
    for number, text in enumerate(mix_text.splitlines(), start=1):
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        parts = stripped.split(",")
        if len(parts) != 2 or not all(p.strip() for p in parts):
            raise DataError(f"{mix_path} line {number}: {text!r} is not `label,path`")
        label, rel = (p.strip() for p in parts)
        if PLACEHOLDER in rel:
            if not tokenizer:
                raise DataError(
                    f"data.mix={name_or_file!r}: its paths hold {PLACEHOLDER} (line {number}: "
                    f"{text!r}); set data.mix_tokenizer to the tokenizer folder the files "
                    "were made with (e.g. 'allenai/dolma3-tokenizer', which OLMo-core uses "
                    "for the OLMo 3 mixes with its dolma2 tokenizer)")
            rel = rel.replace(PLACEHOLDER, tokenizer)
        lines.append(MixLine(label, storage.join(root, rel), number, text))
    if not lines:
        raise DataError(f"data.mix={name_or_file!r}: {mix_path} lists no `label,path` lines")
    return lines


def check_exist(lines: list[MixLine], name: str) -> None:
    """DataError naming up to MAX_LISTED mix lines whose files do not exist."""
    try:
        missing = [m for m in lines if not storage.is_file(m.path)]
    except (OSError, ValueError) as e:
        raise DataError(f"data.mix={name!r}: " + storage.storage_error(lines[0].path, e)) from None
    if not missing:
        return
    listed = "\n".join(f"  label {m.label!r}: {m.path} (line {m.line}: {m.text.strip()})"
                       for m in missing[:MAX_LISTED])
    more = f"\n  ... and {len(missing) - MAX_LISTED} more" if len(missing) > MAX_LISTED else ""
    raise DataError(
        f"data.mix={name!r}: {len(missing)} of its {len(lines)} token files do not exist under "
        f"data.mix_root:\n{listed}{more}\nfix data.mix_root / data.mix_tokenizer, or fetch "
        "the files")
