"""Real Caffe Datum databases (written with protobuf, independently of the decoder), bad
records, and writers killed at random moments: nothing lost, nothing silent."""

from __future__ import annotations

import io
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from nccltree.cli.data import main
from nccltree.data import DataError, DataReader, db_info, decode_datum, encode_datum, write_lmdb

pytest.importorskip("google.protobuf")

from test_data_format import caffe_datum_class

Datum = caffe_datum_class("caffe_r")


def put(path: Path, values: list[bytes], keys: list[str] | None = None) -> None:
    keys = keys or [f"{i:08d}" for i in range(len(values))]
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for k, v in zip(keys, values, strict=True):
            txn.put(k.encode(), v)
    env.close()


def mnist_like(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """What convert_mnist_data writes: uint8 1x28x28 data, then the label."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, n)
    values = [
        Datum(
            channels=1, height=28, width=28, data=x[i].tobytes(), label=int(y[i])
        ).SerializeToString()
        for i in range(n)
    ]
    return x, y, values


def read_all(path: Path, batch: int, **kw: Any) -> tuple[np.ndarray, np.ndarray, list[int]]:
    xs, ys, sizes = [], [], []
    with DataReader(path, batch, epochs=1, **kw) as r:
        for b in r.batches(0):
            xs.append(np.array(b.x))
            ys.append(np.array(b.y))
            sizes.append(len(b))
    return np.concatenate(xs), np.concatenate(ys), sizes


# -- raw uint8 Datums: short batches ---------------------------------------------------------


def test_raw_datum_short_batches(tmp_path):
    x, y, values = mnist_like(359)
    put(tmp_path / "db", values)
    gx, gy, sizes = read_all(tmp_path / "db", 64)
    assert sizes == [64] * 5 + [39]
    np.testing.assert_array_equal(gx, x)
    np.testing.assert_array_equal(gy, y)
    # the same through a transform, and two ranks (one of which gets a shorter share)
    gx, _, _ = read_all(tmp_path / "db", 64, scale=1 / 256)
    np.testing.assert_array_equal(gx, x.astype(np.float32) * np.float32(1 / 256))
    with DataReader(tmp_path / "db", 100, ranks=2, epochs=1) as r:
        assert [len(b) for b in r.batches(1)] == [100, 79]


@pytest.mark.slow
def test_digits_datum_test_split_reads(tmp_path, capsys):
    pytest.importorskip("sklearn")
    db = tmp_path / "B"
    assert main(["make", "digits", str(db), "--split", "test", "--format", "datum"]) == 0
    _, gy, sizes = read_all(db, 64)
    assert sum(sizes) == 359 and sizes[-1] == 359 % 64


# -- a label before the data -----------------------------------------------------------------


def _label_first(img: np.ndarray, label: int) -> bytes:
    # protobuf lets fields come in any order: label (5) before data (4)
    head = Datum(channels=1, height=img.shape[1], width=img.shape[2], label=label)
    return head.SerializeToString() + Datum(data=img.tobytes()).SerializeToString()


def test_datum_label_before_data(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (40, 1, 4, 4), dtype=np.uint8)
    y = np.array([3, 3, 0, 3, 7] * 8)
    values = [_label_first(x[i], int(y[i])) for i in range(40)]
    # protobuf itself reads them as written
    assert Datum.FromString(values[1]).label == 3
    put(tmp_path / "db", values)
    gx, gy, _ = read_all(tmp_path / "db", 20)
    np.testing.assert_array_equal(gy, y)
    np.testing.assert_array_equal(gx, x)
    assert db_info(tmp_path / "db")["label_max"] == 7


def test_datum_fast_path_equals_full_decoder(tmp_path):
    # Caffe's order with encoded=false after the label (convert_imageset), repeated labels
    # (protobuf: the last wins), unknown fields after the data: each read as protobuf reads it
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (6, 2, 3, 3), dtype=np.uint8)
    values = [
        Datum(
            channels=2, height=3, width=3, data=x[i].tobytes(), label=i, encoded=False
        ).SerializeToString()
        for i in range(6)
    ]
    values[2] += Datum(label=-5).SerializeToString()  # a second label field wins
    values[3] += b"\x48\x01"  # unknown field 9
    values[4] = values[4][: -len(Datum(encoded=False).SerializeToString())]  # no encoded
    put(tmp_path / "db", values)
    gx, gy, _ = read_all(tmp_path / "db", 6)
    assert gy.tolist() == [Datum.FromString(v).label for v in values] == [0, 1, -5, 3, 4, 5]
    np.testing.assert_array_equal(gx, x)


# -- labels outside int32 --------------------------------------------------------------------


def test_datum_labels_must_fit_int32(tmp_path, capsys):
    x = np.zeros((3, 1, 2, 2), np.uint8)
    with pytest.raises(ValueError, match="record 1: .*label 2147483648.*int32"):
        write_lmdb(tmp_path / "db", x, np.array([0, 2**31, 1]), format="datum")
    assert not (tmp_path / "db").exists()
    with pytest.raises(ValueError, match="int32"):
        encode_datum(x[0], -(2**31) - 1)
    # the extremes of int32 are fine, and read back as protobuf reads them
    write_lmdb(tmp_path / "ok", x[:2], np.array([2**31 - 1, -(2**31)]), format="datum")
    _, gy, _ = read_all(tmp_path / "ok", 2)
    assert gy.tolist() == [2**31 - 1, -(2**31)]
    # a foreign writer's 64-bit varint: the low 32 bits, as a protobuf int32 reader sees it
    raw = Datum(channels=1, height=1, width=1, data=b"\x01").SerializeToString()
    raw += b"\x28" + bytes([0x80, 0x80, 0x80, 0x80, 0x10])  # label = 2**32 (varint)
    _, label = decode_datum(raw)
    assert label == 0
    np.savez(tmp_path / "in.npz", X=x, y=np.array([0, 1, 2**40]))
    assert (
        main(["convert", str(tmp_path / "in.npz"), str(tmp_path / "c"), "--format", "datum"]) == 2
    )
    assert "record 2" in capsys.readouterr().err and not (tmp_path / "c").exists()


# -- encoded images: Caffe's default decoding and force_color / force_gray -------------------


def _encode(arr: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    from PIL import Image

    bio = io.BytesIO()
    Image.fromarray(arr, mode).save(bio, format=fmt)
    return bio.getvalue()


def _encoded_db(path: Path, files: list[bytes]) -> None:
    put(
        path,
        [Datum(data=f, label=i, encoded=True).SerializeToString() for i, f in enumerate(files)],
        [f"{i:08d}_img{i}.png" for i in range(len(files))],
    )


def test_encoded_rgba_keeps_alpha_and_force_flags(tmp_path):
    pytest.importorskip("PIL")
    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 256, (4, 5, 6, 4), dtype=np.uint8)
    _encoded_db(tmp_path / "db", [_encode(a, "PNG") for a in rgba])
    bgra = rgba[..., [2, 1, 0, 3]].transpose(0, 3, 1, 2)
    gx, gy, _ = read_all(tmp_path / "db", 4)
    assert gx.shape == (4, 4, 5, 6) and gy.tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(gx, bgra)  # Caffe's default: 4 channels, BGRA
    assert db_info(tmp_path / "db")["shape"] == [4, 5, 6]
    gx, _, _ = read_all(tmp_path / "db", 4, force_color=True)
    np.testing.assert_array_equal(gx, bgra[:, :3])  # alpha dropped, not composited
    gx, _, _ = read_all(tmp_path / "db", 4, force_gray=True)
    assert gx.shape == (4, 1, 5, 6)
    luma = rgba[..., :3].astype(np.float64) @ [0.299, 0.587, 0.114]
    assert np.abs(gx[:, 0].astype(np.float64) - luma).max() <= 1  # up to rounding
    with pytest.raises(ValueError, match="exclude each other"):
        DataReader(tmp_path / "db", 4, force_color=True, force_gray=True)
    f = Datum(data=_encode(rgba[0], "PNG"), label=0, encoded=True).SerializeToString()
    assert decode_datum(f)[0].shape == (4, 5, 6)
    assert decode_datum(f, force_color=True)[0].shape == (3, 5, 6)
    assert decode_datum(f, force_gray=True)[0].shape == (1, 5, 6)


def test_encoded_gray_png_jpeg_and_mixed_channels(tmp_path):
    pytest.importorskip("PIL")
    rng = np.random.default_rng(4)
    gray = rng.integers(0, 256, (5, 7), dtype=np.uint8)
    rgb = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    files = [_encode(gray, "PNG"), _encode(rgb, "PNG"), _encode(rgb, "JPEG")]
    x, _ = decode_datum(Datum(data=files[0], encoded=True).SerializeToString())
    np.testing.assert_array_equal(x, gray[None])  # gray stays 1 channel
    x, _ = decode_datum(Datum(data=files[2], encoded=True).SerializeToString())
    from PIL import Image

    jpeg_rgb = np.asarray(Image.open(io.BytesIO(files[2])).convert("RGB"))
    np.testing.assert_array_equal(x, jpeg_rgb[..., ::-1].transpose(2, 0, 1))  # BGR
    x, _ = decode_datum(Datum(data=files[0], encoded=True).SerializeToString(), force_color=True)
    np.testing.assert_array_equal(x, np.repeat(gray[None], 3, 0))
    # a database of gray and colour images: by default their channels differ (the reader
    # says so and names force_color); forced, every image reads as 3 channels
    _encoded_db(tmp_path / "mixed", files)
    with pytest.raises(DataError, match="'00000001_img1.png'.*force_color"):
        read_all(tmp_path / "mixed", 3)
    gx, _, _ = read_all(tmp_path / "mixed", 3, force_color=True)
    assert gx.shape == (3, 3, 5, 7)
    np.testing.assert_array_equal(gx[1], rgb[..., ::-1].transpose(2, 0, 1))


def test_float_datum_database(tmp_path):
    vals = np.random.default_rng(5).standard_normal((9, 2, 3, 1)).astype(np.float32)
    put(
        tmp_path / "f",
        [
            Datum(
                channels=2, height=3, width=1, float_data=v.ravel().tolist(), label=i
            ).SerializeToString()
            for i, v in enumerate(vals)
        ],
    )
    gx, gy, sizes = read_all(tmp_path / "f", 4)
    assert sizes == [4, 4, 1] and gy.tolist() == list(range(9))
    np.testing.assert_array_equal(gx, vals)


# -- bad records: named, runtime errors, and --verify ----------------------------------------


def test_corrupt_encoded_record_is_named(tmp_path, capsys):
    pytest.importorskip("PIL")
    png = _encode(np.zeros((4, 4), np.uint8), "PNG")
    files = [png, png, b"\x89PNG garbage that is no image", png]
    _encoded_db(tmp_path / "db", files)
    with pytest.raises(DataError) as ei:
        read_all(tmp_path / "db", 2)
    msg = str(ei.value)
    assert "'00000002_img2.png' (number 2 in key order)" in msg
    assert "BytesIO" not in msg and "not an image file" in msg
    # the command line: a runtime error (1), one line naming the record, no usage block
    assert main(["info", str(tmp_path / "db"), "--verify"]) == 3
    out = capsys.readouterr().out
    assert "bad record '00000002_img2.png' (number 2 in key order)" in out
    assert "3 good" not in out and "1 bad" in out
    _encoded_db(tmp_path / "first", [b"junk image", png])
    assert main(["info", str(tmp_path / "first")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage" not in err and "'00000000_img0.png'" in err


def test_info_verify_lists_every_bad_record(tmp_path, capsys):
    X = np.random.default_rng(6).standard_normal((100, 4)).astype(np.float32)
    write_lmdb(tmp_path / "db", X, np.arange(100) % 3)
    assert main(["info", str(tmp_path / "db"), "--verify"]) == 0
    assert "verified 100 nccltree records" in capsys.readouterr().out
    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 26)
    from nccltree.data import encode_record

    with env.begin(write=True) as txn:
        txn.put(b"00000050", encode_record(np.zeros(5, np.float32), 1))  # wrong shape
        txn.put(b"00000070", txn.get(b"00000070")[:-3])  # truncated
        txn.put(b"00000080", b"XXXX" + txn.get(b"00000080")[4:])  # bad magic
    env.close()
    assert main(["info", str(tmp_path / "db")]) == 0  # labels only: nothing decoded
    capsys.readouterr()
    assert main(["info", str(tmp_path / "db"), "--verify"]) == 3
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:3]] == [
        "bad record '00000050' (number 50 in key order)",
        "bad record '00000070' (number 70 in key order)",
        "bad record '00000080' (number 80 in key order)",
    ]
    assert "shape (5,)" in out[0] and "needs" in out[1] and "bad magic" in out[2]
    assert out[3].endswith("3 bad")
    assert main(["info", str(tmp_path / "db"), "--verify", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert [b["number"] for b in report["bad"]] == [50, 70, 80]
    from nccltree.data.lmdb_io import verify_db

    assert verify_db(tmp_path / "db")["records"] == 100


# -- nccltree-data's messages ----------------------------------------------------------------


def test_data_cli_messages(tmp_path, capsys):
    np.save(tmp_path / "a.npy", np.zeros((3, 2)))
    np.savez(tmp_path / "ok.npz", X=np.zeros((3, 2)), y=np.arange(3))
    np.savez(tmp_path / "obj.npz", X=np.array([None, 1], dtype=object), y=np.arange(2))
    (tmp_path / "f").write_text("not a directory")
    cases = [
        (["convert", str(tmp_path / "a.npy"), str(tmp_path / "o")], ".npy file holding one"),
        (["convert", str(tmp_path / "f"), str(tmp_path / "o")], "is not a numpy .npz file"),
        (["convert", str(tmp_path / "obj.npz"), str(tmp_path / "o")], "holds Python objects"),
        (["convert", str(tmp_path / "ok.npz"), str(tmp_path / "f" / "x")], "is a file, not a"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert expected in err, err
        for leak in ("Errno", "pickle", "context manager", "overwrite=True"):
            assert leak not in err, err
    assert main(["convert", str(tmp_path / "ok.npz"), str(tmp_path / "db")]) == 0
    assert main(["convert", str(tmp_path / "ok.npz"), str(tmp_path / "db")]) == 2
    assert "--overwrite replaces it" in capsys.readouterr().err
    main(["make", "synthetic", "x", "--help"])
    help_text = capsys.readouterr().out
    assert "--format {nccltree}" in help_text and "Caffe Datum (uint8" not in help_text


# -- writers killed at random moments --------------------------------------------------------

_WRITER = """
import sys, numpy as np
from nccltree.data import write_lmdb
n = int(sys.argv[2])
X = (np.arange(n * 256, dtype=np.uint32) % 251).astype(np.float32).reshape(n, 256)
print("start", flush=True)
write_lmdb(sys.argv[1], X, np.arange(n) % 7, commit_bytes=1 << 20)
"""


def _check_complete_or_absent(db: Path, n: int) -> bool:
    """The database is absent or complete (never partial); True when complete."""
    if not db.exists():
        return False
    info = db_info(db)
    assert info["records"] == n, f"a partial database: {info['records']} of {n} records"
    return True


@pytest.mark.subprocess
@pytest.mark.slow
def test_write_killed_at_random_leaves_nothing_partial(tmp_path):
    n = 24_000  # ~25 MB in 1 MiB transactions: a kill lands mid-write most times
    rng = random.Random(13)
    deadline = time.monotonic() + 12
    kills = complete = 0
    db = tmp_path / "db"
    for _ in range(12):
        if time.monotonic() > deadline:
            break
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(db), str(n)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        proc.stdout.readline()  # numpy is imported: the write is about to start
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        if _check_complete_or_absent(db, n):
            complete += 1
            shutil.rmtree(db)  # start over
    assert kills >= 5
    # the next write to the same path succeeds, and removes what the killed ones left
    X = np.ones((10, 3), np.float32)
    write_lmdb(db, X, np.arange(10))
    assert db_info(db)["records"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db"]


@pytest.mark.subprocess
@pytest.mark.slow
def test_make_killed_then_rerun(tmp_path):
    db = tmp_path / "syn"
    exe = [sys.executable, "-m", "nccltree.cli.data", "make", "synthetic", str(db)]
    rng = random.Random(7)
    for _ in range(6):
        proc = subprocess.Popen([*exe, "--n", "200000"], stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 1.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if _check_complete_or_absent(db, 200_000):
            break
    # a re-run is never refused because of a killed one, and leaves one database behind
    assert subprocess.run([*exe, "--n", "100", "--overwrite"], capture_output=True).returncode == 0
    assert db_info(db)["records"] == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["syn"]
