"""``nccltree-train``: data-parallel training of a reference model on N devices.

With no arguments it trains an MLP on a built-in synthetic task on the default devices
(every GPU, else two virtual CPU devices) and reports the held-out accuracy it reached.
The work is done by :class:`nccltree.parallel.DataParallel`; this module parses, prepares
the data, and prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from .._validate import check_int, check_real

if TYPE_CHECKING:
    from ..parallel import DataParallel, Snapshot, StepInfo

# Flag defaults live here rather than in argparse, so that a resumed run can tell the
# flags given on its command line (they win) from those it takes from the snapshot.
DEFAULTS: dict[str, Any] = {
    "devices": "auto",
    "data": None,
    "val_data": None,
    "synthetic": 8192,
    "classes": None,
    "scale": None,
    "model": "mlp",
    "hidden": "256",
    "batch_size": 32,
    "scaling": "weak",
    "iters": 500,
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 5e-4,
    "lr_policy": "fixed",
    "gamma": None,
    "power": None,
    "stepsize": None,
    "stepvalue": None,
    "max_iter": None,
    "algorithm": "tree",
    "update_mode": "allreduce",
    "seed": 0,
    "shuffle": False,
    "out": None,
    "eval_every": 100,
    "snapshot_every": 0,
    "timeout": 60.0,
    "blas_threads": None,
}

# The built-in task: nccltree.data.synthetic's defaults, a held-out quarter, and the
# accuracy the default MLP is expected to pass (its docstring measures about 94%).
SYNTHETIC_FEATURES = 64
SYNTHETIC_CLASSES = 10
SYNTHETIC_TARGET = 90.0
SNAPSHOT_NAME = "snapshot.npz"


def _d(key: str) -> str:
    value = DEFAULTS[key]
    return "none" if value is None else str(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nccltree-train",
        description=(
            "Data-parallel SGD of a reference model on N devices, synchronised by nccltree "
            "collectives. With no arguments: an MLP on a built-in synthetic task (no download), "
            "on every GPU or else two virtual CPU devices, reporting the held-out accuracy."
        ),
        epilog="Exit status: 0 success, 1 the run failed, 2 bad arguments, 130 interrupted.",
    )
    g = p.add_argument_group("devices and communication")
    g.add_argument(
        "--devices",
        metavar="SPEC",
        help='"cpu:N" (N virtual CPU devices), "gpu:0,1", "gpu:all", or "auto" '
        f"(every GPU, else cpu:2) (default: {_d('devices')})",
    )
    g.add_argument(
        "--algorithm",
        choices=["tree", "ring", "direct", "nccl", "auto"],
        help=f"collective algorithm (default: {_d('algorithm')})",
    )
    g.add_argument(
        "--update-mode",
        choices=["allreduce", "root"],
        help="allreduce: every rank averages the gradients and updates; root: "
        "gradients are summed at rank 0, which updates and broadcasts the "
        f"parameters (Caffe's P2PSync). Same result. (default: {_d('update_mode')})",
    )
    g.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds a rank may wait in a collective before the run fails "
        f"(default: {_d('timeout')})",
    )
    g.add_argument(
        "--blas-threads",
        type=int,
        metavar="N",
        help="BLAS threads while training (needs threadpoolctl; "
        "default: cores // ranks, at least 1)",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        metavar="DB",
        help="training LMDB (nccltree records or Caffe Datum); default: the "
        "built-in synthetic task",
    )
    g.add_argument(
        "--val-data",
        metavar="DB",
        help="held-out LMDB for evaluation (default: the synthetic task's held-out "
        "split with the built-in data, none with --data)",
    )
    g.add_argument(
        "--synthetic",
        type=int,
        metavar="N",
        help="training records of the built-in task; the held-out set is a "
        f"quarter of that (default: {_d('synthetic')})",
    )
    g.add_argument(
        "--classes",
        type=int,
        metavar="K",
        help="number of classes (default: the largest label in --data plus one)",
    )
    g.add_argument(
        "--scale",
        type=float,
        metavar="S",
        help="multiply inputs by S as they are read, as Caffe's transform_param "
        "scale (e.g. 0.00390625 for uint8 images) (default: none)",
    )
    g.add_argument(
        "--shuffle",
        action="store_true",
        default=None,
        help="visit records in a seeded random order per epoch (seed from --seed) "
        "instead of key order",
    )

    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        choices=["softmax", "mlp", "cnn"],
        help=f"softmax regression, MLP or a small CNN (default: {_d('model')})",
    )
    g.add_argument(
        "--hidden", metavar="N[,N...]", help=f"MLP hidden layer sizes (default: {_d('hidden')})"
    )
    g.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help=f"seed of the parameter initialisation and of --shuffle (default: {_d('seed')})",
    )

    g = p.add_argument_group("solver")
    g.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help=f"batch size, per rank or global, see --scaling (default: {_d('batch_size')})",
    )
    g.add_argument(
        "--scaling",
        choices=["weak", "strong"],
        help="weak: --batch-size per rank, effective batch N x B (Caffe's -gpu); "
        "strong: --batch-size is the global batch, split evenly across ranks "
        f"(default: {_d('scaling')})",
    )
    g.add_argument(
        "--iters",
        type=int,
        metavar="N",
        help="iterations to train in all (a resumed run continues up to N) "
        f"(default: {_d('iters')})",
    )
    g.add_argument("--lr", type=float, help=f"base learning rate (default: {_d('lr')})")
    g.add_argument("--momentum", type=float, help=f"momentum (default: {_d('momentum')})")
    g.add_argument(
        "--weight-decay",
        type=float,
        metavar="WD",
        help=f"L2 weight decay (default: {_d('weight_decay')})",
    )
    g.add_argument(
        "--lr-policy",
        choices=["fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid"],
        help="Caffe's learning-rate policy; step: lr*gamma^floor(iter/stepsize), "
        "exp: lr*gamma^iter, inv: lr*(1+gamma*iter)^-power, multistep: lr*gamma"
        "^(stepvalues passed), poly: lr*(1-iter/max_iter)^power, sigmoid: "
        f"lr/(1+exp(-gamma*(iter-stepsize))) (default: {_d('lr_policy')})",
    )
    g.add_argument("--gamma", type=float, help="gamma of step, exp, inv, multistep, sigmoid")
    g.add_argument("--power", type=float, help="power of inv and poly")
    g.add_argument("--stepsize", type=int, metavar="N", help="stepsize of step and sigmoid")
    g.add_argument(
        "--stepvalue",
        metavar="N[,N...]",
        help="iterations where multistep multiplies the rate by gamma",
    )
    g.add_argument("--max-iter", type=int, metavar="N", help="max_iter of poly")

    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        metavar="DIR",
        help="write metrics.jsonl, final.npz (parameters by name) and snapshots "
        "here; the built-in data are cached here too (default: none)",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        metavar="K",
        help="evaluate on the held-out set every K iterations (0: only at the end) "
        f"(default: {_d('eval_every')})",
    )
    g.add_argument(
        "--snapshot-every",
        type=int,
        metavar="K",
        help="write DIR/snapshot.npz every K iterations and at the end (needs --out; "
        f"0: never) (default: {_d('snapshot_every')})",
    )
    g.add_argument(
        "--resume",
        metavar="PATH",
        help="continue from a snapshot (a file, or a --out directory holding "
        "snapshot.npz); flags not given are taken from the snapshot",
    )
    g.add_argument(
        "--target-accuracy",
        type=float,
        metavar="PCT",
        help="exit with status 1 if the final held-out accuracy is below PCT "
        f"(default: report against {SYNTHETIC_TARGET:g}%% for the built-in "
        "task, without failing)",
    )
    g.add_argument("--quiet", action="store_true", help="print only the result and errors")
    return p


# -- configuration -------------------------------------------------------------------------


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{what} must list at least one integer")
    return values


def resolve_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[dict[str, Any], Snapshot | None]:
    """Flags given > the snapshot's config (with --resume) > DEFAULTS."""
    from ..parallel import load_snapshot

    snap = None
    if args.resume:
        path = args.resume
        if os.path.isdir(path):
            path = os.path.join(path, SNAPSHOT_NAME)
        if not os.path.isfile(path):
            parser.error(f"--resume: no snapshot at {path}")
        try:
            snap = load_snapshot(path)
        except ValueError as exc:
            parser.error(f"--resume: {exc}")
    cfg = {}
    for key, default in DEFAULTS.items():
        value = getattr(args, key)
        if value is None and snap is not None:
            value = snap.config.get(key)
        cfg[key] = default if value is None else value
    try:
        _check_config(cfg)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    return cfg, snap


def _check_config(cfg: dict[str, Any]) -> None:
    """The one argument rule (``nccltree._validate``) over flags and a snapshot's config:
    argparse's ``float`` takes "nan" and "inf", a snapshot may hold anything."""
    ints = {"synthetic": 1, "batch_size": 1, "iters": 0, "eval_every": 0, "snapshot_every": 0}
    for key, low in (*ints.items(), ("classes", 2), ("blas_threads", 1), ("seed", 0)):
        if cfg[key] is not None:
            cfg[key] = check_int(cfg[key], _flag(key), min=low)
    cfg["timeout"] = check_real(cfg["timeout"], "--timeout", min=0.0, min_open=True)
    for key in ("lr", "momentum", "weight_decay", "scale", "gamma", "power"):
        if cfg[key] is not None:  # their ranges are the solver's and the reader's to judge
            cfg[key] = check_real(cfg[key], _flag(key))
    if cfg["snapshot_every"] and not cfg["out"]:
        raise ValueError("--snapshot-every needs --out DIR (where snapshot.npz goes)")
    cfg["hidden"] = (
        _int_list(cfg["hidden"], "--hidden") if isinstance(cfg["hidden"], str) else cfg["hidden"]
    )
    if isinstance(cfg["stepvalue"], str):
        cfg["stepvalue"] = _int_list(cfg["stepvalue"], "--stepvalue")
    for key in ("data", "val_data"):
        if cfg[key] is not None:
            if not os.path.exists(cfg[key]):
                raise ValueError(f"--{key.replace('_', '-')}: no database at {cfg[key]}")
            cfg[key] = os.path.abspath(cfg[key])
    if cfg["out"] is not None:
        cfg["out"] = os.path.abspath(cfg["out"])


# -- data ----------------------------------------------------------------------------------


class Dataset:
    """Where the training records are and what the held-out arrays are."""

    def __init__(
        self,
        train_path: str,
        val: tuple[np.ndarray, np.ndarray] | None,
        shape: tuple[int, ...],
        classes: int,
        description: str,
    ) -> None:
        self.train_path, self.val = train_path, val
        self.shape, self.classes, self.description = shape, classes, description


def _synthetic(cfg: dict, stack: contextlib.ExitStack) -> Dataset:
    from .. import data as ntdata

    n = cfg["synthetic"]
    n_val = max(1, n // 4)
    shape = (1, 8, 8) if cfg["model"] == "cnn" else (SYNTHETIC_FEATURES,)
    if cfg["out"]:
        root = os.path.join(cfg["out"], "data")
        where = f"cached in {root}"
    else:
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="nccltree-train-"))
        where = "in a temporary LMDB"
    path = os.path.join(root, f"synthetic-{SYNTHETIC_FEATURES}x{SYNTHETIC_CLASSES}-{n}")
    if not os.path.exists(path):
        os.makedirs(root, exist_ok=True)
        x, y = ntdata.synthetic(n, shape=(SYNTHETIC_FEATURES,), classes=SYNTHETIC_CLASSES)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        ntdata.write_lmdb(tmp, x, y)
        try:
            os.replace(tmp, path)  # complete databases only: a concurrent writer loses
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    xv, yv = ntdata.synthetic(
        n_val, shape=(SYNTHETIC_FEATURES,), classes=SYNTHETIC_CLASSES, split="test"
    )
    desc = (
        f"built-in synthetic task: {n} training / {n_val} held-out records, "
        f"{SYNTHETIC_FEATURES} features, {SYNTHETIC_CLASSES} classes ({where})"
    )
    return Dataset(path, (xv.reshape(n_val, *shape), yv), shape, SYNTHETIC_CLASSES, desc)


def _read_all(path: str, scale: float | None) -> tuple[np.ndarray, np.ndarray]:
    from ..data import DataReader

    xs, ys = [], []
    with DataReader(path, 1024, 1, prefetch=2, epochs=1, scale=scale, log_on_wait=None) as r:
        for b in r.batches(0):
            xs.append(np.array(b.x_host))
            ys.append(np.array(b.y_host))
    return np.concatenate(xs), np.concatenate(ys)


def load_dataset(cfg: dict, stack: contextlib.ExitStack) -> Dataset:
    """The training database and held-out arrays the configuration names."""
    from ..data import db_info

    if cfg["data"] is None:
        ds = _synthetic(cfg, stack)
        if cfg["val_data"] is not None:
            ds.val = _read_all(cfg["val_data"], cfg["scale"])
        return ds
    info = db_info(cfg["data"])
    classes = cfg["classes"] or info["label_max"] + 1
    val = _read_all(cfg["val_data"], cfg["scale"]) if cfg["val_data"] else None
    desc = (
        f"{cfg['data']}: {info['records']} {info['format']} records of shape "
        f"{tuple(info['shape'])} {info['dtype']}, {classes} classes"
        + (f"; held-out {cfg['val_data']} ({len(val[1])} records)" if val else "")
    )
    return Dataset(cfg["data"], val, tuple(info["shape"]), classes, desc)


# -- progress and metrics ------------------------------------------------------------------


class Progress:
    """The root's progress line on stderr: refreshed in place on a terminal, a line every
    ``every`` iterations otherwise; other messages are printed without breaking it."""

    WINDOW = 20

    def __init__(self, total: int, every: int, quiet: bool, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.total, self.every, self.quiet = total, max(1, every), quiet
        self._last_draw = 0.0
        self._open = False
        self._window: list[tuple[int, float, float, float]] = []

    def update(self, info: StepInfo) -> None:
        if self.quiet:
            return
        # Averages over the last few iterations: the current speed rather than the run's
        # average, and a loss smoothed as Caffe's average_loss does (one batch is noisy).
        self._window.append((info.examples, info.step_s, info.comm_s, info.loss))
        del self._window[: -self.WINDOW]
        ex, secs, comm_s, loss = (sum(col) for col in zip(*self._window, strict=True))
        rate = ex / secs if secs > 0 else 0.0
        comm = f"  comm {100 * comm_s / secs:3.0f}%" if secs > 0 else ""
        loss /= len(self._window)
        line = (
            f"iter {info.iter:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  "
            f"lr {info.lr:.4g}  {rate:,.0f} examples/s{comm}"
        )
        now = time.monotonic()
        last = info.iter >= self.total
        if self.tty:
            if last or now - self._last_draw >= 0.1:
                self.stream.write("\r\x1b[2K" + line)
                self.stream.flush()
                self._open, self._last_draw = True, now
            if last:
                self.finish()
        elif last or info.iter % self.every == 0:
            print(line, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self.quiet:
            return
        if self._open:
            self.stream.write("\r\x1b[2K")
        print(text, file=self.stream, flush=True)
        self._open = False

    def finish(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


class Metrics:
    """JSON lines in DIR/metrics.jsonl (appended to when a run resumes)."""

    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path else None

    def write(self, **record: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# -- the run -------------------------------------------------------------------------------


def _print_header(
    cfg: dict[str, Any],
    ds: Dataset,
    dp: DataParallel,
    per_rank: int,
    snap: Snapshot | None,
    out: TextIO,
) -> None:
    n = dp.size
    p = dp.params[0]
    names = ", ".join(d.name for d in dp.devices)
    effective = per_rank * n
    policy = cfg["lr_policy"]
    lines = [
        "nccltree-train",
        f"  data       {ds.description}",
        f"  model      {dp.model!r}: {p.count:,} parameters, {p.dtype}",
        f"  devices    {cfg['devices']} -> {names} ({n} rank{'s' if n > 1 else ''})",
        f"  algorithm  {cfg['algorithm']}, update mode {cfg['update_mode']}",
        f"  scaling    {cfg['scaling']}: batch {per_rank} per rank, effective batch {effective}"
        + (
            f" (global batch {cfg['batch_size']} split across {n} ranks)"
            if cfg["scaling"] == "strong"
            else ""
        ),
        f"  solver     learning rate {dp.solvers[0].learning_rate():g} (policy {policy}), "
        f"momentum {cfg['momentum']:g}, weight decay {cfg['weight_decay']:g}, "
        f"{cfg['iters']} iterations",
    ]
    if snap is not None:
        lines.append(f"  resumed    at iteration {snap.iter}, data position {snap.position}")
    print("\n".join(lines), file=out, flush=True)


def run(
    cfg: dict[str, Any], snap: Snapshot | None, out: TextIO, err: TextIO, target: float | None
) -> int:
    from ..backends import devices as make_devices
    from ..data import DataReader
    from ..models import build_model
    from ..parallel import DataParallel, RankFailure, evaluate, per_rank_batch

    quiet = cfg["quiet"]
    devs = make_devices(cfg["devices"])
    n = len(devs)
    per_rank = per_rank_batch(cfg["batch_size"], n, cfg["scaling"])
    with contextlib.ExitStack() as stack:
        if devs[0].backend == "host":
            stack.callback(devs[0].runtime.shutdown)
        ds = load_dataset(cfg, stack)
        kw = {"hidden": tuple(cfg["hidden"])} if cfg["model"] == "mlp" else {}
        model = build_model(cfg["model"], ds.shape, ds.classes, **kw)
        policy = {
            k: cfg[k]
            for k in ("gamma", "power", "stepsize", "stepvalue", "max_iter")
            if cfg[k] is not None
        }
        dp = stack.enter_context(
            DataParallel(
                model,
                devs,
                algorithm=cfg["algorithm"],
                update_mode=cfg["update_mode"],
                seed=cfg["seed"],
                timeout=cfg["timeout"],
                blas_threads=cfg["blas_threads"],
                lr=cfg["lr"],
                momentum=cfg["momentum"],
                weight_decay=cfg["weight_decay"],
                lr_policy=cfg["lr_policy"],
                **policy,
            )
        )
        start = 0
        if snap is not None:
            dp.restore(snap)
            start = snap.position or 0
        if not quiet:
            _print_header(cfg, ds, dp, per_rank, snap, out)
        outdir = cfg["out"]
        if outdir:
            os.makedirs(outdir, exist_ok=True)
        metrics = Metrics(os.path.join(outdir, "metrics.jsonl") if outdir else None)
        stack.callback(metrics.close)
        metrics.write(
            event="config",
            **{k: v for k, v in cfg.items() if k != "quiet"},
            ranks=n,
            per_rank_batch=per_rank,
            start_iter=dp.iter,
        )
        iters = cfg["iters"]
        every = max(1, iters // 10)
        progress = Progress(iters, every, quiet, err)
        snap_path = os.path.join(outdir, SNAPSHOT_NAME) if outdir else None
        config = {k: v for k, v in cfg.items() if k != "quiet"}
        state: dict[str, Any] = {"accuracy": None}

        def do_eval(info: StepInfo) -> None:
            assert ds.val is not None, "evaluated only with held-out data"
            acc, loss = evaluate(model, info.params, *ds.val)
            state["accuracy"] = acc
            metrics.write(event="eval", iter=info.iter, accuracy=acc, loss=loss)
            progress.message(
                f"iter {info.iter}: held-out accuracy {100 * acc:.2f}%, loss {loss:.4f}"
            )

        def on_step(info: StepInfo) -> None:
            metrics.write(
                event="train",
                iter=info.iter,
                loss=info.loss,
                lr=info.lr,
                examples=info.examples,
                step_s=info.step_s,
                comm_s=info.comm_s,
                elapsed_s=info.elapsed_s,
            )
            progress.update(info)
            last = info.iter >= iters
            if ds.val is not None and (
                last or (cfg["eval_every"] and info.iter % cfg["eval_every"] == 0)
            ):
                do_eval(info)
            if (
                snap_path
                and cfg["snapshot_every"]
                and (last or info.iter % cfg["snapshot_every"] == 0)
            ):
                dp.snapshot(snap_path, config)
                metrics.write(
                    event="snapshot", iter=info.iter, path=snap_path, position=info.position
                )

        shuffle = cfg["seed"] if cfg["shuffle"] else None
        reader = stack.enter_context(
            DataReader(
                ds.train_path,
                per_rank,
                n,
                start=start,
                shuffle=shuffle,
                scale=cfg["scale"],
                device=devs if devs[0].backend != "host" else None,
                log_on_wait=None,
            )
        )
        try:
            result = dp.fit(reader, iters, on_step=on_step)
        except KeyboardInterrupt:
            progress.finish()
            where = (
                f"; the last snapshot is {dp.last_snapshot}"
                if dp.last_snapshot
                else "; no snapshot was written"
            )
            print(f"interrupted at iteration {dp.iter}{where}", file=err, flush=True)
            return 130
        except RankFailure as exc:
            progress.finish()
            print(f"nccltree-train: error: {exc}", file=err, flush=True)
            return 1
        progress.finish()
        if ds.val is not None and state["accuracy"] is None:  # nothing trained: still report
            acc, _ = evaluate(model, dp.params[0], *ds.val)
            state["accuracy"] = acc
        if outdir:
            final = os.path.join(outdir, "final.npz")
            # allow_pickle: the default, named so that the typed signature sees no clash
            np.savez(final, allow_pickle=True, **dp.state_dict())
        summary = (
            f"done: {result.iter - result.start_iter} iterations in {result.elapsed_s:.1f} s, "
            f"{result.examples_per_s:,.0f} examples/s"
            + (f", final training loss {result.losses[-1]:.4f}" if result.losses else "")
        )
        metrics.write(
            event="final",
            iter=result.iter,
            elapsed_s=result.elapsed_s,
            examples_per_s=result.examples_per_s,
            accuracy=state["accuracy"],
        )
        if not quiet:
            print(summary, file=out)
            if outdir:
                print(
                    f"wrote {os.path.join(outdir, 'final.npz')} and "
                    f"{os.path.join(outdir, 'metrics.jsonl')}",
                    file=out,
                )
        return _report_accuracy(state["accuracy"], target, cfg, out)


def _report_accuracy(acc: float | None, target: float | None, cfg: dict, out: TextIO) -> int:
    if acc is None:
        print("no held-out set: pass --val-data DB to measure accuracy", file=out, flush=True)
        return 0 if target is None else 1
    shown = target
    if shown is None and cfg["data"] is None and cfg["model"] == "mlp":
        shown = SYNTHETIC_TARGET
    pct = 100 * acc
    if shown is None:
        print(f"reached {pct:.2f}% accuracy on the held-out set", file=out, flush=True)
    elif pct >= shown:
        print(
            f"reached {pct:.2f}% accuracy on the held-out set (target {shown:g}%)",
            file=out,
            flush=True,
        )
    else:
        print(
            f"reached {pct:.2f}% accuracy on the held-out set, below the target {shown:g}%",
            file=out,
            flush=True,
        )
        return 1 if target is not None else 0
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nccltree-train``; returns the exit status."""
    from .._errors import NcclTreeError

    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, snap = resolve_config(args, parser)
    cfg["quiet"] = args.quiet
    try:
        return run(cfg, snap, sys.stdout, sys.stderr, args.target_accuracy)
    except KeyboardInterrupt:  # before training started (while preparing the data)
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    except (NcclTreeError, OSError) as exc:  # a backend, database or file problem
        print(f"nccltree-train: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, TypeError) as exc:
        # configuration the parser cannot check alone: an uneven strong split, an unknown
        # device, a model that does not fit the data, a snapshot of another model
        parser.error(str(exc))
    return 1


if __name__ == "__main__":
    sys.exit(main())
