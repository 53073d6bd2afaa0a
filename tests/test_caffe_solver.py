"""Caffe solver files: the SolverParameter descriptor against caffe.proto's text, Caffe's
own example solvers parsed to the trainer's settings, unknown fields and refusals, flags
over the file and the record of where each setting came from."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("google.protobuf")

from nccltree.caffe_proto import file_descriptor, message_class, solver_field_names
from nccltree.cli import train
from nccltree.solver_file import read_solver

EXCERPT = Path(__file__).parent / "data" / "caffe_proto_excerpt.proto"

# Caffe's examples/mnist/lenet_solver.prototxt (BVLC/caffe master), as shipped
LENET_SOLVER = """\
# The train/test net protocol buffer definition
net: "examples/mnist/lenet_train_test.prototxt"
# test_iter specifies how many forward passes the test should carry out.
# In the case of MNIST, we have test batch size 100 and 100 test iterations,
# covering the full 10,000 testing images.
test_iter: 100
# Carry out testing every 500 training iterations.
test_interval: 500
# The base learning rate, momentum and the weight decay of the network.
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
# The learning rate policy
lr_policy: "inv"
gamma: 0.0001
power: 0.75
# Display every 100 iterations
display: 100
# The maximum number of iterations
max_iter: 10000
# snapshot intermediate results
snapshot: 5000
snapshot_prefix: "examples/mnist/lenet"
# solver mode: CPU or GPU
solver_mode: GPU
"""

# Caffe's examples/cifar10/cifar10_quick_solver.prototxt (BVLC/caffe master), as shipped
CIFAR10_QUICK_SOLVER = """\
# reduce the learning rate after 8 epochs (4000 iters) by a factor of 10

# The train/test net protocol buffer definition
net: "examples/cifar10/cifar10_quick_train_test.prototxt"
# test_iter specifies how many forward passes the test should carry out.
# In the case of MNIST, we have test batch size 100 and 100 test iterations,
# covering the full 10,000 testing images.
test_iter: 100
# Carry out testing every 500 training iterations.
test_interval: 500
# The base learning rate, momentum and the weight decay of the network.
base_lr: 0.001
momentum: 0.9
weight_decay: 0.004
# The learning rate policy
lr_policy: "fixed"
# Display every 100 iterations
display: 100
# The maximum number of iterations
max_iter: 4000
# snapshot intermediate results
snapshot: 4000
snapshot_prefix: "examples/cifar10/cifar10_quick"
# solver mode: CPU or GPU
solver_mode: GPU
"""

_FIELD = re.compile(
    r"^\s*(optional|repeated)\s+(\w+)\s+(\w+)\s*=\s*(\d+)\s*(?:\[(.*?)\])?\s*;", re.MULTILINE
)


def _proto_messages(text: str) -> dict[str, list[tuple[str, str, str, int, str | None]]]:
    """message name -> (label, type, name, number, default) of each field, from caffe.proto's
    text (top-level messages; nested enums are skipped)."""
    out: dict[str, list[tuple[str, str, str, int, str | None]]] = {}
    for m in re.finditer(r"^message (\w+) \{(.*?)^\}", text, re.MULTILINE | re.DOTALL):
        fields = []
        for f in _FIELD.finditer(m.group(2)):
            opts = f.group(5) or ""
            d = re.search(r"default\s*=\s*([^,\]]+)", opts)
            fields.append(
                (f.group(1), f.group(2), f.group(3), int(f.group(4)), d and d.group(1).strip())
            )
        out[m.group(1)] = fields
    return out


_TYPES = {
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float": "TYPE_FLOAT",
    "double": "TYPE_DOUBLE",
    "bool": "TYPE_BOOL",
    "string": "TYPE_STRING",
    "bytes": "TYPE_BYTES",
}


def _write(tmp_path: Path, text: str, name: str = "solver.prototxt") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_descriptor_holds_every_field_as_caffe_proto_declares_it():
    from google.protobuf import descriptor_pb2

    F = descriptor_pb2.FieldDescriptorProto
    declared = _proto_messages(EXCERPT.read_text())
    ours = {m.name: {f.name: f for f in m.field} for m in file_descriptor().message_type}
    assert set(declared) <= set(ours)
    # caffe.proto: "SolverParameter next available ID: 43": field numbers 1 to 42, all used
    assert sorted(f[3] for f in declared["SolverParameter"]) == list(range(1, 43))
    assert solver_field_names() == tuple(f[2] for f in declared["SolverParameter"])
    for message, fields in declared.items():
        assert set(ours[message]) == {f[2] for f in fields}, message
        for label, typ, name, number, default in fields:
            f = ours[message][name]
            assert f.number == number, (message, name)
            want_label = F.LABEL_REPEATED if label == "repeated" else F.LABEL_OPTIONAL
            assert f.label == want_label, (message, name)
            if typ in _TYPES:
                assert f.type == getattr(F, _TYPES[typ]), (message, name)
            else:  # a message or an enum of caffe.proto
                assert f.type_name.rsplit(".", 1)[-1] == typ, (message, name)
            if default is None:
                assert not f.HasField("default_value"), (message, name)
            else:
                got = f.default_value
                want = default.strip('"')
                if typ in ("float", "double"):
                    assert float(got) == float(want), (message, name)
                else:
                    assert got == want, (message, name)


def test_lenet_solver_parses_to_the_expected_settings(tmp_path):
    s = read_solver(_write(tmp_path, LENET_SOLVER))
    assert s.values == {
        "lr": 0.01,
        "momentum": 0.9,
        "weight_decay": 0.0005,
        "lr_policy": "inv",
        "gamma": 0.0001,
        "power": 0.75,
        "display": 100,
        "iters": 10000,
        "max_iter": 10000,
        "snapshot_every": 5000,
        "out": "examples/mnist/lenet",
        "eval_every": 500,
    }
    assert s.origin["iters"] == "max_iter" and s.origin["lr"] == "base_lr"
    assert set(s.unused) == {"net", "test_iter", "solver_mode"}
    line = s.unused_line()
    assert line is not None and "\n" not in line
    assert "net (" in line and "solver_mode (" in line and "test_iter (" in line
    # base_lr is a float in caffe.proto: the value as written is kept, and said so
    assert s.values["lr"] == 0.01 and "base_lr 0.01 as written" in s.notes["base_lr"]
    assert "0.009999999776" in s.notes["base_lr"]


def test_cifar10_quick_solver_parses_to_the_expected_settings(tmp_path):
    s = read_solver(_write(tmp_path, CIFAR10_QUICK_SOLVER))
    assert s.values == {
        "lr": 0.001,
        "momentum": 0.9,
        "weight_decay": 0.004,
        "lr_policy": "fixed",
        "display": 100,
        "iters": 4000,
        "max_iter": 4000,
        "snapshot_every": 4000,
        "out": "examples/cifar10/cifar10_quick",
        "eval_every": 500,
    }
    assert set(s.unused) == {"net", "test_iter", "solver_mode"}


def test_the_real_runtime_reads_the_same_message(tmp_path):
    from google.protobuf import text_format

    msg = text_format.Parse(LENET_SOLVER, message_class("SolverParameter")())
    assert msg.max_iter == 10000 and msg.lr_policy == "inv" and msg.solver_mode == 1
    assert msg.iter_size == 1 and msg.clip_gradients == -1 and msg.type == "SGD"
    # serialized and parsed back by the runtime: the descriptor is a real one
    again = message_class("SolverParameter").FromString(msg.SerializeToString())
    assert again == msg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("base_lr: 0.1\nbse_lr: 0.1\n", r'solver.prototxt:2:1: .*no field named "bse_lr"'),
        ("base_lr: 0.1\nnet_param { layer { name: 'x' } }\n", r"net_param \(an inline net"),
        ("train_net_param { name: 'x' }\n", r"train_net_param \(an inline net"),
        ("test_net_param < name: 'x' >\n", r"test_net_param \(an inline net"),
        ('type: "Adam"\n', r'type: "Adam" is not supported.*SGD'),
        ("solver_type: NESTEROV\n", r"solver_type: NESTEROV is not supported"),
        ('regularization_type: "L1"\n', r'regularization_type: "L1" is not supported'),
        ('lr_policy: "cosine"\n', r'lr_policy: "cosine" is none of Caffe'),
        ("iter_size: 0\n", r"iter_size: 0 must be at least 1"),
        ("base_lr: 0.1\nbase_lr: 0.2\n", r"solver.prototxt:2:10: .*multiple \"base_lr\""),
        ('max_iter: "x"\n', r"solver.prototxt:1:11"),
    ],
)
def test_unknown_fields_and_refusals_are_named(tmp_path, text, message):
    with pytest.raises(ValueError, match=message) as info:
        read_solver(_write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_clip_random_seed_and_iter_size_map(tmp_path):
    s = read_solver(
        _write(
            tmp_path, "clip_gradients: 35\nrandom_seed: 7\niter_size: 4\nstepvalue: 3 stepvalue: 9"
        )
    )
    assert s.values["clip_gradients"] == 35.0 and s.values["seed"] == 7
    assert s.values["iter_size"] == 4 and s.values["stepvalue"] == (3, 9)
    off = read_solver(_write(tmp_path, "clip_gradients: -1\nrandom_seed: -1\n"))
    assert "clip_gradients" not in off.values and "seed" not in off.values
    assert "random_seed" in off.unused


def _args(argv: list[str]):
    return train.build_parser().parse_args(train.caffe_spellings(argv))


def test_flags_override_the_file_and_every_source_is_recorded(tmp_path):
    path = _write(tmp_path, LENET_SOLVER.replace("examples/mnist/lenet", str(tmp_path / "run")))
    cfg, _, origins = train.resolve_with_origins(
        _args(["-solver", str(path), "--lr", "0.05", "--iters", "7", "--snapshot-every", "0"])
    )
    assert cfg.solver.lr == 0.05 and cfg.iters == 7 and cfg.snapshot_every == 0  # flags
    assert cfg.solver.lr_policy == "inv" and cfg.solver.gamma == 0.0001  # the file
    assert cfg.solver.max_iter == 10000 and cfg.eval_every == 500 and cfg.display == 100
    assert cfg.batch_size == 32  # neither: the default
    src = origins.sources
    assert src["lr"] == "flag" and src["iters"] == "flag"
    assert src["lr_policy"] == "solver file (lr_policy)"
    assert (
        src["max_iter"] == "solver file (max_iter)"
        and src["out"] == "solver file (snapshot_prefix)"
    )
    assert src["batch_size"] == "default"
    assert set(src) == set(train.TrainConfig().as_dict())


def test_caffes_solver_spelling_is_taken(tmp_path, capsys):
    rc = train.main(["-solver", str(tmp_path / "missing.prototxt")])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot read the solver file {tmp_path / 'missing.prototxt'}" in err
    assert train.caffe_spellings(["-solver=a", "--", "-solver"]) == ["--solver=a", "--", "-solver"]


def test_without_protobuf_the_message_says_what_to_install(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, LENET_SOLVER)
    monkeypatch.setitem(sys.modules, "google.protobuf", None)
    rc = train.main(["--solver", str(path), "--devices", "cpu:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "needs the protobuf package" in err and "nccltree[caffe]" in err


def test_bad_settings_from_the_file_say_so(tmp_path, capsys):
    path = _write(tmp_path, 'lr_policy: "step"\nbase_lr: 0.1\n')  # step needs stepsize
    rc = train.main(["--solver", str(path), "--devices", "cpu:1", "--iters", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "stepsize" in err and str(path) in err, err


def test_train_with_a_solver_file_records_sources(tmp_path, capsys):
    pytest.importorskip("google.protobuf")
    text = (
        'net: "train_val.prototxt"\nbase_lr: 0.05\nmomentum: 0.9\nlr_policy: "step"\n'
        "gamma: 0.5\nstepsize: 2\nmax_iter: 4\niter_size: 2\nclip_gradients: 100\n"
        "solver_mode: GPU\ndevice_id: 0\n"
    )
    path = _write(tmp_path, text)
    out = tmp_path / "run"
    argv = ["-solver", str(path), "--devices", "cpu:2", "--synthetic", "256",
            "--batch-size", "8", "--out", str(out)]  # fmt: skip
    assert train.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"solver file {path}: " in printed and f"{path}: not used here: " in printed
    assert "net (--model and --data say what trains)" in printed
    assert "device_id and solver_mode (--devices picks the devices)" in printed
    assert "iter_size 2" in printed and "clipped to L2 norm 100" in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    config = next(r for r in records if r["event"] == "config")
    assert config["solver_file"] == str(path)
    assert "base_lr 0.05 as written" in config["solver_notes"]["base_lr"]  # and says so
    assert config["iter_size"] == 2 and config["clip_gradients"] == 100.0 and config["iters"] == 4
    assert config["sources"]["iter_size"] == "solver file (iter_size)"
    assert config["sources"]["devices"] == "flag" and config["sources"]["seed"] == "default"
    trains = [r for r in records if r["event"] == "train"]
    assert [r["lr"] for r in trains] == [0.05, 0.05, 0.025, 0.025]
    assert all(r["examples"] == 2 * 8 * 2 for r in trains)  # ranks x batch x iter_size
