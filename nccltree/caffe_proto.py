"""Caffe's messages for the protobuf runtime, described in Python (no protoc, no .proto).

:func:`file_descriptor` builds a ``FileDescriptorProto`` of package ``caffe`` holding
every field of Caffe's ``SolverParameter`` with caffe.proto's numbers, types, labels and
defaults (BVLC/caffe master), the messages it refers to (``NetState`` with the ``Phase``
enum; ``NetParameter`` as an empty message: an inline net is refused before it is
parsed, see :mod:`nccltree.solver_file`), and ``BlobShape``, ``BlobProto`` and ``Datum``
(for writing test files through the real runtime). :func:`message_class` gives the
message classes, from a private descriptor pool (a program's own ``caffe`` package, e.g.
pycaffe's ``caffe_pb2``, does not clash with it).

The protobuf package is needed only here (``pip install 'nccltree[caffe]'``): the record
and mean-file paths read the wire format by hand (:mod:`nccltree.data.datum`,
:mod:`nccltree.data.blobproto`).
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from google.protobuf.descriptor_pb2 import DescriptorProto, FileDescriptorProto
    from google.protobuf.descriptor_pool import DescriptorPool
    from google.protobuf.message import Message

PACKAGE = "caffe"

# (name, number, type, label, default, type_name) as caffe.proto declares them; the type
# is FieldDescriptorProto's TYPE_* suffix, the label OPTIONAL (o) or REPEATED (r).
_SOLVER_FIELDS: tuple[tuple[str, int, str, str, str | None, str | None], ...] = (
    ("net", 24, "STRING", "o", None, None),
    ("net_param", 25, "MESSAGE", "o", None, ".caffe.NetParameter"),
    ("train_net", 1, "STRING", "o", None, None),
    ("test_net", 2, "STRING", "r", None, None),
    ("train_net_param", 21, "MESSAGE", "o", None, ".caffe.NetParameter"),
    ("test_net_param", 22, "MESSAGE", "r", None, ".caffe.NetParameter"),
    ("train_state", 26, "MESSAGE", "o", None, ".caffe.NetState"),
    ("test_state", 27, "MESSAGE", "r", None, ".caffe.NetState"),
    ("test_iter", 3, "INT32", "r", None, None),
    ("test_interval", 4, "INT32", "o", "0", None),
    ("test_compute_loss", 19, "BOOL", "o", "false", None),
    ("test_initialization", 32, "BOOL", "o", "true", None),
    ("base_lr", 5, "FLOAT", "o", None, None),
    ("display", 6, "INT32", "o", None, None),
    ("average_loss", 33, "INT32", "o", "1", None),
    ("max_iter", 7, "INT32", "o", None, None),
    ("iter_size", 36, "INT32", "o", "1", None),
    ("lr_policy", 8, "STRING", "o", None, None),
    ("gamma", 9, "FLOAT", "o", None, None),
    ("power", 10, "FLOAT", "o", None, None),
    ("momentum", 11, "FLOAT", "o", None, None),
    ("weight_decay", 12, "FLOAT", "o", None, None),
    ("regularization_type", 29, "STRING", "o", "L2", None),
    ("stepsize", 13, "INT32", "o", None, None),
    ("stepvalue", 34, "INT32", "r", None, None),
    ("clip_gradients", 35, "FLOAT", "o", "-1", None),
    ("snapshot", 14, "INT32", "o", "0", None),
    ("snapshot_prefix", 15, "STRING", "o", None, None),
    ("snapshot_diff", 16, "BOOL", "o", "false", None),
    ("snapshot_format", 37, "ENUM", "o", "BINARYPROTO", ".caffe.SolverParameter.SnapshotFormat"),
    ("solver_mode", 17, "ENUM", "o", "GPU", ".caffe.SolverParameter.SolverMode"),
    ("device_id", 18, "INT32", "o", "0", None),
    ("random_seed", 20, "INT64", "o", "-1", None),
    ("type", 40, "STRING", "o", "SGD", None),
    ("delta", 31, "FLOAT", "o", "1e-08", None),
    ("momentum2", 39, "FLOAT", "o", "0.999", None),
    ("rms_decay", 38, "FLOAT", "o", "0.99", None),
    ("debug_info", 23, "BOOL", "o", "false", None),
    ("snapshot_after_train", 28, "BOOL", "o", "true", None),
    ("solver_type", 30, "ENUM", "o", "SGD", ".caffe.SolverParameter.SolverType"),
    ("layer_wise_reduce", 41, "BOOL", "o", "true", None),
    ("weights", 42, "STRING", "r", None, None),
)

_SOLVER_ENUMS: dict[str, tuple[tuple[str, int], ...]] = {
    "SnapshotFormat": (("HDF5", 0), ("BINARYPROTO", 1)),
    "SolverMode": (("CPU", 0), ("GPU", 1)),
    "SolverType": (
        ("SGD", 0),
        ("NESTEROV", 1),
        ("ADAGRAD", 2),
        ("RMSPROP", 3),
        ("ADADELTA", 4),
        ("ADAM", 5),
    ),
}

_OTHER_MESSAGES: dict[str, tuple[tuple[str, int, str, str, str | None, str | None], ...]] = {
    "NetState": (
        ("phase", 1, "ENUM", "o", "TEST", ".caffe.Phase"),
        ("level", 2, "INT32", "o", "0", None),
        ("stage", 3, "STRING", "r", None, None),
    ),
    # the net itself is not described: an inline net is refused by name before parsing
    "NetParameter": (),
    "BlobShape": (("dim", 1, "INT64", "r", None, None),),
    "BlobProto": (
        ("shape", 7, "MESSAGE", "o", None, ".caffe.BlobShape"),
        ("data", 5, "FLOAT", "r", None, None),
        ("diff", 6, "FLOAT", "r", None, None),
        ("double_data", 8, "DOUBLE", "r", None, None),
        ("double_diff", 9, "DOUBLE", "r", None, None),
        ("num", 1, "INT32", "o", "0", None),
        ("channels", 2, "INT32", "o", "0", None),
        ("height", 3, "INT32", "o", "0", None),
        ("width", 4, "INT32", "o", "0", None),
    ),
    "Datum": (
        ("channels", 1, "INT32", "o", None, None),
        ("height", 2, "INT32", "o", None, None),
        ("width", 3, "INT32", "o", None, None),
        ("data", 4, "BYTES", "o", None, None),
        ("label", 5, "INT32", "o", None, None),
        ("float_data", 6, "FLOAT", "r", None, None),
        ("encoded", 7, "BOOL", "o", "false", None),
    ),
}
# caffe.proto declares these [packed = true]
_PACKED = {("BlobShape", "dim"), ("BlobProto", "data"), ("BlobProto", "diff")}
_PACKED |= {("BlobProto", "double_data"), ("BlobProto", "double_diff")}


def solver_field_names() -> tuple[str, ...]:
    """Every field of Caffe's ``SolverParameter``, in caffe.proto's order."""
    return tuple(f[0] for f in _SOLVER_FIELDS)


def require_protobuf() -> types.ModuleType:
    """protobuf's ``descriptor_pb2``, or an ImportError saying how to install protobuf."""
    try:
        from google.protobuf import descriptor_pb2
    except ImportError:
        raise ImportError(
            "reading a Caffe solver file needs the protobuf package (>= 4.21): "
            "pip install 'nccltree[caffe]' (or pip install protobuf)"
        ) from None
    return descriptor_pb2


def file_descriptor() -> FileDescriptorProto:
    """The ``FileDescriptorProto`` of package ``caffe`` (see the module docstring)."""
    pb = require_protobuf()
    F = pb.FieldDescriptorProto
    fdp = pb.FileDescriptorProto(name="nccltree_caffe.proto", package=PACKAGE, syntax="proto2")
    enum = fdp.enum_type.add(name="Phase")
    for name, number in (("TRAIN", 0), ("TEST", 1)):
        enum.value.add(name=name, number=number)

    def add(
        message: DescriptorProto,
        fields: tuple[tuple[str, int, str, str, str | None, str | None], ...],
    ) -> None:
        for name, number, typ, label, default, type_name in fields:
            f = message.field.add(
                name=name,
                number=number,
                type=getattr(F, "TYPE_" + typ),
                label=F.LABEL_REPEATED if label == "r" else F.LABEL_OPTIONAL,
            )
            if default is not None:
                f.default_value = default
            if type_name is not None:
                f.type_name = type_name
            if (message.name, name) in _PACKED:
                f.options.packed = True

    solver = fdp.message_type.add(name="SolverParameter")
    add(solver, _SOLVER_FIELDS)
    for enum_name, values in _SOLVER_ENUMS.items():
        e = solver.enum_type.add(name=enum_name)
        for name, number in values:
            e.value.add(name=name, number=number)
    for msg_name, fields in _OTHER_MESSAGES.items():
        add(fdp.message_type.add(name=msg_name), fields)
    return fdp


@functools.cache
def _pool() -> DescriptorPool:
    from google.protobuf import descriptor_pool

    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor())
    return pool


def message_class(name: str) -> type[Message]:
    """The protobuf message class of ``caffe.<name>`` (``SolverParameter``, ``BlobProto``,
    ``BlobShape``, ``Datum``, ``NetState``); ImportError without protobuf."""
    require_protobuf()
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(_pool().FindMessageTypeByName(f"{PACKAGE}.{name}"))
