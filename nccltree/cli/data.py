"""``nccltree-data``: build and inspect record databases.

nccltree-data convert IN.npz OUT_DB        arrays X and y of an .npz file -> LMDB
nccltree-data info DB [--verify]           records, format, shape, dtype, labels, size;
                                           --verify reads every record, lists the bad ones
nccltree-data make synthetic OUT_DB ...    a seeded learnable task of any size
nccltree-data make digits OUT_DB           scikit-learn's 8x8 digits (needs scikit-learn)

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
from collections.abc import Callable, Sequence

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see ``--help``)."""
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "convert": _convert,
        "info": _info,
        "make": _make,
    }
    return run_main(build_parser(), argv, lambda args: commands[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
