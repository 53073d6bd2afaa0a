"""``nccltree-data convert-imageset`` and ``mean`` against what Caffe's own tools make.

The reference database is written independently of nccltree's writer: images read and
resized by OpenCV (``cv2.imread``, ``cv2.resize``: what Caffe's convert_imageset calls),
Datums serialized by the protobuf runtime, keys as Caffe makes them. The tolerance,
stated: every record's fields and every pixel of an image that is not resized are equal;
a resized pixel is within one level of OpenCV's (``cv::resize``'s fixed-point rounding is
reproduced, not its vectorisation order; about 1% of samples differ, by one).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("google.protobuf")
pytest.importorskip("cv2")

import cv2
from PIL import Image

from nccltree.caffe_proto import message_class
from nccltree.cli import data as data_cli
from nccltree.cli import train
from nccltree.data.blobproto import decode_blobproto, encode_blobproto
from nccltree.data.imageset import resize_linear

RESIZE_TOLERANCE = 1  # levels, for resized images only


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of tiny images of Caffe's kinds and a list file naming them (and one
    file that is no image, on line 5)."""
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(0)
    (root / "cls a").mkdir()
    lines = []

    def noisy(h: int, w: int, c: int) -> np.ndarray:
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([(xx * 9 + yy * 3 + 40 * k) % 256 for k in range(c)], -1)
        return np.clip(base + rng.integers(-30, 30, base.shape), 0, 255).astype(np.uint8)

    Image.fromarray(noisy(9, 11, 3)).save(root / "cls a" / "c0.png")
    lines.append("cls a/c0.png 0")
    Image.fromarray(noisy(12, 7, 3)).save(root / "c1.PNG")
    lines.append("c1.PNG 1")
    Image.fromarray(noisy(10, 10, 1)[:, :, 0]).save(root / "gray.png")
    lines.append("gray.png 2")
    Image.fromarray(noisy(8, 13, 4), "RGBA").save(root / "alpha.png")
    lines.append("alpha.png 1")
    (root / "broken.png").write_bytes(b"\x89PNG not really")
    lines.append("broken.png 0")
    Image.fromarray(noisy(16, 16, 3)).save(root / "photo.jpg", quality=90)
    lines.append("photo.jpg 3")
    Image.fromarray(noisy(6, 5, 3)).save(root / "small.jpeg", quality=90)
    lines.append("small.jpeg 2")
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    return root


def _reference(root: Path, db: Path, size: tuple[int, int] | None, gray: bool) -> None:
    """What Caffe's convert_imageset writes, made with OpenCV and the protobuf runtime."""
    import lmdb

    Datum = message_class("Datum")
    env = lmdb.open(str(db), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for line_id, line in enumerate((root / "list.txt").read_text().splitlines()):
            path, _, label = line.rpartition(" ")
            flag = cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR
            img = cv2.imread(str(root) + "/" + path, flag)
            if img is None:
                continue  # Caffe: "Could not open or find file", the line is skipped
            if size is not None:
                img = cv2.resize(img, (size[1], size[0]))
            chw = img[None] if img.ndim == 2 else img.transpose(2, 0, 1)
            datum = Datum(
                channels=chw.shape[0],
                height=chw.shape[1],
                width=chw.shape[2],
                data=np.ascontiguousarray(chw).tobytes(),
                label=int(label),
            )
            txn.put(b"%08d_%s" % (line_id, path.encode()), datum.SerializeToString())
    env.close()


def _records(db: Path) -> list[tuple[bytes, bytes]]:
    import lmdb

    env = lmdb.open(str(db), readonly=True, lock=False)
    with env.begin() as txn:
        out = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    env.close()
    return out


def _convert(images: Path, out: Path, *flags: str) -> int:
    return data_cli.main(["convert-imageset", f"{images}/", str(images / "list.txt"), str(out),
                          "--quiet", *flags])  # fmt: skip


@pytest.mark.parametrize(
    ("size", "gray"), [(None, False), (None, True), ((8, 6), False), ((5, 9), True)]
)
def test_conversion_matches_caffes_record_by_record(images, tmp_path, capsys, size, gray):
    flags = ["--gray"] if gray else []
    if size is not None:
        flags += ["--resize-height", str(size[0]), "--resize-width", str(size[1])]
    assert _convert(images, tmp_path / "ours", *flags) == 0
    out = capsys.readouterr().out
    assert "wrote 6 raw Datum records" in out and "skipped 1 images" in out
    assert "(lines 5)" in out
    _reference(images, tmp_path / "ref", size, gray)
    ours, ref = _records(tmp_path / "ours"), _records(tmp_path / "ref")
    assert [k for k, _ in ours] == [k for k, _ in ref]
    Datum = message_class("Datum")
    worst = 0
    for (key, a), (_, b) in zip(ours, ref, strict=True):
        da, db = Datum.FromString(a), Datum.FromString(b)
        for name in ("channels", "height", "width", "label", "encoded"):
            assert getattr(da, name) == getattr(db, name), (key, name)
        assert not da.float_data and len(da.data) == len(db.data)
        diff = np.abs(
            np.frombuffer(da.data, np.uint8).astype(int) - np.frombuffer(db.data, np.uint8)
        )
        worst = max(worst, int(diff.max()))
    assert worst <= (RESIZE_TOLERANCE if size else 0)


def test_resize_is_opencvs_within_one_level():
    rng = np.random.default_rng(5)
    differ = total = 0
    for _ in range(60):
        h0, w0, h, w = (int(v) for v in rng.integers(1, 40, 4))
        shape = (h0, w0, 3) if rng.random() < 0.5 else (h0, w0)
        img = rng.integers(0, 256, shape, dtype=np.uint8)
        ref, got = cv2.resize(img, (w, h)), resize_linear(img, h, w)
        assert got.shape == ref.shape
        d = np.abs(got.astype(int) - ref)
        assert d.max() <= RESIZE_TOLERANCE
        differ, total = differ + int((d > 0).sum()), total + d.size
    assert differ / total < 0.03  # most samples are OpenCV's exactly
    # halving is OpenCV's 2x2 average (its INTER_AREA shortcut): exact
    img = rng.integers(0, 256, (16, 12, 3), dtype=np.uint8)
    assert np.array_equal(resize_linear(img, 8, 6), cv2.resize(img, (6, 8)))


def test_encoded_keeps_the_file_or_encodes_again(images, tmp_path):
    assert _convert(images, tmp_path / "enc", "--encoded") == 0
    Datum = message_class("Datum")
    recs = {
        k.split(b"_", 1)[1].decode(): Datum.FromString(v) for k, v in _records(tmp_path / "enc")
    }
    assert all(d.encoded for d in recs.values())
    # no resize and the extension is the encoding: the file's own bytes
    assert recs["photo.jpg"].data == (images / "photo.jpg").read_bytes()
    assert recs["c1.PNG"].data == (images / "c1.PNG").read_bytes()  # extensions in any case
    # --encode-type png on a JPEG, or a resize: the decoded image encoded again
    assert _convert(images, tmp_path / "png", "--encode_type", "png", "--resize-height", "4",
                    "--resize-width", "4") == 0  # fmt: skip
    for key, value in _records(tmp_path / "png"):
        d = Datum.FromString(value)
        assert d.data[:4] == b"\x89PNG"
        name = key.split(b"_", 1)[1].decode()
        want = cv2.resize(cv2.imread(f"{images}/{name}", cv2.IMREAD_COLOR), (4, 4))
        got = cv2.imdecode(np.frombuffer(d.data, np.uint8), cv2.IMREAD_UNCHANGED)
        assert np.abs(got.astype(int) - want).max() <= RESIZE_TOLERANCE


def test_shuffle_is_seeded(images, tmp_path):
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert _convert(images, tmp_path / name, "--shuffle", "--seed", seed) == 0
    a, b, c = (_records(tmp_path / n) for n in "abc")
    assert a == b and a != c
    keys = [k.split(b"_", 1) for k, _ in a]
    names = [n for _, n in keys]
    assert sorted(names) != names or [int(i) for i, _ in keys] != list(range(len(keys)))
    plain = sorted(k.split(b"_", 1)[1] for k, _ in _records(tmp_path / "a"))
    assert plain == sorted(names)


def test_bad_lines_and_sizes_are_refused_with_nothing_written(images, tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("c1.PNG 1\n\ngray.png two\n")
    rc = data_cli.main(["convert-imageset", f"{images}/", str(bad), str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "line 3" in err and "'two' is not an integer" in err
    rc = _convert(images, tmp_path / "y", "--check-size")
    err = capsys.readouterr().err
    assert rc == 1 and "line 2: c1.PNG is 3 x 12 x 7, the first image 3 x 9 x 11" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporaries


def test_skipped_images_are_named_by_line(images, tmp_path, capsys):
    # a folder ROOT without its "/" is joined with one
    rc = data_cli.main(["convert-imageset", str(images), str(images / "list.txt"),
                        str(tmp_path / "db")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0 and "skipped line 5 of" in err and "broken.png" in err
    assert len(_records(tmp_path / "db")) == 6
    # anything else is a prefix, as Caffe concatenates ROOT and the path
    (tmp_path / "one.txt").write_text("1.PNG 4\n")
    rc = data_cli.main(["convert-imageset", f"{images}/c", str(tmp_path / "one.txt"),
                        str(tmp_path / "prefixed"), "--quiet"])  # fmt: skip
    assert rc == 0 and [k for k, _ in _records(tmp_path / "prefixed")] == [b"00000000_1.PNG"]


def test_mean_binaryproto_is_caffes_blobproto(images, tmp_path, capsys):
    assert _convert(images, tmp_path / "db", "--resize-height", "6", "--resize-width", "5") == 0
    mean_file = tmp_path / "mean.binaryproto"
    assert data_cli.main(["mean", str(tmp_path / "db"), str(mean_file), "--quiet"]) == 0
    assert "mean value per channel" in capsys.readouterr().out
    # read back by the protobuf runtime: compute_image_mean's legacy 4-D fields
    blob = message_class("BlobProto").FromString(mean_file.read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 6, 5)
    from nccltree.data import open_db

    with open_db(tmp_path / "db") as db:
        want = np.mean([x.astype(np.float64) for _, x, _ in db], axis=0).astype(np.float32)
    np.testing.assert_array_equal(np.array(blob.data, np.float32).reshape(3, 6, 5), want)
    np.testing.assert_array_equal(train.load_mean(str(mean_file)), want)
    assert data_cli.main(["mean", str(tmp_path / "db"), str(tmp_path / "m.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "m.npy"), want)
    assert data_cli.main(["mean", str(tmp_path / "db"), str(mean_file)]) == 2  # exists


def test_blobprotos_written_by_the_runtime_are_read(tmp_path):
    Blob, Shape = message_class("BlobProto"), message_class("BlobShape")
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    legacy = Blob(num=1, channels=2, height=3, width=4, data=values.ravel().tolist())
    shaped = Blob(shape=Shape(dim=[2, 3, 4]), data=values.ravel().tolist())
    doubles = Blob(shape=Shape(dim=[2, 3, 4]), double_data=values.ravel().astype(float).tolist())
    assert decode_blobproto(legacy.SerializeToString()).shape == (1, 2, 3, 4)
    for blob in (shaped, doubles):
        np.testing.assert_array_equal(decode_blobproto(blob.SerializeToString()), values)
    path = tmp_path / "legacy.binaryproto"
    path.write_bytes(legacy.SerializeToString())
    np.testing.assert_array_equal(train.load_mean(str(path)), values)  # num 1 dropped
    # ours, read by the runtime, both forms
    assert Blob.FromString(encode_blobproto(values)) == legacy
    assert Blob.FromString(encode_blobproto(values, legacy=False)) == shaped
    with pytest.raises(ValueError, match="needs 24 values, it holds 3"):
        decode_blobproto(Blob(shape=Shape(dim=[2, 3, 4]), data=[1, 2, 3]).SerializeToString())
