"""Caffe's ``convert_imageset`` and ``compute_image_mean``: a folder of images and a list
file into a Datum database, and a database's mean image.

Caffe's rules (tools/convert_imageset.cpp, util/io.cpp), kept here:

- a list line is ``relative/path label``: the label is after the *last* space (the path
  may hold spaces); ``root + path`` is read, concatenated as written (the command line
  adds the ``/`` after a folder);
- images are read as OpenCV's ``imread`` reads them: 3 channels in BGR order
  (``IMREAD_COLOR``: a gray image is repeated, an alpha channel dropped), or 1 with
  ``gray`` (``IMREAD_GRAYSCALE``); 16-bit samples keep their high byte; the EXIF
  orientation is applied, as OpenCV 3.1 and later do;
- ``resize_height`` and ``resize_width`` resize only when both are above 0, with OpenCV's
  ``cv::resize`` default (``INTER_LINEAR``: half-pixel centres, edges clamped, 11-bit
  fixed-point weights), :func:`resize_linear`;
- raw records hold ``channels, height, width`` and the C x H x W bytes; with ``encoded``
  (or an ``encode_type``), the file's own bytes are stored when nothing was resized and
  its extension is the encoding (``jpeg`` counts as ``jpg``), else the decoded (resized)
  image encoded again (JPEG at OpenCV's default quality 95);
- the key of line ``i`` (0-based, after the shuffle) is ``%08d_path``;
- an image that cannot be read is skipped, with its line number, as Caffe skips it (Caffe
  logs "Could not open or find file"); ``check_size`` refuses the conversion at the first
  image of another size, as Caffe's ``CHECK`` stops it (nothing is written here).

What differs, on purpose: ``shuffle`` is seeded (Caffe's is seeded from the clock), so the
same command gives the same database; a line without a label, or with one that is not an
int32, is refused with its line number before anything is read (Caffe's ``atoi`` would
make it label 0); blank lines are ignored. Images are decoded by Pillow, not OpenCV: a
PNG's pixels are the same (a colour PNG read as gray with libpng's weights, as OpenCV
has libpng convert it), a JPEG's agree as far as the two libjpeg builds do (a JPEG read
as gray is libjpeg's own gray output, as in OpenCV).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .datum import _image_array, check_label, encode_datum

if TYPE_CHECKING:
    from PIL.Image import Image

#: encodings ``encode_type`` takes, with the Pillow format writing them
ENCODINGS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG", "bmp": "BMP", "tif": "TIFF",
             "tiff": "TIFF", "ppm": "PPM", "pgm": "PPM", "webp": "WEBP"}  # fmt: skip
JPEG_QUALITY = 95  # OpenCV's IMWRITE_JPEG_QUALITY default

# OpenCV's fixed-point resize: weights scaled by 2**11 (INTER_RESIZE_COEF_BITS)
_COEF_SCALE = np.float32(1 << 11)


@dataclass(frozen=True)
class ListEntry:
    """One image of a list file: its line number (1-based), path and label."""

    line: int
    path: str
    label: int


def read_list(listfile: str | os.PathLike[str]) -> list[ListEntry]:
    """The entries of a Caffe list file (``path label`` per line); ValueError naming the
    line of one without an integer label after its last space."""
    entries = []
    with open(listfile, encoding="utf-8", errors="surrogateescape") as f:
        for number, raw in enumerate(f, 1):
            line = raw.rstrip("\r\n").rstrip()
            if not line.strip():
                continue
            path, space, label = line.rpartition(" ")
            if not space or not path:
                raise ValueError(
                    f"{os.fspath(listfile)} line {number}: {line!r} has no label: each line "
                    "is 'relative/path label'"
                )
            try:
                value = int(label)
            except ValueError:
                raise ValueError(
                    f"{os.fspath(listfile)} line {number}: the label {label!r} is not an "
                    "integer (each line is 'relative/path label')"
                ) from None
            try:
                check_label(value, f"line {number}")
            except ValueError as e:
                raise ValueError(f"{os.fspath(listfile)} {e}") from None
            entries.append(ListEntry(number, path, value))
    return entries


def _pillow() -> object:
    try:
        import PIL.Image
    except ImportError:
        raise ImportError(
            "reading images needs Pillow (pip install 'nccltree[images]' or pip install Pillow)"
        ) from None
    return PIL.Image


def imread(path: str, gray: bool = False) -> np.ndarray:
    """An image file as OpenCV's ``imread`` gives it: uint8 H x W x 3 (BGR), or H x W with
    ``gray``; ValueError when it cannot be read as an image."""
    _pillow()
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img = _oriented(img)
            if gray and img.format == "JPEG":
                img.draft("L", img.size)  # libjpeg's own gray output, as OpenCV asks for
            if gray and img.mode not in _GRAY_MODES:
                arr = _to_gray(_image_array(img, "color"), png=img.format == "PNG")
            else:
                arr = _image_array(img, "gray" if gray else "color")
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except UnidentifiedImageError:
        raise ValueError("not an image file Pillow can identify") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ValueError(f"cannot decode it: {e}") from None
    if arr.ndim == 3:
        arr = arr[:, :, ::-1]  # RGB -> BGR, OpenCV's order
    return np.ascontiguousarray(arr)


# Pillow modes that are gray already (their gray reading needs no weights)
_GRAY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def _to_gray(rgb: np.ndarray, png: bool) -> np.ndarray:
    """A colour image's gray reading as OpenCV's ``IMREAD_GRAYSCALE`` computes it: for a
    PNG, libpng's ``png_set_rgb_to_gray(1, 0.299, 0.587)`` (weights 29900 * 32768 / 100000
    and 58700 * 32768 / 100000 truncated, the sum truncated, a gray pixel kept), else
    OpenCV's BGR-to-gray (14-bit weights, rounded)."""
    r, g, b = (rgb[:, :, i].astype(np.uint32) for i in range(3))
    if png:
        gray = (r * 9797 + g * 19234 + b * 3737) >> 15
        return np.where((r == g) & (g == b), r, gray).astype(np.uint8)
    return ((r * 4899 + g * 9617 + b * 1868 + 8192) >> 14).astype(np.uint8)


def _oriented(img: Image) -> Image:
    """The image turned by its EXIF orientation (OpenCV's imread does so since 3.1)."""
    from PIL import ImageOps

    if img.getexif().get(0x0112, 1) != 1:
        return ImageOps.exif_transpose(img)
    return img


def _axis(src: int, dst: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """OpenCV's linear-resize taps along one axis: source indices and fixed-point weights
    (``cv::resize``'s ``xofs``/``ialpha``: float32 positions, clamped at the edges)."""
    scale = 1.0 / (dst / src)  # OpenCV: inv_scale = dsize / ssize, scale = 1 / inv_scale
    f = ((np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    s = np.floor(f).astype(np.int64)
    f = (f - s.astype(np.float32)).astype(np.float32)
    low, high = s < 0, s >= src - 1
    f[low | high] = 0
    s[low] = 0
    s[high] = src - 1
    a0 = np.rint((np.float32(1) - f) * _COEF_SCALE).astype(np.int64)
    a1 = np.rint(f * _COEF_SCALE).astype(np.int64)
    return s, np.minimum(s + 1, src - 1), a0, a1


def resize_linear(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """``cv::resize(img, Size(width, height))`` with its default ``INTER_LINEAR`` for a
    uint8 H x W or H x W x C image: half-pixel centres, edges clamped, OpenCV's 11-bit
    fixed-point weights and its vectorised rounding. Against opencv-python 5.1 every
    sample is within one level (most are equal; tests/test_imageset.py measures it)."""
    if img.dtype != np.uint8 or img.ndim not in (2, 3):
        raise ValueError(
            f"resize_linear takes a uint8 H x W (x C) image, got {img.dtype} {img.shape}"
        )
    if height < 1 or width < 1:
        raise ValueError(f"cannot resize to {height} x {width}")
    h0, w0 = img.shape[:2]
    if (h0, w0) == (height, width):
        return img.copy()
    src = img.astype(np.int64)
    xs, xs1, xa0, xa1 = _axis(w0, width)
    ys, ys1, ya0, ya1 = _axis(h0, height)
    across = xa0.shape + (1,) * (img.ndim - 2)  # the weights broadcast over channels
    rows = src[:, xs] * xa0.reshape(across) + src[:, xs1] * xa1.reshape(across)
    col = (-1,) + (1,) * (img.ndim - 1)
    b0, b1 = ya0.reshape(col), ya1.reshape(col)
    # OpenCV's VResizeLinearVec_32s8u: (((r0 >> 4) * b0) >> 16) + ... rounded by >> 2
    out = (((rows[ys] >> 4) * b0) >> 16) + (((rows[ys1] >> 4) * b1) >> 16)
    return np.clip((out + 2) >> 2, 0, 255).astype(np.uint8)


def encode_image(img: np.ndarray, encoding: str) -> bytes:
    """A BGR (or gray) uint8 image as the bytes of an image file of ``encoding`` (as
    ``cv::imencode("." + encoding, img)``; JPEG at quality 95)."""
    _pillow()
    from PIL import Image

    fmt = ENCODINGS.get(encoding.lower())
    if fmt is None:
        raise ValueError(f"cannot encode images as {encoding!r}; known: {', '.join(ENCODINGS)}")
    rgb = img if img.ndim == 2 else img[:, :, ::-1]
    bio = io.BytesIO()
    extra = {"quality": JPEG_QUALITY} if fmt == "JPEG" else {}
    Image.fromarray(np.ascontiguousarray(rgb)).save(bio, format=fmt, **extra)
    return bio.getvalue()


def _match_ext(path: str, encoding: str) -> bool:
    """Caffe's ``matchExt``: the file's extension is the encoding (``jpeg`` for ``jpg``)."""
    dot = path.rfind(".")
    ext = (path[dot + 1 :] if dot >= 0 else path).lower()
    enc = encoding.lower()
    return ext == enc or (enc == "jpg" and ext == "jpeg")


@dataclass
class ImagesetResult:
    """What :func:`imageset_records` did: records written, images skipped (line number,
    path, reason), the shape of the first record and the list's length."""

    written: int = 0
    skipped: list[tuple[int, str, str]] = field(default_factory=list)
    shape: tuple[int, ...] | None = None
    total: int = 0


@dataclass(frozen=True)
class ImagesetOptions:
    """``convert_imageset``'s flags."""

    resize_height: int = 0
    resize_width: int = 0
    gray: bool = False
    shuffle: bool = False
    seed: int = 0
    encoded: bool = False
    encode_type: str = ""
    check_size: bool = False

    def __post_init__(self) -> None:
        if self.encode_type and self.encode_type.lower() not in ENCODINGS:
            raise ValueError(
                f"--encode-type {self.encode_type!r} is not an encoding known here "
                f"({', '.join(ENCODINGS)})"
            )


def imageset_records(
    root: str,
    entries: list[ListEntry],
    options: ImagesetOptions,
    result: ImagesetResult,
    *,
    on_skip: Callable[[ListEntry, str], None] | None = None,
) -> Iterator[tuple[bytes, bytes]]:
    """``(key, Datum)`` of every image of ``entries`` that can be read, in Caffe's order
    (shuffled with ``options.seed`` when ``options.shuffle``); ``result`` counts them and
    the skipped ones (``on_skip(entry, reason)`` is told of each). ValueError (naming the
    line) with ``check_size`` at an image of another size than the first."""
    o = options
    order = list(entries)
    if o.shuffle:
        perm = np.random.default_rng(o.seed).permutation(len(order))
        order = [order[i] for i in perm]
    result.total = len(order)
    resize = o.resize_height > 0 and o.resize_width > 0  # Caffe resizes only then
    encoded = o.encoded or bool(o.encode_type)  # an encode_type implies encoded, as in Caffe
    for line_id, entry in enumerate(order):
        path = root + entry.path
        try:
            img = imread(path, o.gray)
            if resize:
                img = resize_linear(img, o.resize_height, o.resize_width)
            chw = img[None] if img.ndim == 2 else img.transpose(2, 0, 1)
            if encoded:
                enc = o.encode_type
                if not enc:
                    dot = entry.path.rfind(".")
                    if dot < 0:
                        raise ValueError("no extension to take the encoding from (--encode-type)")
                    enc = entry.path[dot + 1 :].lower()
                if not resize and _match_ext(entry.path, enc):
                    with open(path, "rb") as f:
                        data = f.read()
                else:
                    data = encode_image(img, enc)
                record = encode_datum(None, entry.label, encoded=data)
            else:
                record = encode_datum(np.ascontiguousarray(chw), entry.label)
        except (ValueError, OSError) as e:
            result.skipped.append((entry.line, entry.path, str(e)))
            if on_skip is not None:
                on_skip(entry, str(e))
            continue
        if result.shape is None:
            result.shape = tuple(chw.shape)
        elif o.check_size and tuple(chw.shape) != result.shape:
            raise ValueError(
                f"line {entry.line}: {entry.path} is {' x '.join(map(str, chw.shape))}, the "
                f"first image {' x '.join(map(str, result.shape))} (--check-size; resize "
                "with --resize-height and --resize-width)"
            )
        result.written += 1
        yield b"%08d_%s" % (line_id, os.fsencode(entry.path)), record


def compute_image_mean(
    db: str | os.PathLike[str], *, progress: Callable[[int, int], None] | None = None
) -> tuple[np.ndarray, int]:
    """Caffe's ``compute_image_mean``: the mean record of a Datum (or nccltree) database,
    float32 C x H x W, and the number of records. Encoded images are decoded as stored
    (Caffe's ``DecodeDatumNative``). Summed in float64 (Caffe sums in float32, which
    drifts on large databases). ValueError naming the first record of another shape;
    ``progress(done, total)`` is called every 1000 records and at the end."""
    from .errors import DataError
    from .lmdb_io import open_db

    with open_db(db) as d:
        total = len(d)
        want = d.shape
        if len(want) != 3:
            raise ValueError(f"{os.fspath(db)}: records of shape {want} are not C x H x W images")
        acc = np.zeros(want, np.float64)
        count = 0
        try:
            for key, x, _ in d:
                if x.shape != want:
                    raise ValueError(
                        f"{os.fspath(db)}: record {key.decode('utf-8', 'replace')} (number "
                        f"{count}) has shape {x.shape}, the first {want}: a mean needs one "
                        "size (convert with --resize-height/--resize-width)"
                    )
                acc += x
                count += 1
                if progress is not None and count % 1000 == 0:
                    progress(count, total)
        except DataError as e:
            raise ValueError(str(e)) from None
    if progress is not None:
        progress(count, total)
    return (acc / count).astype(np.float32), count
