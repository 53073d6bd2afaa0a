"""Training snapshots: the file format, its atomic write, its reading and its checks.

A snapshot is one ``.npz`` file (format ``nccltree-snapshot-1``)::

    param/<name>     each parameter, by name (Caffe/PyTorch layouts)
    solver/iter      int64: iterations completed
    solver/history   the momentum history, flat, in the parameters' dtype
    data/position    int64: where the data continue (-1: unknown)
    meta/format      the string nccltree-snapshot-1
    meta/config      JSON: the configuration of the run that wrote it

The models have no random state of their own (initialisation is seeded, data order follows
from the position), so parameters, solver state and position are the whole training state:
a run resumed from a snapshot ends with bitwise the parameters of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import re
import threading
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

SNAPSHOT_FORMAT = "nccltree-snapshot-1"

_PARAM = "param/"
_ITER, _HISTORY = "solver/iter", "solver/history"
_POSITION = "data/position"
_FORMAT, _CONFIG = "meta/format", "meta/config"


@dataclass
class Snapshot:
    """A training state as :func:`load_snapshot` returns it: the ``params`` by name,
    the solver's ``iter`` and momentum ``history``, the data ``position`` the next
    iteration starts at (None: none recorded) and the ``config`` saved with it."""

    params: dict[str, np.ndarray]
    iter: int
    history: np.ndarray
    position: int | None
    config: dict[str, Any]

    def solver_state(self) -> dict[str, Any]:
        """The solver's part, as :meth:`nccltree.SGD.load_state_dict` takes it."""
        return {"iter": self.iter, "history": self.history}


def save_snapshot(
    path: str | os.PathLike[str],
    params: Mapping[str, np.ndarray],
    solver_state: Mapping[str, Any],
    position: int | None,
    config: Mapping[str, Any] | None = None,
) -> None:
    """Write a snapshot of ``params`` (arrays by name), ``solver_state`` and the data
    ``position`` to ``path`` atomically: a temporary file in the same directory, flushed to
    disk, then ``os.replace``. A process killed at any point (even ``kill -9``) leaves
    either the previous snapshot or the new one, never a partial file.

    ``solver_state`` is :meth:`nccltree.SGD.state_dict` output; ``config`` must be
    JSON-able.
    """
    path = os.fspath(path)
    arrays: dict[str, Any] = {f"{_PARAM}{k}": np.asarray(v) for k, v in params.items()}
    arrays[_ITER] = np.int64(solver_state["iter"])
    arrays[_HISTORY] = np.asarray(solver_state["history"])
    arrays[_POSITION] = np.int64(-1 if position is None else position)
    arrays[_FORMAT] = np.str_(SNAPSHOT_FORMAT)
    arrays[_CONFIG] = np.str_(json.dumps(dict(config or {}), sort_keys=True))
    save_arrays(path, arrays)


# A temporary of save_arrays: the target's name, ".tmp", the writer's process id and thread.
_TMP = re.compile(r"^(?P<target>.+)\.tmp(?P<pid>\d+)\.\d+$")


def save_arrays(path: str | os.PathLike[str], arrays: Mapping[str, ArrayLike]) -> None:
    """``np.savez(path, **arrays)`` atomically: a temporary file in the same directory,
    flushed to disk, then ``os.replace``. A process killed at any point (even ``kill -9``)
    leaves either the previous file or the new one, never a partial file; the temporary
    of a killed writer is removed by :func:`remove_stale_temporaries`."""
    path = os.fspath(path)
    # unique per writer, so two threads or processes never share a temporary
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, allow_pickle=False, **arrays)  # named: the typed signature then fits
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[str]:
    """Remove the temporaries :func:`save_arrays` left in ``directory`` when its writer
    was killed (files ``NAME.tmpPID.TID`` whose process no longer runs); those of a
    writer still running are kept. Returns the paths removed."""
    directory = os.fspath(directory)
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TMP.match(name)
        if m is None or process_alive(int(m["pid"])):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except OSError:
            continue  # gone already, or not ours to remove
        removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (this process always does)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


def load_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Read the snapshot at ``path``, written by :func:`save_snapshot`.

    ValueError when the file cannot be read, is not a snapshot, or lacks or mangles one of
    its entries (the message names the file and the entry).
    """
    path = os.fspath(path)
    not_snapshot = f"{path} is not an nccltree snapshot ({SNAPSHOT_FORMAT})"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ValueError(f"cannot read snapshot {path}: {exc.strerror}") from None
    if not magic:
        raise ValueError(f"{not_snapshot}: the file is empty")
    if not magic.startswith(b"PK"):  # an .npz is a zip archive
        what = "a single .npy array" if magic == b"\x93NUM" else "not an .npz archive"
        raise ValueError(f"{not_snapshot}: {what}")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except ValueError as exc:
        if "pickled" not in str(exc):
            raise ValueError(f"cannot read snapshot {path}: {exc}") from None
        raise ValueError(f"{not_snapshot}: it holds Python objects") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"cannot read snapshot {path}: {exc}") from None
    fmt = arrays.get(_FORMAT)
    if fmt is None or str(fmt) != SNAPSHOT_FORMAT:
        raise ValueError(f"{path} is not an nccltree snapshot ({SNAPSHOT_FORMAT})")
    position = _integer(arrays, _POSITION, path, min=-1)
    return Snapshot(
        {k[len(_PARAM) :]: v for k, v in arrays.items() if k.startswith(_PARAM)},
        _integer(arrays, _ITER, path, min=0),
        _entry(arrays, _HISTORY, path),
        None if position < 0 else position,
        _config(arrays, path),
    )


def _entry(arrays: Mapping[str, np.ndarray], key: str, path: str) -> np.ndarray:
    try:
        return arrays[key]
    except KeyError:
        raise ValueError(f"snapshot {path} has no {key}") from None


def _integer(arrays: Mapping[str, np.ndarray], key: str, path: str, *, min: int) -> int:
    value = _entry(arrays, key, path)
    if value.shape != () or value.dtype.kind not in "iu" or int(value) < min:
        raise ValueError(f"snapshot {path}: {key} must be an integer >= {min}, got {value!r}")
    return int(value)


def _config(arrays: Mapping[str, np.ndarray], path: str) -> dict[str, Any]:
    text = str(_entry(arrays, _CONFIG, path))
    try:
        config = json.loads(text)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise ValueError(f"snapshot {path}: {_CONFIG} must be a JSON object, got {text!r}")
    return config


def load_weights(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The parameters, by name, of a snapshot or of a file of named arrays (a run's
    ``final.npz``), for fine-tuning or evaluation.

    ValueError, naming the file, when it cannot be read or holds no arrays.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            if not f.read(4).startswith(b"PK"):  # an .npz is a zip archive
                raise ValueError(
                    f"{path} is not an .npz of named arrays (a final.npz or a snapshot)"
                )
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise ValueError(f"no weights file at {path}") from None
    except ValueError as exc:
        if "pickled" in str(exc):
            raise ValueError(f"{path} holds Python objects, not weights") from None
        raise ValueError(f"cannot read weights {path}: {exc}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"cannot read weights {path}: {exc}") from None
    if not arrays:
        raise ValueError(f"{path} holds no named arrays (a final.npz or a snapshot)")
    if _FORMAT in arrays:
        return load_snapshot(path).params
    return arrays


# The snapshot history: one file per iteration, beside the latest under its usual name.
_HISTORY_FILE = re.compile(r"^snapshot_iter_(?P<iter>\d+)\.npz$")


def history_name(iteration: int) -> str:
    """The file name of the snapshot of ``iteration`` in a history (Caffe's
    ``snapshot_prefix_iter_N``)."""
    return f"snapshot_iter_{iteration}.npz"


def history(directory: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """The snapshots of the history in ``directory``: ``(iteration, path)``, oldest
    first."""
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(int(m["iter"]), n) for n in names if (m := _HISTORY_FILE.match(n))]
    return [(it, os.path.join(directory, n)) for it, n in sorted(found)]


def point_latest(target: str | os.PathLike[str], latest: str | os.PathLike[str]) -> None:
    """Make ``latest`` the file ``target`` (a hard link, or a copy where the file system
    has none), replacing it atomically: a process killed at any point leaves ``latest``
    the previous snapshot or this one, whole."""
    target, latest = os.fspath(target), os.fspath(latest)
    tmp = f"{latest}.tmp{os.getpid()}.{threading.get_ident()}"  # as save_arrays's
    try:
        try:
            os.link(target, tmp)
        except OSError:
            with np.load(target, allow_pickle=False) as z:
                save_arrays(tmp, {k: z[k] for k in z.files})
        os.replace(tmp, latest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def prune_history(directory: str | os.PathLike[str], keep: int) -> list[str]:
    """Remove all but the newest ``keep`` snapshots of the history in ``directory``;
    returns the paths removed."""
    removed: list[str] = []
    entries = history(directory)
    for _, path in entries[: max(0, len(entries) - keep)]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed
