"""Caffe ``Datum`` records, decoded and encoded from the protobuf wire format by hand.

The message, from caffe.proto::

    message Datum {
      optional int32 channels = 1;  optional int32 height = 2;  optional int32 width = 3;
      optional bytes data = 4;      // uint8, C x H x W
      optional int32 label = 5;
      repeated float float_data = 6;  // used instead of data for float records
      optional bool encoded = 7 [default = false];  // data holds a JPEG/PNG file
    }

Caffe writes ``float_data`` unpacked (one tag per float); packed arrays are accepted too.
Unknown fields are skipped, as protobuf requires. No protobuf package is needed.
"""

from __future__ import annotations

import io
import struct
from typing import TYPE_CHECKING

import numpy as np

from .errors import DataError
from .format import keyname

if TYPE_CHECKING:
    from PIL.Image import Image

_F32 = np.dtype("<f4")
# Wire types: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32.
_TAG_DATA = 4 << 3 | 2
_TAG_FLOAT = 6 << 3 | 5
_TAG_FLOAT_PACKED = 6 << 3 | 2
_PAIR = np.dtype([("tag", "u1"), ("value", _F32)])


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def read_field(mv: memoryview, pos: int, end: int, what: str) -> tuple[int, int, int, int]:
    """The field whose tag is at ``pos`` of the message ``what`` ending at ``end``:
    ``(field, wire, value, pos)``. A varint (wire type 0): its value, ``pos`` past it; a
    length-delimited field (2): its length, ``pos`` at its bytes (ValueError if they run
    past ``end``); a fixed64 or fixed32 (1, 5): value 0, ``pos`` at its bytes. Another
    wire type: ValueError. The caller steps over the bytes of 1, 2 and 5."""
    tag, pos = _varint(mv, pos)
    field, wire = tag >> 3, tag & 7
    if wire == 0 or wire == 2:
        value, pos = _varint(mv, pos)
        if wire == 2 and pos + value > end:
            raise ValueError(f"a field runs past the end of {what}")
        return field, wire, value, pos
    if wire == 1 or wire == 5:
        return field, wire, 0, pos
    raise ValueError(f"unsupported wire type {wire} (field {field})")


INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def _int32(v: int) -> int:
    # Negative int32 values travel as 64-bit two's complement varints; a protobuf reader
    # keeps the low 32 bits of a longer one, and so does this one (Caffe sees the same).
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def check_label(label: int, where: str = "a Datum") -> int:
    """``label`` as an int32, or ValueError: Caffe's ``Datum.label`` is an int32 field, and
    a protobuf reader would see another value for anything outside it."""
    label = int(label)
    if not INT32_MIN <= label <= INT32_MAX:
        raise ValueError(
            f"{where} has label {label}, outside int32 ({INT32_MIN} .. {INT32_MAX}); "
            "a Caffe Datum's label is an int32 field, so Caffe would read another value"
        )
    return label


class DatumFields:
    """The raw fields of one Datum; ``data`` is a zero-copy slice of the record."""

    __slots__ = ("channels", "height", "width", "data", "data_offset", "label", "floats", "encoded")

    def __init__(self) -> None:
        self.channels = self.height = self.width = 0
        self.data: memoryview | None = None
        self.data_offset = -1
        self.label = 0
        self.floats: list[np.ndarray] = []
        self.encoded = False


def parse_datum(buf: bytes | memoryview) -> DatumFields:
    """Parse the wire format of one Datum (no image decoding); ValueError if malformed."""
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    f = DatumFields()
    pos, end = 0, len(mv)
    try:
        while pos < end:
            # inline, not read_field: this loop runs once a record (a label scan, say),
            # and the call per field would make it about half again as slow
            tag, pos = _varint(mv, pos)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                value, pos = _varint(mv, pos)
                if field == 1:
                    f.channels = _int32(value)
                elif field == 2:
                    f.height = _int32(value)
                elif field == 3:
                    f.width = _int32(value)
                elif field == 5:
                    f.label = _int32(value)
                elif field == 7:
                    f.encoded = bool(value)
            elif wire == 2:
                size, pos = _varint(mv, pos)
                if pos + size > end:
                    raise ValueError("field runs past the end of the record")
                if field == 4:
                    f.data, f.data_offset = mv[pos : pos + size], pos
                elif field == 6:
                    if size % 4:
                        raise ValueError("packed float_data length is not a multiple of 4")
                    f.floats.append(np.frombuffer(mv, _F32, size // 4, pos))
                pos += size
            elif wire == 5:
                if field == 6:
                    pos = _float_run(mv, pos - 1, f.floats)
                else:
                    pos += 4
            elif wire == 1:
                pos += 8
            else:
                raise ValueError(f"unsupported wire type {wire} (field {field})")
            if pos > end:
                raise ValueError("record truncated")
    except (ValueError, IndexError, struct.error) as e:
        raise ValueError(f"not a valid Caffe Datum: {e}") from None
    return f


def _float_run(mv: memoryview, tag_pos: int, out: list[np.ndarray]) -> int:
    """Read a run of unpacked float_data elements (tag byte + 4 bytes each) at once."""
    # Caffe writes all float_data elements back to back, so the run is one strided view;
    # it ends at the first 5-byte step whose first byte is not the float_data tag.
    pairs = np.frombuffer(mv, _PAIR, (len(mv) - tag_pos) // 5, tag_pos)
    other = np.flatnonzero(pairs["tag"] != _TAG_FLOAT)
    n = int(other[0]) if other.size else pairs.size
    out.append(pairs["value"][:n])
    return tag_pos + 5 * n


# How encoded images are decoded, as Caffe's data layer does it (data_transformer.cpp):
# "native" by default (DecodeDatumToCVMatNative: cv::imdecode(..., IMREAD_UNCHANGED), so
# an image keeps its own channels: 1 gray, 3 BGR, 4 BGRA), "color" with force_color
# (IMREAD_COLOR: always 3, BGR) and "gray" with force_gray (IMREAD_GRAYSCALE: always 1).
IMAGE_MODES = ("native", "color", "gray")


def image_mode(force_color: bool = False, force_gray: bool = False) -> str:
    """The decoding of encoded Datums that Caffe's ``force_color`` / ``force_gray`` ask for."""
    if force_color and force_gray:
        raise ValueError("force_color and force_gray exclude each other (as in Caffe)")
    return "color" if force_color else "gray" if force_gray else "native"


def channels_hint(want: int) -> str:
    """The advice for an encoded image whose channels differ from the database's ``want``
    (each decoded as stored): force one kind, the database's first (gray for a gray one)."""
    gray = "force_gray (--force-gray) to read every image as 1 channel"
    color = "force_color (--force-color) to read every image as 3 channels (BGR)"
    first, second = (gray, color) if want == 1 else (color, gray)
    return f"its image has another number of channels: decode with {first}, or {second}"


def decode_datum(
    buf: bytes | memoryview,
    key: bytes | str = b"?",
    *,
    force_color: bool = False,
    force_gray: bool = False,
) -> tuple[np.ndarray, int]:
    """Decode one Datum into ``(array, label)``.

    Unencoded ``data`` gives uint8 C×H×W (a zero-copy view of ``buf``); ``float_data``
    gives float32 C×H×W; ``encoded`` data (a JPEG/PNG file) is decoded with Pillow to
    uint8 C×H×W as Caffe's data layer decodes it with OpenCV: by default with the image's
    own channels (1 gray; 3 colour, BGR; 4 with alpha, BGRA), with ``force_color`` as 3
    BGR channels, with ``force_gray`` as 1 channel (the two flags apply to encoded
    Datums only, as in Caffe). A record that does not decode raises DataError naming
    ``key``.
    """
    mode = image_mode(force_color, force_gray)
    try:
        return _decode(buf, mode)
    except ValueError as e:
        raise DataError(f"record {keyname(key)}: {e}") from None


def _decode(buf: bytes | memoryview, mode: str = "native") -> tuple[np.ndarray, int]:
    f = parse_datum(buf)
    if f.encoded:
        if f.data is None:
            raise ValueError("an encoded Datum without data")
        return _decode_image(f.data, mode), f.label
    shape = (f.channels, f.height, f.width)
    count = f.channels * f.height * f.width
    if f.data is not None and len(f.data):
        if len(f.data) != count:
            raise ValueError(
                f"Datum data has {len(f.data)} bytes, channels x height x width = {shape} "
                f"needs {count}"
            )
        return np.frombuffer(f.data, np.uint8).reshape(shape), f.label
    if f.floats:
        values = f.floats[0] if len(f.floats) == 1 else np.concatenate(f.floats)
        if values.size != count:
            raise ValueError(
                f"Datum float_data has {values.size} values, channels x height x width = "
                f"{shape} needs {count}"
            )
        return values.reshape(shape), f.label
    raise ValueError("a Datum with neither data nor float_data")


# Pillow modes of 16 or 32 bits per sample: OpenCV decodes them unchanged to 16-bit (which
# Caffe's transformer refuses: "Image data type must be unsigned byte") and reduces them
# to 8 bits (the high byte) only when a colour or gray decoding is forced.
_WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def _decode_image(data: bytes | memoryview, mode: str = "native") -> np.ndarray:
    """Decode an encoded image (JPEG, PNG, ...) to uint8 C×H×W, channels as OpenCV
    orders them (BGR, BGRA); ``mode`` is one of IMAGE_MODES."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError(
            "holds an encoded image; decoding it needs Pillow "
            "(pip install 'nccltree[images]' or pip install Pillow)"
        ) from None
    try:
        with Image.open(io.BytesIO(data)) as img:
            arr = _image_array(img, mode)
    except UnidentifiedImageError:
        head = bytes(data[:8])
        raise ValueError(
            f"its encoded data ({len(data)} bytes, starting {head!r}) is not an image "
            "file Pillow can identify (JPEG, PNG, ...)"
        ) from None
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for a damaged file
        raise ValueError(f"cannot decode its encoded image ({len(data)} bytes): {e}") from None
    if arr.ndim == 2:
        return arr[None, :, :].copy()
    order = [2, 1, 0, 3][: arr.shape[2]]  # RGB(A) -> BGR(A), as OpenCV stores colour
    return np.ascontiguousarray(arr[:, :, order].transpose(2, 0, 1))


def _image_array(img: Image, mode: str) -> np.ndarray:
    """Pillow image -> uint8 H×W or H×W×C (RGB or RGBA order), decoded per ``mode``."""
    if img.mode in _WIDE_MODES:
        if mode == "native":
            raise ValueError(
                f"its encoded image has {img.mode!r} samples (more than 8 bits); Caffe's "
                "default decoding refuses them too (image data must be unsigned bytes): "
                "decode with force_gray (or force_color) to reduce them to 8 bits"
            )
        wide = np.asarray(img)
        if wide.dtype.kind == "f":
            raise ValueError(f"its encoded image has floating-point {img.mode!r} samples")
        gray = (wide.astype(np.uint32) >> 8).astype(np.uint8)  # the high byte, as OpenCV
        return gray if mode == "gray" else np.repeat(gray[:, :, None], 3, axis=2)
    if mode == "gray":
        return np.asarray(img.convert("L"))
    if mode == "color":
        return np.asarray(img.convert("RGB"))
    # native: the channels the file has, as cv::imdecode(IMREAD_UNCHANGED) gives them
    if img.mode in ("1", "L"):
        return np.asarray(img.convert("L"))
    alpha = img.mode in ("RGBA", "RGBa", "LA", "La", "PA") or (
        img.mode in ("P", "RGB") and "transparency" in img.info
    )
    return np.asarray(img.convert("RGBA" if alpha else "RGB"))


def _put_varint(out: bytearray, value: int) -> None:
    value &= 0xFFFFFFFFFFFFFFFF
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def encode_datum(
    x: np.ndarray | None,
    label: int,
    *,
    encoded: bytes | None = None,
    packed_floats: bool = False,
) -> bytes:
    """Encode a Datum of ``x`` and ``label`` as Caffe does.

    ``x`` uint8 C×H×W (or H×W, one channel) goes to ``data``; float32 goes to
    ``float_data`` (unpacked unless ``packed_floats``). With ``encoded=`` (the bytes of an
    image file) the Datum is an encoded one, as ``convert_imageset --encoded`` writes.
    """
    label = check_label(label)
    out = bytearray()
    if encoded is not None:
        out += bytes([_TAG_DATA])
        _put_varint(out, len(encoded))
        out += encoded
        out.append(5 << 3)
        _put_varint(out, int(label))
        out += bytes([7 << 3, 1])
        return bytes(out)
    if x is None:
        raise TypeError("encode_datum needs an array x or encoded= image bytes")
    x = np.asarray(x)
    if x.ndim == 2:
        x = x[None]
    if x.ndim != 3:
        raise ValueError(f"a Datum holds a C x H x W (or H x W) array, got shape {x.shape}")
    for field, dim in zip((1, 2, 3), x.shape, strict=True):
        out.append(field << 3)
        _put_varint(out, dim)
    if x.dtype == np.uint8:
        raw = np.ascontiguousarray(x).tobytes()
        out.append(_TAG_DATA)
        _put_varint(out, len(raw))
        out += raw
    elif x.dtype == np.float32:
        values = np.ascontiguousarray(x, dtype=_F32).ravel()
        if packed_floats:
            out.append(_TAG_FLOAT_PACKED)
            _put_varint(out, values.nbytes)
            out += values.tobytes()
        else:
            pairs = np.empty(values.size, _PAIR)
            pairs["tag"], pairs["value"] = _TAG_FLOAT, values
            out += pairs.tobytes()
    else:
        raise TypeError(f"a Datum holds uint8 or float32 data, got {x.dtype}")
    out.append(5 << 3)
    _put_varint(out, int(label))
    return bytes(out)


def looks_like_datum(buf: bytes | memoryview) -> bool:
    """True when ``buf`` parses as a Datum carrying some data."""
    try:
        f = parse_datum(buf)
    except ValueError:
        return False
    return f.data is not None or bool(f.floats)
