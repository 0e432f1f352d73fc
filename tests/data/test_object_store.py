"""Token files and mix files in an object store (olmo_jax/storage.py,
data/token_file.py `RemoteTokenFile`), against a real S3-compatible server: moto's server
mode, started once for the module on 127.0.0.1 (a free port), with the credentials and
`AWS_ENDPOINT_URL` in the environment, the standard way.

- The loader reads the same batches from `s3://` paths as from the same files on disk,
  for plain paths, a source mixture with globs, and a mix file kept in the bucket; a
  training run from the bucket logs the same losses as from disk.
- Token files are read by byte ranges through a bounded cache: reading a few windows of a
  file larger than the cache fetches a fraction of it and holds at most the bound.
- A missing bucket, a missing object and denied access get one error naming the path.
- The credentials appear neither in the run folder nor in the run's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from rich.console import Console  # noqa: E402

from olmo_jax import config as config_lib  # noqa: E402
from olmo_jax import storage  # noqa: E402
from olmo_jax.data import build_data, write_token_file  # noqa: E402
from olmo_jax.data.token_file import RemoteTokenFile  # noqa: E402
from olmo_jax.errors import ConfigError, DataError  # noqa: E402
from tests import moto_s3  # noqa: E402

KEY_ID, SECRET = moto_s3.KEY_ID, moto_s3.SECRET
BUCKET = "tokens"
SEQ_LEN, B, VOCAB = 16, 4, 8000


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with bucket `tokens` holding the local tree under
    `data/`; yields (local root, 's3://tokens/data'). The environment carries the
    credentials and the endpoint for the module's tests."""
    with moto_s3.server() as endpoint, moto_s3.environment(endpoint):
        root = tmp_path_factory.mktemp("tree")
        rng = np.random.default_rng(0)
        for k, n in enumerate([200, 333, 150]):
            write_token_file(root / f"web/part-{k}.npy", rng.integers(0, VOCAB, n), "uint16")
        for k, n in enumerate([100, 90]):
            write_token_file(root / f"code/sub/part-{k}.npy", rng.integers(0, VOCAB, n), "uint16")
        # larger than the cache the range test gives it: 1 MiB of uint32
        write_token_file(root / "big.npy", rng.integers(0, VOCAB, 1 << 18), "uint32")
        (root / "mix.txt").write_text(
            "# a mix in OLMo-core's format\n"
            + "".join(f"web,data/{{TOKENIZER}}/web/part-{k}.npy\n" for k in range(3))
            + "".join(f"code,data/{{TOKENIZER}}/code/sub/part-{k}.npy\n" for k in range(2)))
        fs = storage.filesystem("s3://")
        fs.mkdir(BUCKET)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                fs.put_file(str(path), f"{BUCKET}/data/{path.relative_to(root)}")
                # the mix's {TOKENIZER} folder
                if path.suffix == ".npy" and path.name != "big.npy":
                    fs.put_file(str(path), f"{BUCKET}/data/tok/{path.relative_to(root)}")
        yield root, f"s3://{BUCKET}/data"


def _batches(cfg: dict, steps: int = 6, rows=None) -> list[np.ndarray]:
    d = build_data({"vocab_size": VOCAB, **cfg}, SEQ_LEN, B, seed=3)
    return [d.train.batch(s, rows) for s in range(steps)], d


def test_same_batches_from_the_bucket_as_from_disk(s3):
    local, remote = s3
    names = [f"web/part-{k}.npy" for k in range(3)]
    disk, _ = _batches({"paths": ",".join(str(local / n) for n in names)})
    bucket, d = _batches({"paths": ",".join(f"{remote}/{n}" for n in names)})
    assert type(d.windows.files[0]).__name__ == "RemoteTokenFile"
    # only the windows' bytes are fetched: one block (seq_len uint16 tokens) per window read
    read = {int(d.train._order[p]) for p in range(6 * B)}
    assert d.windows.files[0].cache.fetched_bytes == len(read) * SEQ_LEN * 2
    np.testing.assert_array_equal(np.stack(disk), np.stack(bucket))
    # one process's rows, as a multi-process run reads them
    rows = slice(1, 3)
    np.testing.assert_array_equal(
        np.stack(_batches({"paths": str(local / names[1])}, rows=rows)[0]),
        np.stack(_batches({"paths": f"{remote}/{names[1]}"}, rows=rows)[0]))


def test_same_mixture_from_the_bucket_as_from_disk(s3):
    local, remote = s3

    def mixture(base):
        return {"sources": {"code": {"paths": f"{base}/code/**/*.npy", "target_ratio": 0.4,
                                     "max_repetition_ratio": 2.0},
                            "web": {"paths": f"{base}/web/*.npy", "target_ratio": 0.6}},
                "requested_tokens": 40 * SEQ_LEN, "repetition_filter": True}

    disk, d_disk = _batches(mixture(local))
    bucket, d_bucket = _batches(mixture(remote))
    np.testing.assert_array_equal(np.stack(disk), np.stack(bucket))
    strip = [(p.replace(str(local), ""), n) for p, n in d_disk.mixture.entries()]
    assert strip == [(p.replace(remote, ""), n) for p, n in d_bucket.mixture.entries()]
    assert all(p.startswith(remote) for p, _ in d_bucket.mixture.entries())


def test_mix_file_in_the_bucket(s3):
    local, remote = s3
    bucket, _ = _batches({"mix": f"{remote}/mix.txt", "mix_root": f"s3://{BUCKET}",
                          "mix_tokenizer": "tok"})
    disk, _ = _batches({"paths": ",".join(
        [str(local / f"web/part-{k}.npy") for k in range(3)]
        + [str(local / f"code/sub/part-{k}.npy") for k in range(2)])})
    np.testing.assert_array_equal(np.stack(disk), np.stack(bucket))
    with pytest.raises(DataError, match=r"label 'web': s3://tokens/data/nope/web/part-0\.npy "
                                        r"\(line 2: web,data/\{TOKENIZER\}/web/part-0\.npy\)"):
        build_data({"mix": f"{remote}/mix.txt", "mix_root": f"s3://{BUCKET}",
                    "mix_tokenizer": "nope", "vocab_size": VOCAB}, SEQ_LEN, B)


def test_token_files_are_read_by_ranges_through_a_bounded_cache(s3):
    local, remote = s3
    cache = storage.RangeCache(max_bytes=64 << 10, block_bytes=16 << 10)
    f = RemoteTokenFile(f"{remote}/big.npy", "uint32", VOCAB, cache)
    expected = np.fromfile(local / "big.npy", dtype=np.uint32).astype(np.int32)
    assert len(f) == len(expected) == 1 << 18
    rng = np.random.default_rng(1)
    for start in rng.integers(0, len(f) - 500, 8):  # 2000 bytes: one or two 16 KiB blocks
        np.testing.assert_array_equal(f[start:start + 500], expected[start:start + 500])
    assert cache.held_bytes <= 64 << 10
    assert cache.fetched_bytes <= 8 * 2 * (16 << 10) < f.n_bytes  # never the whole file
    before = cache.fetched_bytes
    np.testing.assert_array_equal(f[10:20], expected[10:20])
    np.testing.assert_array_equal(f[10:20], expected[10:20])
    assert cache.fetched_bytes - before <= 16 << 10  # the second read is a cache hit


def test_missing_bucket_object_and_denied_access_name_the_path(s3, monkeypatch):
    _, remote = s3
    with pytest.raises(DataError, match=r"s3://no-such-bucket/x\.npy.*bucket 'no-such-bucket' "
                                        r"does not exist"):
        build_data({"paths": "s3://no-such-bucket/x.npy", "vocab_size": VOCAB}, SEQ_LEN, B)
    with pytest.raises(DataError, match=r"data\.paths\[0\]: token file s3://tokens/data/gone\.npy "
                                        r"does not exist"):
        build_data({"paths": f"{remote}/gone.npy", "vocab_size": VOCAB}, SEQ_LEN, B)
    msg = storage.storage_error(f"{remote}/web/part-0.npy", PermissionError("AccessDenied"))
    assert "access to bucket 'tokens' is denied" in msg and SECRET not in msg


def test_run_folders_in_buckets_are_accepted_and_gcs_scheme_named():
    """s3:// and gs:// run folders and checkpoints validate (tests/trainer/
    test_bucket_run_dir.py, test_gcs_run_dir.py); gcs:// is refused, naming the field and
    the gs:// spelling (orbax's paths know gs:// only)."""
    for name in ("run_dir", "init_from"):
        cfg = config_lib.default_config()
        cfg.trainer[name] = "gcs://runs/one"
        with pytest.raises(ConfigError, match=rf"trainer\.{name}=gcs://runs/one: write a GCS "
                                              "bucket as gs://runs/one"):
            config_lib.validate(cfg)
        for url in ("s3://runs/one", "gs://runs/one"):
            cfg.trainer[name] = url
            config_lib.validate(cfg)


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory):
    """One short training run from the bucket and the same run from disk."""
    from olmo_jax.trainer.loop import train
    from tests.trainer.test_train_smoke import smoke_config

    local, remote = s3
    out = {}
    for name, base in (("disk", str(local)), ("bucket", remote)):
        tmp = tmp_path_factory.mktemp(name)
        cfg = smoke_config(tmp, steps=3)
        cfg.optim.shorten_warmup = True  # a 3-step run under the smoke config's 5-step warmup
        t = cfg.trainer
        t.eval_every, t.sample_tokens, t.expert_counts_every, t.save_every = 0, 0, 0, 0
        t.seq_len, t.global_batch_size = 32, 8
        cfg.data.eval_fraction = 0.0
        cfg.data.vocab_size = VOCAB
        cfg.data.paths = ",".join(f"{base}/web/part-{k}.npy" for k in range(3))
        console = Console(record=True, width=300)
        train(config_lib.validate(cfg), console=console)
        run_dir = Path(t.run_dir)
        losses = [json.loads(r)["loss"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
        out[name] = (losses, run_dir, console.export_text())
    return out


def test_a_run_trains_from_the_bucket_as_from_disk(runs):
    disk, bucket = runs["disk"][0], runs["bucket"][0]
    assert len(bucket) == 3
    assert bucket == disk


def test_credentials_appear_nowhere(runs):
    _, run_dir, banner = runs["bucket"]
    assert "s3://tokens/data/web/part-0.npy" in banner or "s3://" in (run_dir / "config.json").read_text()
    for secret in (KEY_ID, SECRET):
        assert secret not in banner
        for path in run_dir.rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), path


def test_convert_reads_from_and_writes_to_the_bucket(runs, tmp_path, capsys):
    """orbax -> OLMo-core's olmo3moe HF export into the bucket (the same bytes as into a local
    folder), that export from the bucket -> orbax into the bucket, and that checkpoint back
    to HF: the same tensors. The orbax checkpoint is staged in a local folder."""
    from olmo_jax import convert
    from olmo_jax.cli import EXIT_BAD_INPUT

    run_dir = runs["disk"][1]
    fs = storage.filesystem("s3://")
    assert convert.main(["orbax-to-olmo3moe", "--ckpt", str(run_dir), "--out", "s3://tokens/hf"]) == 0
    assert convert.main(["orbax-to-olmo3moe", "--ckpt", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    local = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find("tokens/hf")) == local
    for name in local:
        assert fs.cat_file(f"tokens/hf/{name}") == (tmp_path / "hf" / name).read_bytes(), name
    assert convert.main(["olmo3moe-to-orbax", "--hf", "s3://tokens/hf", "--out", "s3://tokens/orbax"]) == 0
    assert fs.isfile("tokens/orbax/config.py") and fs.find("tokens/orbax/checkpoints/0")
    assert convert.main(["orbax-to-olmo3moe", "--ckpt", "s3://tokens/orbax", "--out", str(tmp_path / "back")]) == 0
    for name in local:
        if name.endswith(".safetensors"):
            assert (tmp_path / "back" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    capsys.readouterr()
    assert convert.main(["olmo3moe-to-orbax", "--hf", "s3://no-such-bucket/hf", "--out",
                         str(tmp_path / "x")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "s3://no-such-bucket/hf" in err and "does not exist" in err and SECRET not in err
    assert convert.main(["orbax-to-olmo3moe", "--ckpt", str(run_dir), "--out", "s3://tokens/hf"]) \
        == EXIT_BAD_INPUT
    assert "already holds" in capsys.readouterr().err
