"""``nccltree-data``: build and inspect record databases.

nccltree-data convert IN.npz OUT_DB        arrays X and y of an .npz file -> LMDB
nccltree-data info DB [--verify]           records, format, shape, dtype, labels, size;
                                           --verify reads every record, lists the bad ones
nccltree-data make synthetic OUT_DB ...    a seeded learnable task of any size
nccltree-data make digits OUT_DB           scikit-learn's 8x8 digits (needs scikit-learn)
nccltree-data convert-imageset ROOT LIST OUT_DB   Caffe's convert_imageset: images named
                                           by a list file -> Caffe Datum LMDB (needs Pillow)
nccltree-data mean DB OUT                  Caffe's compute_image_mean: OUT.binaryproto
                                           (a BlobProto) or OUT.npy

Exit statuses as in :mod:`nccltree.cli._common`: 2 when an input does not exist or does not
hold what the flags name, the output is already there (without ``--overwrite``) or a
dataset cannot be made (nothing is written then); 1 when reading or writing a database
fails; 3 when ``info --verify`` finds bad records.

Databases are written all or nothing: a killed ``convert`` or ``make`` leaves no partial
database, and the next run to the same path removes what the killed one left.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ._common import ExitStatus, RuntimeFailure, checking, int_at_least, make_parser, run_main

PROG = "nccltree-data"


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(t) for t in text.replace("x", ",").split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must be sizes like 64 or 1,8,8; got {text!r}"
        ) from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(
            f"shape must be positive sizes like 64 or 1,8,8; got {text!r}"
        )
    return dims


_positive = int_at_least(1)
_nonnegative = int_at_least(0)


def _writer_flags(p: argparse.ArgumentParser, *, datum_ok: bool = True) -> None:
    p.add_argument("out_db", metavar="OUT_DB", help="LMDB environment directory to create")
    if datum_ok:
        p.add_argument(
            "--format",
            choices=["nccltree", "datum"],
            default="nccltree",
            help="record format: nccltree records (any shape and dtype; the default) or "
            "Caffe Datum (uint8 or float32, C x H x W, int32 labels) for Caffe tools",
        )
    else:
        p.add_argument(
            "--format",
            choices=["nccltree"],
            default="nccltree",
            help="record format: nccltree records only (float32 records; for Caffe "
            "Datums, save the arrays to an .npz and use convert --format datum)",
        )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the records of an existing database at OUT_DB (default: refuse)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser(PROG, "Build and inspect LMDB record databases for nccltree's DataReader.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "convert",
        help="write the arrays of an .npz file as a database",
        description="Write X[i] with label y[i] of an .npz file as record i of a new LMDB "
        "database (keys 00000000, 00000001, ...).",
    )
    p.add_argument(
        "in_npz", metavar="IN.npz", help="numpy .npz file holding the records and labels"
    )
    _writer_flags(p)
    p.add_argument(
        "--x", dest="x_name", default="X", help="name of the records array in the .npz (default: X)"
    )
    p.add_argument(
        "--y", dest="y_name", default="y", help="name of the integer labels array (default: y)"
    )

    p = sub.add_parser(
        "info",
        help="describe a database",
        description="Print a database's record count, format, record shape and dtype, label "
        "range and size on disk (reads every label once). With --verify, read and decode "
        "every record as the reader would and list each bad one (exit status 3 if any).",
    )
    p.add_argument("db", metavar="DB", help="LMDB environment directory (or data file)")
    p.add_argument(
        "--format",
        choices=["auto", "nccltree", "datum"],
        default="auto",
        help="record format; auto (default) detects it from the first record",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read and decode every record; list each one the reader would refuse (does "
        "not decode, or another shape or dtype) and exit with status 3 if there is any",
    )
    color = p.add_mutually_exclusive_group()
    color.add_argument(
        "--force-color",
        action="store_true",
        help="decode encoded Datum images as 3 channels (BGR), as Caffe's force_color",
    )
    color.add_argument(
        "--force-gray",
        action="store_true",
        help="decode encoded Datum images as 1 channel, as Caffe's force_gray (default: "
        "each image keeps its channels, as Caffe's default decoding)",
    )

    p = sub.add_parser(
        "convert-imageset",
        help="Caffe's convert_imageset: images named by a list file -> Datum database",
        description="Read ROOT + path for each 'path label' line of LISTFILE and write "
        "a Caffe Datum database, as Caffe's convert_imageset: images in BGR order, 3 "
        "channels (1 with --gray), keys %08d_path, resized with OpenCV's INTER_LINEAR "
        "rule when both --resize-height and --resize-width are set. An image that cannot "
        "be read is skipped with its line number, as Caffe skips it; a line without an "
        "integer label is refused before anything is written. Written all or nothing "
        "(needs Pillow).",
    )
    p.add_argument("root", metavar="ROOT", help="folder the list's paths are relative to "
                   "(a folder is joined with /; anything else is a prefix the paths are "
                   "appended to, as Caffe concatenates ROOT and path)")  # fmt: skip
    p.add_argument("listfile", metavar="LISTFILE", help="lines of 'relative/path label'")
    p.add_argument("out_db", metavar="OUT_DB", help="LMDB environment directory to create")
    for caffe, ours, what in (
        ("resize_height", "--resize-height", "height"),
        ("resize_width", "--resize-width", "width"),
    ):
        p.add_argument(
            ours,
            f"--{caffe}",
            dest=caffe,
            type=_nonnegative,
            default=0,
            metavar="N",
            help=f"resize every image to this {what} (with the other one; 0: keep sizes) "
            "(default: 0)",
        )
    p.add_argument("--gray", action="store_true", help="read images as 1 channel")
    p.add_argument(
        "--shuffle",
        action="store_true",
        help="write the images in a random order, seeded by --seed (Caffe's is unseeded)",
    )
    p.add_argument("--seed", type=_nonnegative, default=0, help="--shuffle's seed (default: 0)")
    p.add_argument(
        "--encoded",
        action="store_true",
        help="store image files (encoded Datums) instead of pixels: the file itself when "
        "nothing is resized and its extension is the encoding, else the image encoded again",
    )
    p.add_argument(
        "--encode-type",
        "--encode_type",
        dest="encode_type",
        default="",
        metavar="EXT",
        help="encode as EXT (png, jpg, ...; implies --encoded) (default: each file's extension)",
    )
    p.add_argument(
        "--check-size",
        "--check_size",
        dest="check_size",
        action="store_true",
        help="refuse the conversion at the first image whose size differs from the first's",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the records of an existing database at OUT_DB (default: refuse)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress and no skip messages")

    p = sub.add_parser(
        "mean",
        help="Caffe's compute_image_mean: the mean image of a database",
        description="Average every record of DB (encoded images decoded as stored) and "
        "write the C x H x W mean to OUT: a .binaryproto (Caffe's BlobProto, as "
        "compute_image_mean writes it; for --mean and Caffe's mean_file) or, for a name "
        "ending .npy, a numpy file. Prints the mean of each channel (for --mean V,V,V).",
    )
    p.add_argument("db", metavar="DB", help="LMDB environment directory")
    p.add_argument("out", metavar="OUT", help="mean.binaryproto or mean.npy")
    p.add_argument(
        "--overwrite", action="store_true", help="replace OUT if it exists (default: refuse)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress")

    make = sub.add_parser(
        "make",
        help="build a dataset without network access",
        description="Build a ready-made dataset as a database.",
    )
    msub = make.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    p = msub.add_parser(
        "synthetic",
        help="a seeded, learnable synthetic classification task of any size",
        description="Gaussian blobs (several per class) pushed through a fixed random "
        "nonlinear map; float32 records, int64 labels. The same flags give the same data.",
    )
    _writer_flags(p, datum_ok=False)
    p.add_argument("--n", type=_positive, default=4096, help="number of records (default: 4096)")
    p.add_argument(
        "--shape", type=_shape, default=(64,), help="record shape, e.g. 64 or 1,8,8 (default: 64)"
    )
    p.add_argument("--classes", type=_positive, default=10, help="number of classes (default: 10)")
    p.add_argument("--seed", type=_nonnegative, default=0, help="task seed (default: 0)")
    p.add_argument(
        "--split",
        choices=["train", "test"],
        default="train",
        help="which independent sample of the task to write (default: train)",
    )
    p = msub.add_parser(
        "digits",
        help="scikit-learn's 8x8 handwritten digits (needs scikit-learn)",
        description="The 1797 8x8 digit images that ship inside scikit-learn: uint8 "
        "1 x 8 x 8 records (values 0..16), labels 0..9.",
    )
    _writer_flags(p)
    p.add_argument(
        "--split",
        choices=["all", "train", "test"],
        default="all",
        help="all images, or a fixed 80/20 train/test split (default: all)",
    )
    return parser


def _check_out(args: argparse.Namespace) -> None:
    """The output can be written (checked before anything is read or made)."""
    from ..data.lmdb_io import check_target

    check_target(args.out_db, args.overwrite, flag="--overwrite")


def _load_npz(path: str, x_name: str, y_name: str) -> tuple[np.ndarray, np.ndarray]:
    """The two arrays of an .npz file, or a ValueError saying what the file is instead."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path!r} is a directory, not an .npz file")
    try:
        loaded = np.load(path, allow_pickle=False)
    except ValueError:  # numpy's reason names pickles: the file is not numpy's at all
        raise ValueError(
            f"{path} is not a numpy .npz file (save one with numpy.savez(path, X=..., y=...))"
        ) from None
    if isinstance(loaded, np.ndarray):
        raise ValueError(
            f"{path} is a .npy file holding one array; convert needs an .npz holding the "
            f"records and the labels (numpy.savez(path, {x_name}=..., {y_name}=...))"
        )
    with loaded as f:
        missing = [k for k in (x_name, y_name) if k not in f.files]
        if missing:
            raise ValueError(
                f"{path} has no array named {', '.join(missing)}; it holds: "
                f"{', '.join(f.files) or 'nothing'} (choose with --x / --y)"
            )
        out = []
        for name in (x_name, y_name):
            try:
                out.append(f[name])
            except ValueError:  # an object array: numpy's reason names pickles
                raise ValueError(
                    f"array {name!r} of {path} holds Python objects; convert needs numeric arrays"
                ) from None
    return out[0], out[1]


def _convert(args: argparse.Namespace) -> int:
    from ..data import write_lmdb
    from ..data.lmdb_io import check_arrays

    with checking():
        _check_out(args)
        x, y = _load_npz(args.in_npz, args.x_name, args.y_name)
        check_arrays(x, y, args.format)
    n = write_lmdb(args.out_db, x, y, format=args.format, overwrite=args.overwrite)
    print(
        f"wrote {n} {args.format} records of shape {tuple(x.shape[1:])} {x.dtype} to {args.out_db}"
    )
    return ExitStatus.OK


def _make(args: argparse.Namespace) -> int:
    from ..data import digits, synthetic, write_lmdb

    with checking():  # scikit-learn missing, a task its arguments cannot make
        _check_out(args)
        if args.dataset == "synthetic":
            x, y = synthetic(args.n, args.shape, args.classes, args.seed, split=args.split)
        else:
            x, y = digits(args.split)
    n = write_lmdb(args.out_db, x, y, format=args.format, overwrite=args.overwrite)
    print(
        f"wrote {n} {args.dataset} records of shape {tuple(x.shape[1:])} {x.dtype} "
        f"({int(y.max()) + 1} classes) to {args.out_db}"
    )
    return ExitStatus.OK


def _info(args: argparse.Namespace) -> int:
    from ..data import db_info

    with checking():
        if not os.path.exists(args.db):
            raise FileNotFoundError(f"no LMDB database at {args.db!r}")
    force = {"force_color": args.force_color, "force_gray": args.force_gray}
    if args.verify:
        return _verify(args, force)
    info = db_info(args.db, args.format, **force)
    if args.json:
        print(json.dumps(info))
        return ExitStatus.OK
    rows = [
        ("path", info["path"]),
        ("records", str(info["records"])),
        ("format", info["format"]),
        ("shape", " x ".join(map(str, info["shape"])) or "scalar"),
        ("dtype", info["dtype"]),
        ("record", f"{info['record_bytes']} bytes of data"),
        ("labels", f"{info['label_min']} .. {info['label_max']} ({info['classes']} distinct)"),
        ("first key", info["first_key"]),
        ("size", f"{info['size_bytes'] / 1e6:.2f} MB on disk"),
    ]
    for name, value in rows:
        print(f"{name:<10} {value}")
    return ExitStatus.OK


def _verify(args: argparse.Namespace, force: dict[str, bool]) -> int:
    from ..data.lmdb_io import verify_db

    report = verify_db(args.db, args.format, **force)
    bad = report["bad"]
    if args.json:
        print(json.dumps(report), flush=True)
    if report["records"] == 0:  # nothing verified is not "all good": info says so too
        raise RuntimeFailure(f"the database at {args.db!r} is empty")
    if not args.json:
        for b in bad:
            print(f"bad record {b['key']} (number {b['number']} in key order): {b['reason']}")
        shape = " x ".join(map(str, report["shape"] or [])) or "none"
        print(
            f"verified {report['records']} {report['format'] or 'unknown'} records of shape "
            f"{shape} {report['dtype'] or ''}: "
            + (f"{len(bad)} bad" if bad else "all good").rstrip()
        )
    return ExitStatus.WRONG if bad else ExitStatus.OK


def _convert_imageset(args: argparse.Namespace) -> int:
    from ..data.imageset import ImagesetOptions, ImagesetResult, imageset_records, read_list
    from ..data.lmdb_io import write_records
    from ._common import Progress

    with checking():
        _check_out(args)
        root = args.root
        if os.path.isdir(root):
            root = root if root.endswith(os.sep) else root + os.sep
        elif not os.path.isdir(os.path.dirname(root) or "."):
            raise FileNotFoundError(f"ROOT {args.root!r} is not a folder (nor a prefix in one)")
        if not os.path.isfile(args.listfile):
            raise FileNotFoundError(f"no list file at {args.listfile!r}")
        options = ImagesetOptions(
            resize_height=args.resize_height,
            resize_width=args.resize_width,
            gray=args.gray,
            shuffle=args.shuffle,
            seed=args.seed,
            encoded=args.encoded,
            encode_type=args.encode_type,
            check_size=args.check_size,
        )
        entries = read_list(args.listfile)
        if not entries:
            raise ValueError(f"{args.listfile} lists no image")
        from ..data.imageset import _pillow

        _pillow()
    if bool(args.resize_height) != bool(args.resize_width):
        print(
            "note: only one of --resize-height/--resize-width is set: images keep their size "
            "(Caffe resizes only when both are)",
            file=sys.stderr,
        )
    progress = Progress(sys.stderr, args.quiet, redraw_s=0.2)
    result = ImagesetResult()

    def skipped(entry: object, reason: str) -> None:
        line, path = getattr(entry, "line", "?"), getattr(entry, "path", "?")
        progress.message(f"skipped line {line} of {args.listfile}: {path}: {reason}")

    def records() -> Iterator[tuple[bytes, bytes]]:
        every = max(1, min(1000, len(entries) // 10))
        for i, item in enumerate(imageset_records(root, entries, options, result,
                                                  on_skip=skipped), 1):  # fmt: skip
            yield item
            done = len(result.skipped) + i
            progress.show(f"{done}/{len(entries)} images", log=done % every == 0)
        progress.show(
            f"{len(entries)}/{len(entries)} images, {len(result.skipped)} skipped", log=False,
            last=True,
        )  # fmt: skip

    n = write_records(args.out_db, _nonempty(records(), args.listfile), overwrite=args.overwrite)
    kind = "encoded" if args.encoded or args.encode_type else "raw"
    shape = " x ".join(map(str, result.shape or ()))
    print(
        f"wrote {n} {kind} Datum records (first {shape}) to {args.out_db}"
        + (f"; skipped {len(result.skipped)} images that could not be read, as Caffe "
           f"skips them (lines {', '.join(str(s[0]) for s in result.skipped[:10])}"
           f"{', ...' if len(result.skipped) > 10 else ''})" if result.skipped else "")
    )  # fmt: skip
    return ExitStatus.OK


def _nonempty(items: Iterator[tuple[bytes, bytes]], listfile: str) -> Iterator[tuple[bytes, bytes]]:
    """``items``, or a RuntimeFailure when there is none (every image skipped): no empty
    database is written."""
    empty = True
    for item in items:
        empty = False
        yield item
    if empty:
        raise RuntimeFailure(f"no image of {listfile} could be read: nothing written")


def _mean(args: argparse.Namespace) -> int:
    from ..data.blobproto import write_blobproto
    from ..data.imageset import compute_image_mean
    from ._common import Progress

    with checking():
        if not os.path.exists(args.db):
            raise FileNotFoundError(f"no LMDB database at {args.db!r}")
        if os.path.exists(args.out) and not args.overwrite:
            raise FileExistsError(f"{args.out} exists (--overwrite replaces it)")
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"no folder {parent} to write {args.out} in")
    progress = Progress(sys.stderr, args.quiet, redraw_s=0.2)
    mean, count = compute_image_mean(
        args.db, progress=lambda done, total: progress.show(
            f"{done}/{total} records", log=True, last=done == total)
    )  # fmt: skip
    if args.out.endswith(".npy"):
        tmp = f"{args.out}.tmp{os.getpid()}.npy"
        np.save(tmp, mean)
        os.replace(tmp, args.out)
    else:
        write_blobproto(args.out, mean)
    channels = ", ".join(f"{v:.4f}" for v in mean.reshape(mean.shape[0], -1).mean(axis=1))
    print(
        f"wrote the mean of {count} records ({' x '.join(map(str, mean.shape))}) to "
        f"{args.out}; mean value per channel: {channels}"
    )
    return ExitStatus.OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see ``--help``)."""
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "convert-imageset": _convert_imageset,
        "mean": _mean,
        "convert": _convert,
        "info": _info,
        "make": _make,
    }
    return run_main(build_parser(), argv, lambda args: commands[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
