"""Record format, Caffe Datum decoding, writing and inspecting databases."""

from __future__ import annotations

import io
import struct
import sys

import lmdb
import numpy as np
import pytest

from nccltree.data import (
    DataError,
    DataReader,
    db_info,
    decode_datum,
    decode_record,
    encode_datum,
    encode_record,
    open_db,
    write_lmdb,
)

# -- a hand-written protobuf encoder, independent of nccltree.data.datum ------------------


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    return _varint(num << 3 | wire) + payload


def datum_bytes(
    c=0, h=0, w=0, data=None, label=None, floats=None, encoded=None, packed=False, extra=b""
) -> bytes:
    """Caffe Datum: channels=1 height=2 width=3 data=4 label=5 float_data=6 encoded=7."""
    out = b""
    for num, v in ((1, c), (2, h), (3, w)):
        if v:
            out += _field(num, 0, _varint(v))
    if data is not None:
        out += _field(4, 2, _varint(len(data)) + data)
    if floats is not None:
        if packed:
            raw = struct.pack(f"<{len(floats)}f", *floats)
            out += _field(6, 2, _varint(len(raw)) + raw)
        else:  # how Caffe writes it: proto2 repeated float is not packed
            out += b"".join(_field(6, 5, struct.pack("<f", f)) for f in floats)
    if label is not None:
        out += _field(5, 0, _varint(label))
    if encoded is not None:
        out += _field(7, 0, _varint(int(encoded)))
    return out + extra


def put_raw(path, items) -> None:
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for k, v in items:
            txn.put(k if isinstance(k, bytes) else k.encode(), v)
    env.close()


# -- nccltree records --------------------------------------------------------------------


@pytest.mark.parametrize(
    "x",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(5, dtype=np.uint8),
        np.array(7.5, dtype=np.float64),  # 0-d record
        np.array([[True, False]]),
        np.arange(6, dtype=np.float16).reshape(1, 2, 3),
        np.arange(-3, 3, dtype=np.int64),
        np.arange(8, dtype=np.int32).reshape(2, 2, 2)[:, ::-1],  # not contiguous
    ],
)
def test_record_round_trip(x):
    buf = encode_record(x, -42)
    assert buf[:4] == b"NTR1"
    out, label = decode_record(buf)
    assert label == -42
    assert out.dtype == x.dtype and out.shape == x.shape
    np.testing.assert_array_equal(out, x)


def test_record_header_layout():
    buf = encode_record(np.zeros((2, 3), np.float32), 9)
    magic, code, ndim, _, label = struct.unpack_from("<4sBBHq", buf)
    assert (magic, code, ndim, label) == (b"NTR1", 10, 2, 9)
    assert struct.unpack_from("<2I", buf, 16) == (2, 3)
    assert len(buf) == 24 + 24  # header padded to a multiple of 8, then 6 floats


def test_record_rejects_bad_input():
    with pytest.raises(TypeError, match="not supported"):
        encode_record(np.array(["a"]), 0)
    with pytest.raises(TypeError, match="not supported"):
        encode_record(np.zeros(2, np.complex64), 0)
    good = encode_record(np.zeros(4, np.float32), 1)
    with pytest.raises(DataError, match="'k1'.*needs"):
        decode_record(good[:-1], b"k1")
    with pytest.raises(DataError, match="'k2'.*bad magic"):
        decode_record(b"XXXX" + good[4:], b"k2")
    with pytest.raises(DataError, match="unknown dtype code"):
        decode_record(good[:4] + b"\x63" + good[5:], b"k3")


# -- Caffe Datum -------------------------------------------------------------------------


def test_datum_uint8_data():
    img = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    buf = datum_bytes(2, 3, 4, data=img.tobytes(), label=7)
    x, y = decode_datum(buf)
    assert y == 7 and x.dtype == np.uint8
    np.testing.assert_array_equal(x, img)


@pytest.mark.parametrize("packed", [False, True])
def test_datum_float_data(packed):
    vals = np.linspace(-1, 1, 6, dtype=np.float32)
    buf = datum_bytes(1, 2, 3, floats=vals.tolist(), label=3, packed=packed)
    x, y = decode_datum(buf)
    assert y == 3 and x.dtype == np.float32 and x.shape == (1, 2, 3)
    np.testing.assert_array_equal(x.ravel(), vals)


def test_datum_negative_label_and_unknown_fields():
    extra = _field(9, 0, _varint(5)) + _field(10, 2, _varint(3) + b"abc") + _field(11, 5, b"1234")
    buf = datum_bytes(1, 1, 2, data=b"\x01\x02", label=-1, extra=extra)
    x, y = decode_datum(buf)
    assert y == -1
    assert x.tolist() == [[[1, 2]]]


def test_datum_encoder_matches_hand_encoder():
    img = np.arange(12, dtype=np.uint8).reshape(1, 3, 4)
    assert encode_datum(img, 5) == datum_bytes(1, 3, 4, data=img.tobytes(), label=5)
    f = np.arange(4, dtype=np.float32).reshape(1, 2, 2)
    assert encode_datum(f, 1) == datum_bytes(1, 2, 2, floats=f.ravel().tolist(), label=1)


def caffe_datum_class(package: str = "caffe_t"):
    """Caffe's Datum message class from protobuf, built from the fields caffe.proto
    declares (independent of nccltree.data.datum); needs the protobuf package."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name=f"{package}.proto", package=package)
    m = fdp.message_type.add(name="Datum")
    F = descriptor_pb2.FieldDescriptorProto
    for name, num, typ, lab in [
        ("channels", 1, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("height", 2, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("width", 3, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("data", 4, F.TYPE_BYTES, F.LABEL_OPTIONAL),
        ("label", 5, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("float_data", 6, F.TYPE_FLOAT, F.LABEL_REPEATED),
        ("encoded", 7, F.TYPE_BOOL, F.LABEL_OPTIONAL),
    ]:
        m.field.add(name=name, number=num, type=typ, label=lab)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.Datum"))


def test_datum_protobuf_package_bytes_decode():
    pytest.importorskip("google.protobuf")
    Datum = caffe_datum_class()
    img = np.random.default_rng(0).integers(0, 256, (3, 5, 4), dtype=np.uint8)
    msg = Datum(channels=3, height=5, width=4, data=img.tobytes(), label=123456)
    x, y = decode_datum(msg.SerializeToString())
    assert y == 123456
    np.testing.assert_array_equal(x, img)
    fmsg = Datum(channels=1, height=1, width=3, float_data=[0.5, -2.0, 3.25], label=-7)
    x, y = decode_datum(fmsg.SerializeToString())
    assert y == -7 and x.ravel().tolist() == [0.5, -2.0, 3.25]


def _png(arr: np.ndarray) -> bytes:
    from PIL import Image

    bio = io.BytesIO()
    Image.fromarray(arr).save(bio, format="PNG")
    return bio.getvalue()


def test_datum_encoded_png():
    pytest.importorskip("PIL")
    rgb = np.random.default_rng(1).integers(0, 256, (5, 6, 3), dtype=np.uint8)
    x, y = decode_datum(datum_bytes(data=_png(rgb), label=4, encoded=True))
    assert y == 4 and x.shape == (3, 5, 6)
    np.testing.assert_array_equal(x, rgb[:, :, ::-1].transpose(2, 0, 1))  # BGR, as Caffe
    gray = rgb[:, :, 0]
    x, _ = decode_datum(datum_bytes(data=_png(gray), label=0, encoded=True))
    np.testing.assert_array_equal(x, gray[None])


def test_datum_encoded_without_pillow(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(DataError, match="'00000003_a.png'.*Pillow"):
        decode_datum(datum_bytes(data=b"\x89PNG....", label=0, encoded=True), b"00000003_a.png")


def test_datum_bad_records():
    with pytest.raises(DataError, match="'k'.*needs 6"):
        decode_datum(datum_bytes(1, 2, 3, data=b"12345", label=0), b"k")
    with pytest.raises(DataError, match="neither data nor float_data"):
        decode_datum(datum_bytes(1, 2, 3, label=0))
    with pytest.raises(DataError, match="not a valid Caffe Datum"):
        decode_datum(b"\x22\x50abc")  # data field longer than the record


def test_datum_lmdb_with_caffe_keys(tmp_path):
    rng = np.random.default_rng(2)
    imgs = rng.integers(0, 256, (5, 1, 4, 4), dtype=np.uint8)
    labels = [3, 1, 4, 1, 5]
    names = ["cat.jpg", "dog.jpg", "a/b.jpg", "e.jpg", "f.jpg"]
    put_raw(
        tmp_path / "db",
        [
            (f"{i:08d}_{names[i]}", datum_bytes(1, 4, 4, data=imgs[i].tobytes(), label=labels[i]))
            for i in range(5)
        ],
    )
    info = db_info(tmp_path / "db")
    assert info["format"] == "datum" and info["records"] == 5
    assert info["shape"] == [1, 4, 4] and info["dtype"] == "uint8"
    assert (info["label_min"], info["label_max"]) == (1, 5)
    assert info["first_key"] == "00000000_cat.jpg"
    with DataReader(tmp_path / "db", 5, epochs=1) as r:
        b = r.next_batch(0)
        np.testing.assert_array_equal(b.x, imgs)
        assert b.y.tolist() == labels
        b.release()


def test_datum_lmdb_plain_keys_float_and_encoded(tmp_path):
    vals = np.arange(8, dtype=np.float32).reshape(2, 1, 2, 2)
    put_raw(
        tmp_path / "f",
        [
            (f"{i:08d}", datum_bytes(1, 2, 2, floats=vals[i].ravel().tolist(), label=i))
            for i in range(2)
        ],
    )
    with DataReader(tmp_path / "f", 2, epochs=1, format="datum") as r, r.next_batch() as b:
        assert b.x.dtype == np.float32
        np.testing.assert_array_equal(b.x, vals)
    pytest.importorskip("PIL")
    imgs = np.random.default_rng(3).integers(0, 256, (3, 4, 5, 3), dtype=np.uint8)
    put_raw(
        tmp_path / "e",
        [
            (f"{i:08d}_x{i}.png", datum_bytes(data=_png(imgs[i]), label=i, encoded=True))
            for i in range(3)
        ],
    )
    with DataReader(tmp_path / "e", 3, epochs=1) as r, r.next_batch() as b:
        assert b.x.shape == (3, 3, 4, 5)
        np.testing.assert_array_equal(b.x, imgs[:, :, :, ::-1].transpose(0, 3, 1, 2))


# -- writing and inspecting --------------------------------------------------------------


def test_write_open_iterate(tmp_path):
    X = np.random.default_rng(4).standard_normal((25, 3, 2)).astype(np.float32)
    y = np.arange(25) % 4
    assert write_lmdb(tmp_path / "db", X, y) == 25
    with open_db(tmp_path / "db") as db:
        assert (len(db), db.format, db.shape, db.dtype) == (25, "nccltree", (3, 2), np.float32)
        items = list(db)
    assert [k for k, _, _ in items] == [b"%08d" % i for i in range(25)]
    np.testing.assert_array_equal(np.stack([x for _, x, _ in items]), X)
    assert [lab for _, _, lab in items] == y.tolist()
    info = db_info(tmp_path / "db")
    assert info["records"] == 25 and info["classes"] == 4 and info["size_bytes"] > 0


def test_write_grows_map_and_commits_in_chunks(tmp_path):
    X = np.zeros((300, 1024), np.uint8)
    X[:, 0] = np.arange(300) % 256
    write_lmdb(tmp_path / "db", X, np.arange(300), map_size=64 << 10, commit_bytes=20 << 10)
    with open_db(tmp_path / "db") as db:
        assert len(db) == 300
        assert db.labels().tolist() == list(range(300))


def test_write_refuses_existing_unless_overwrite(tmp_path):
    write_lmdb(tmp_path / "db", np.zeros((4, 2)), np.zeros(4, int))
    with pytest.raises(FileExistsError, match="overwrite"):
        write_lmdb(tmp_path / "db", np.ones((2, 2)), np.ones(2, int))
    write_lmdb(tmp_path / "db", np.ones((2, 3)), np.ones(2, int), overwrite=True)
    assert db_info(tmp_path / "db")["records"] == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not an LMDB"):
        write_lmdb(tmp_path / "other", np.zeros((1, 1)), np.zeros(1, int))


def test_write_rejects_bad_arrays(tmp_path):
    with pytest.raises(ValueError, match="shape \\(3,\\)"):
        write_lmdb(tmp_path / "a", np.zeros((3, 2)), np.zeros(2, int))
    with pytest.raises(TypeError, match="integers"):
        write_lmdb(tmp_path / "a", np.zeros((3, 2)), np.zeros(3))
    with pytest.raises(ValueError, match="at least one record"):
        write_lmdb(tmp_path / "a", np.zeros((0, 2)), np.zeros(0, int))
    with pytest.raises(TypeError, match="uint8 or float32"):
        write_lmdb(tmp_path / "a", np.zeros((2, 2), np.int16), np.zeros(2, int), format="datum")
    with pytest.raises(ValueError, match="format"):
        write_lmdb(tmp_path / "a", np.zeros((2, 2)), np.zeros(2, int), format="hdf5")


def test_write_datum_format_reads_back(tmp_path):
    X = np.random.default_rng(5).integers(0, 256, (6, 3, 2, 2), dtype=np.uint8)
    write_lmdb(tmp_path / "db", X, np.arange(6), format="datum")
    with open_db(tmp_path / "db") as db:
        assert db.format == "datum"
        np.testing.assert_array_equal(np.stack([x for _, x, _ in db]), X)


def test_open_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_db(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not an LMDB"):
        open_db(tmp_path / "plain")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data.mdb").write_bytes(b"\0garbage" * 1000)
    with pytest.raises(DataError, match="not a readable LMDB"):
        open_db(tmp_path / "junk")
    put_raw(tmp_path / "empty", [])
    with pytest.raises(DataError, match="empty"):
        open_db(tmp_path / "empty")
    put_raw(tmp_path / "text", [("a", b"hello world")])
    with pytest.raises(DataError, match="'a' is neither"):
        open_db(tmp_path / "text")
