"""Caffe solver files (``solver.prototxt``) read into ``nccltree-train``'s settings.

The file is parsed by the protobuf runtime's own text format (``text_format.Parse``) into
a ``caffe.SolverParameter`` whose descriptor :mod:`nccltree.caffe_proto` builds: every
field of Caffe's message is known, so a misspelt or unknown field is an error naming its
line, never dropped. Then each field is mapped onto the trainer's settings
(:data:`MAPPED`), reported as not used (:data:`NOT_USED`) or refused by name
(:func:`read_solver`'s errors).

Float fields (``base_lr``, ``momentum``, ...) are ``float`` in caffe.proto, so the parsed
message holds them rounded to float32 (``base_lr: 0.01`` is 0.009999999776...): the value
used here is the number as written in the file (its token), which :attr:`SolverFile.notes`
says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .caffe_proto import message_class, require_protobuf

if TYPE_CHECKING:
    from google.protobuf.message import Message

#: solver field -> the trainer setting (TrainConfig key) it sets
MAPPED: dict[str, tuple[str, ...]] = {
    "base_lr": ("lr",),
    "lr_policy": ("lr_policy",),
    "gamma": ("gamma",),
    "power": ("power",),
    "stepsize": ("stepsize",),
    "stepvalue": ("stepvalue",),
    "momentum": ("momentum",),
    "weight_decay": ("weight_decay",),
    "max_iter": ("iters", "max_iter"),
    "snapshot": ("snapshot_every",),
    "snapshot_prefix": ("out",),
    "test_interval": ("eval_every",),
    "display": ("display",),
    "random_seed": ("seed",),
    "iter_size": ("iter_size",),
    "clip_gradients": ("clip_gradients",),
    "type": (),  # checked: SGD only
    "solver_type": (),  # the same, deprecated spelling
    "regularization_type": (),  # checked: L2 only
}

#: fields read but not used, and why (reported in one line)
NOT_USED: dict[str, str] = {
    "net": "--model and --data say what trains",
    "train_net": "--model and --data say what trains",
    "test_net": "--val-data names the held-out set",
    "solver_mode": "--devices picks the devices",
    "device_id": "--devices picks the devices",
    "snapshot_format": "snapshots are .npz",
    "test_iter": "evaluation covers all of --val-data",
    "train_state": "no net definition is read",
    "test_state": "no net definition is read",
    "test_compute_loss": "evaluation always reports the loss",
    "test_initialization": "evaluation runs at --eval-every and at the end",
    "average_loss": "the progress line averages the last 20 iterations",
    "snapshot_diff": "snapshots hold parameters and solver state",
    "snapshot_after_train": "final.npz is always written with --out",
    "debug_info": "no per-layer debug output",
    "layer_wise_reduce": "--bucket-mb overlaps communication with backward",
    "weights": "give --weights FILE (a final.npz or a snapshot)",
    "delta": "used by other solver types only",
    "momentum2": "used by other solver types only",
    "rms_decay": "used by other solver types only",
}

#: inline net definitions: refused by name (before parsing: their content is a net)
INLINE_NETS = ("net_param", "train_net_param", "test_net_param")

_LR_POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


@dataclass
class SolverFile:
    """A solver file's settings: ``values`` by trainer setting (TrainConfig key),
    ``origin`` the solver field each came from, ``unused`` the fields present and not
    used with the reason, ``notes`` what the reader said about a field's value (a float
    kept as written), by field."""

    path: str
    values: dict[str, object] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    unused: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def unused_line(self) -> str | None:
        """The one line reporting the fields read and not used (None when none)."""
        if not self.unused:
            return None
        by_reason: dict[str, list[str]] = {}
        for name, why in self.unused.items():
            by_reason.setdefault(why, []).append(name)
        parts = [f"{' and '.join(names)} ({why})" for why, names in by_reason.items()]
        return f"{self.path}: not used here: " + "; ".join(parts)


def _tokens(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The top-level field names of a text-format message, and the value tokens of its
    top-level scalar fields, by protobuf's own tokenizer; stops quietly at anything it
    does not follow (the parse then says what is wrong)."""
    from google.protobuf import text_format

    names: list[str] = []
    written: dict[str, list[str]] = {}
    tok = text_format.Tokenizer(text.split("\n"))
    depth, state, name = 0, "name", ""
    try:
        while not tok.AtEnd():
            t = tok.token
            if depth > 0:
                depth += t in ("{", "<")
                depth -= t in ("}", ">")
            elif state == "name":
                if t not in (",", ";"):
                    name, state = t, "after"
                    names.append(t)
            elif state == "after":
                if t == ":":
                    state = "value"
                elif t in ("{", "<"):
                    depth, state = 1, "name"
                else:
                    break
            elif state == "value":
                if t in ("{", "<"):
                    depth, state = 1, "name"
                elif t == "[":
                    state = "list"
                else:
                    written.setdefault(name, []).append(t)
                    state = "name"
            elif state == "list":
                if t == "]":
                    state = "name"
                elif t != ",":
                    written.setdefault(name, []).append(t)
            tok.NextToken()
    except text_format.ParseError:
        pass
    return names, written


def parse_solver_text(text: str, path: str = "solver file") -> Message:
    """``text`` parsed into a ``caffe.SolverParameter`` message: ValueError naming the
    line of an unknown field or a bad value, or an inline net definition."""
    from google.protobuf import text_format

    names, _ = _tokens(text)
    for name in names:
        if name in INLINE_NETS:
            raise ValueError(
                f"{path}: {name} (an inline net definition) is not supported: nccltree-train "
                "trains its reference models (--model) on --data; use net: or leave it out"
            )
    msg = message_class("SolverParameter")()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as e:
        text = str(e).replace(" : ", ": ", 1)
        raise ValueError(f"{path}:{text}" if text[:1].isdigit() else f"{path}: {text}") from None
    return msg


def read_solver(path: str | os.PathLike[str]) -> SolverFile:
    """Read a Caffe solver file: its settings for ``nccltree-train``.

    ValueError (one line, naming the file) for: a file that cannot be read, an unknown
    field or a bad value (protobuf's message, with the line), an inline net
    (``net_param``, ``train_net_param``, ``test_net_param``), a solver type other than
    SGD (``type``, ``solver_type``), ``regularization_type`` other than L2, an
    ``lr_policy`` Caffe does not have, ``iter_size`` below 1. ImportError without the
    protobuf package.
    """
    p = os.fspath(path)
    require_protobuf()
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the solver file {p}: {e}") from None
    msg = parse_solver_text(text, p)
    _, written = _tokens(text)
    out = SolverFile(p)
    present = {fd.name for fd, _ in msg.ListFields()}

    def put(name: str, value: object) -> None:
        for key in MAPPED[name]:
            out.values[key] = value
            out.origin[key] = name

    for name in sorted(present & set(NOT_USED)):
        out.unused[name] = NOT_USED[name]
    solver_type = msg.type if msg.HasField("type") else "SGD"
    if solver_type != "SGD":
        raise ValueError(
            f'{p}: type: "{solver_type}" is not supported: nccltree-train\'s solver is SGD '
            '(Caffe\'s "SGD": momentum and L2 weight decay)'
        )
    if msg.HasField("solver_type") and msg.solver_type != 0:
        enum = msg.DESCRIPTOR.fields_by_name["solver_type"].enum_type
        raise ValueError(
            f"{p}: solver_type: {enum.values_by_number[msg.solver_type].name} is not "
            "supported: nccltree-train's solver is SGD"
        )
    reg = msg.regularization_type
    if reg == "L1":
        raise ValueError(
            f'{p}: regularization_type: "L1" is not supported: weight_decay is L2 here '
            "(Caffe's default regularization)"
        )
    if reg != "L2":
        raise ValueError(f'{p}: regularization_type: "{reg}" is not L1 or L2 (Caffe knows those)')
    if msg.HasField("lr_policy"):
        if msg.lr_policy not in _LR_POLICIES:
            raise ValueError(
                f'{p}: lr_policy: "{msg.lr_policy}" is none of Caffe\'s policies '
                f"({', '.join(_LR_POLICIES)})"
            )
        put("lr_policy", msg.lr_policy)
    for name in ("base_lr", "gamma", "power", "momentum", "weight_decay", "clip_gradients"):
        if name not in present:
            continue
        value = _as_written(name, getattr(msg, name), written.get(name))
        if name == "clip_gradients" and value < 0:
            out.notes[name] = f"clip_gradients {value:g}: off (negative, as in Caffe)"
            continue
        put(name, value)
        if float(_f32(value)) != value:
            out.notes[name] = f"{name} {value!r} as written (caffe.proto's float: {_f32(value)})"
    for name in ("stepsize", "max_iter", "snapshot", "test_interval", "display"):
        if name in present:
            put(name, int(getattr(msg, name)))
    if "stepvalue" in present:
        put("stepvalue", tuple(int(v) for v in msg.stepvalue))
    if "snapshot_prefix" in present and msg.snapshot_prefix:
        put("snapshot_prefix", msg.snapshot_prefix)
    if "random_seed" in present:
        if msg.random_seed >= 0:
            put("random_seed", int(msg.random_seed))
        else:
            out.unused["random_seed"] = "negative: Caffe seeds from the clock, --seed here"
    if "iter_size" in present:
        if msg.iter_size < 1:
            raise ValueError(f"{p}: iter_size: {msg.iter_size} must be at least 1")
        put("iter_size", int(msg.iter_size))
    return out


def _f32(value: float) -> str:
    import numpy as np

    return f"{float(np.float32(value)):.10g}"


def _as_written(name: str, parsed: float, tokens: list[str] | None) -> float:
    """A float field's value as its token in the file writes it (the parsed message holds
    it rounded to float32); the parsed value where no token was seen."""
    from google.protobuf import text_format

    if tokens and len(tokens) == 1:
        try:
            value = float(text_format.ParseFloat(tokens[0]))
        except ValueError:
            return float(parsed)
        import numpy as np

        if np.float32(value) == np.float32(parsed):
            return value
    return float(parsed)
