"""Reads back a W&B offline run folder's `run-<id>.wandb` file (what `wandb sync` uploads):
LevelDB-log framing (a 7-byte ':W&B' header, 32 KiB blocks of records with a CRC-32 /
length / type header, FULL / FIRST / MIDDLE / LAST pieces) around wandb's own `Record`
protobufs (wandb.proto.wandb_internal_pb2)."""

import json
import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, pos, pieces = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, "bad CRC"
        pieces = payload if kind in (FULL, FIRST) else pieces + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            out.append(record)
    return out


def run_file(run_dir: Path) -> Path:
    (path,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    return path


def history(path: Path) -> dict[int, dict]:
    """{step: {key: value}} of every history record ('/'.join of nested keys)."""
    out: dict[int, dict] = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            out.setdefault(int(row["_step"]), {}).update(row)
    return out


def config(path: Path) -> dict:
    """The run's config, as logged with the run record."""
    (run,) = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
    return {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
