"""Per-cell results of the GPU compile matrix, shared by the xdist workers (which write
one JSON file per cell under .artifacts/gpu_compile_matrix/) and the controller (which
prints them as a table at the end of the session, tests/gpu/conftest.py)."""

import json
from pathlib import Path

DIR = Path(__file__).resolve().parents[2] / ".artifacts" / "gpu_compile_matrix"


def clear() -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    for f in DIR.glob("*.json"):
        f.unlink()


def record(cell_id: str, status: str, lower_s: float = 0.0, compile_s: float = 0.0,
           note: str = "") -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    row = {"id": cell_id, "status": status, "lower_s": lower_s, "compile_s": compile_s,
           "note": note}
    (DIR / f"{cell_id}.json").write_text(json.dumps(row))


def table() -> list[str]:
    rows = [json.loads(f.read_text()) for f in sorted(DIR.glob("*.json"))]
    out = [f"{r['id']:<36} {r['status']:<8} {r['lower_s']:5.1f} {r['compile_s']:5.1f}  "
           f"{r['note'][:150]}" for r in rows]
    if rows:
        total = sum(r["lower_s"] + r["compile_s"] for r in rows)
        out.append(f"{len(rows)} cells; build + lower + compile {total:.0f} s in all (wall)")
    return out
