"""``nccltree-run``: start the processes of a job, as torchrun does, without MPI.

nccltree-run --nproc-per-node N [--nnodes M --node-rank K --master-addr A
             --master-port P] [--prefix] script.py ARGS...   (or -m module ARGS...)

Each node runs one ``nccltree-run``; it starts ``N`` children with torchrun's variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus
``NCCLTREE_STORE_TOKEN`` (the job's token) and ``NCCLTREE_STORE_HOSTED=1``: the
launcher of node 0 hosts the job's TCP store (on ``MASTER_ADDR:MASTER_PORT``) for the
whole job, and every rank is its client (``init_process_group`` finds all this in the
environment). An MPI launcher's variables (``PMI_*``, ``OMPI_COMM_WORLD_*``) are removed
from the children's environment, so that they start by the store.

Nodes meet first: each launcher registers with node 0's store, and all wait (up to
``--rdzv-timeout`` seconds) for every node rank, naming those that do not come.

The token: a single-node job draws a random one. A job of several nodes takes it from
``--token`` or ``NCCLTREE_STORE_TOKEN`` (the same on every node); where neither is
given, node 0 draws one and prints it on stderr for the other nodes' command lines, and
a node of rank > 0 without one is refused.

Children run in their own sessions (a terminal's Ctrl-C reaches the launcher only),
which forwards SIGINT and SIGTERM to each child's process group, waits ``--grace``
seconds, then kills what is left. When a child fails (a non-zero status or a signal),
the launcher names its rank in one line, stops the others (and, through the store, the
other nodes') and exits with the first failure's status (128 + N for signal N). After
the children end it removes the shared-memory segments they left in ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from .._errors import CommError, PeerFailure
from ..comm.group.store import HOSTED_VAR, TOKEN_VAR, TCPStore
from ._common import ExitStatus, UsageError, int_at_least, make_parser, run_main

PROG = "nccltree-run"
#: seconds between the launcher's looks at its children (and, every few, at the store)
POLL = 0.05
#: seconds between a node's heartbeats in the store (launchers of node rank > 0)
BEAT = 1.0
#: seconds without a heartbeat after which node 0 takes a node's launcher for gone
BEAT_LOST = 30.0
#: the default port of a job of several nodes (torchrun's)
DEFAULT_PORT = 29500
#: variables of MPI launchers not passed on to the children
MPI_VARIABLES = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "PMIX_RANK")  # fmt: skip

EXAMPLE = """\
examples:
  # 4 processes on this machine (the store listens on 127.0.0.1, on a free port)
  nccltree-run --nproc-per-node 4 train.py --epochs 3
  nccltree-run --nproc-per-node 2 --prefix -m nccltree.cli.bench collectives -b 1M -e 1M

  # two nodes of 4 processes; the same token on both (or let node 0 draw and print one)
  export NCCLTREE_STORE_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')
  node0$ nccltree-run --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
             --master-addr node0 --master-port 29500 train.py
  node1$ nccltree-run --nnodes 2 --node-rank 1 --nproc-per-node 4 \\
             --master-addr node0 --master-port 29500 train.py

The token: clients of the store must present the job's token. One node: drawn at
random. Several nodes: --token or $NCCLTREE_STORE_TOKEN, the same on every node; if
node 0 has neither it draws one and prints it (stderr), and a node of rank > 0 with
neither is refused. The store listens only on --master-addr (127.0.0.1 by default;
NCCLTREE_STORE_BIND overrides, e.g. 0.0.0.0).

torchrun's spellings work too (--nproc_per_node, --node_rank, --master_addr, ...).
Exit status: the first failed child's (128 + N for signal N); 0 when every child
succeeded; 1 when the job could not start (a port in use, a node that did not come,
a refused token); 2 bad usage; 130/143 interrupted by SIGINT/SIGTERM.
"""


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(
        PROG,
        "Start the processes of a job on this node, as torchrun does (its flags and\n"
        "variables), with no MPI. Node 0's launcher hosts the job's start-up store on\n"
        "MASTER_ADDR:MASTER_PORT; every child gets RANK, WORLD_SIZE, LOCAL_RANK,\n"
        "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and the job's\n"
        "NCCLTREE_STORE_TOKEN, and nccltree.init_process_group() starts from them.\n"
        "When a child fails, the launcher names its rank, stops the job within --grace\n"
        "seconds and exits with that child's status; SIGINT and SIGTERM are passed on.",
        epilog=EXAMPLE,
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    pos = int_at_least(1)
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=pos,
        default=1,
        metavar="N",
        help="processes on this node (default 1)",
    )
    p.add_argument(
        "--nnodes",
        default="1",
        metavar="M",
        help="nodes in the job, each running one nccltree-run (default 1)",
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",
        type=int_at_least(0),
        default=0,
        metavar="K",
        help="this node's rank, 0..M-1 (default 0; node 0 hosts the store)",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        metavar="A",
        help="node 0's address, where its store listens and the others connect (default 127.0.0.1)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=int_at_least(0),
        default=None,
        metavar="P",
        help="the store's port (default: a free one for a single "
        f"node, {DEFAULT_PORT} for several)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="A:P",
        help="node 0's address and port in one (as torchrun's)",
    )
    p.add_argument(
        "--standalone", action="store_true", help="a single node on a free port (as torchrun's)"
    )
    p.add_argument(
        "--rdzv-timeout",
        "--rdzv_timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds the nodes wait for one another, and node > 0 for node 0's "
        "store (default 300)",
    )
    p.add_argument(
        "--token", default=None, help=f"the job's store token (default: ${TOKEN_VAR}; see below)"
    )
    p.add_argument(
        "--prefix",
        action="store_true",
        help="prefix every line of the children's output with '[RANK] '",
    )
    p.add_argument(
        "--tee",
        "-t",
        type=int,
        choices=[0, 1, 2, 3],
        default=0,
        help="torchrun's flag, here: prefix stdout (1), stderr (2) or both (3) with the rank",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping children (default 3)",
    )
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module (python -m), not a script",
    )
    p.add_argument(
        "--no-python",
        "--no_python",
        action="store_true",
        help="run the target as a program, not with this Python",
    )
    p.add_argument(
        "training_script",
        metavar="script.py",
        help="the script (or module, with -m) each child runs",
    )
    p.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments"
    )
    return p  # fmt: skip


@dataclass
class Config:
    nproc: int
    nnodes: int
    node_rank: int
    addr: str
    port: int
    rdzv_timeout: float
    token: str
    token_drawn: bool
    prefix: tuple[bool, bool]  # stdout, stderr
    grace: float
    command: list[str]


def _config(a: argparse.Namespace, environ: dict[str, str]) -> Config:
    try:
        nnodes = int(a.nnodes)
    except ValueError:
        raise UsageError(
            f"--nnodes {a.nnodes}: a number of nodes (elastic ranges are not supported)"
        ) from None
    if nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {nnodes}")
    if a.node_rank >= nnodes:
        raise UsageError(f"--node-rank {a.node_rank} is not in 0..{nnodes - 1}")
    if a.max_restarts:
        raise UsageError("--max-restarts: restarts are not supported")
    if a.rdzv_timeout <= 0 or a.grace < 0:
        raise UsageError("--rdzv-timeout must be positive and --grace not negative")
    addr, port = a.master_addr, a.master_port
    if a.rdzv_endpoint:
        host, _, p = a.rdzv_endpoint.rpartition(":")
        if not host or not p.isdigit():
            raise UsageError(f"--rdzv-endpoint {a.rdzv_endpoint!r} is not HOST:PORT")
        addr, port = host.strip("[]"), int(p)
    if a.standalone:
        if nnodes != 1:
            raise UsageError("--standalone is a job of one node (drop --nnodes)")
        addr, port = "127.0.0.1", 0
    if port is None:
        port = 0 if nnodes == 1 else DEFAULT_PORT
    if port > 65535:
        raise UsageError(f"--master-port {port} is not a TCP port")
    if nnodes > 1 and port == 0:
        raise UsageError("a job of several nodes needs --master-port (not 0)")
    token = a.token or environ.get(TOKEN_VAR) or ""
    drawn = False
    if not token:
        if a.node_rank > 0:
            raise UsageError(
                f"node rank {a.node_rank} needs the job's token: pass --token or set "
                f"{TOKEN_VAR} (the same on every node; node 0 prints the one it draws)"
            )
        token, drawn = secrets.token_hex(16), True
    target = a.training_script
    args = list(a.training_script_args)
    if args[:1] == ["--"]:
        args = args[1:]
    if a.no_python:
        command = [target, *args]
    elif a.module:
        command = [sys.executable, "-m", target, *args]
    else:
        command = [sys.executable, target, *args]
    prefix = (a.prefix or a.tee in (1, 3), a.prefix or a.tee in (2, 3))
    return Config(a.nproc_per_node, nnodes, a.node_rank, addr, port, a.rdzv_timeout, token,
                  drawn, prefix, a.grace, command)  # fmt: skip


@dataclass
class Child:
    rank: int
    local: int
    proc: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _status_text(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {-code} ({name})"
    return f"exited with status {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


class Launcher:
    """One node's launcher: the store (hosted on node 0), the children, their end."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.children: list[Child] = []
        self.store: TCPStore | None = None
        self.signals: list[int] = []
        self.out_lock = threading.Lock()
        self.pids: set[int] = set()
        self.spawning = False  # from the first child on, signals are handled in watch()

    # -- the store and the nodes' meeting -------------------------------------------------

    def open_store(self) -> None:
        c = self.cfg
        if c.node_rank == 0:
            bind = os.environ.get("NCCLTREE_STORE_BIND") or c.addr
            self.store = TCPStore(bind, c.port, is_server=True, timeout=c.rdzv_timeout,
                                  token=c.token)  # fmt: skip
            c.port = self.store.port
            if c.token_drawn and c.nnodes > 1:
                _say(f"the job's token (give it to the other nodes: --token or {TOKEN_VAR}): "
                     f"{c.token}")  # fmt: skip
        else:
            self.store = TCPStore(c.addr, c.port, is_server=False, timeout=c.rdzv_timeout,
                                  token=c.token)  # fmt: skip

    def meet(self) -> None:
        """Every node registered (``CommError`` naming the node ranks that are not)."""
        c, store = self.cfg, self.store
        assert store is not None
        if store.add(f"run/claim/{c.node_rank}", 1) > 1:
            raise CommError(f"node rank {c.node_rank} was given to two launchers")
        me = {"nproc": c.nproc, "nnodes": c.nnodes, "host": socket.gethostname()}
        store.set(f"run/join/{c.node_rank}", json.dumps(me).encode())
        keys = [f"run/join/{k}" for k in range(c.nnodes)]
        deadline = time.monotonic() + c.rdzv_timeout
        while True:
            self._check_signals()
            if store.check(keys):
                break
            if time.monotonic() > deadline:
                missing = [k for k in range(c.nnodes) if not store.check([keys[k]])]
                raise CommError(
                    f"node ranks {missing} of {c.nnodes} did not join within "
                    f"{c.rdzv_timeout:g} s (--rdzv-timeout); are their --master-addr, "
                    "--master-port and token right?"
                )
            time.sleep(0.05)
        for k, raw in enumerate(store.multi_get(keys)):
            other = json.loads(raw)
            if other.get("nproc") != c.nproc or other.get("nnodes") != c.nnodes:
                raise CommError(
                    f"node rank {k} ({other.get('host')}) has --nproc-per-node "
                    f"{other.get('nproc')} --nnodes {other.get('nnodes')}, this node "
                    f"{c.nproc} and {c.nnodes}: every node must give the same"
                )

    # -- the children ----------------------------------------------------------------------

    def child_env(self, local: int) -> dict[str, str]:
        c = self.cfg
        env = {k: v for k, v in os.environ.items() if k not in MPI_VARIABLES}
        rank = c.node_rank * c.nproc + local
        env.update(
            RANK=str(rank), WORLD_SIZE=str(c.nproc * c.nnodes), LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(c.nproc), GROUP_RANK=str(c.node_rank),
            GROUP_WORLD_SIZE=str(c.nnodes), ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(c.nproc * c.nnodes), MASTER_ADDR=c.addr,
            MASTER_PORT=str(c.port), **{TOKEN_VAR: c.token, HOSTED_VAR: "1"},
        )  # fmt: skip
        if any(c.prefix):
            env["PYTHONUNBUFFERED"] = "1"  # lines as they come, not when a buffer fills
        return env

    def spawn(self) -> None:
        c = self.cfg
        self.spawning = True
        for local in range(c.nproc):
            rank = c.node_rank * c.nproc + local
            try:
                proc = subprocess.Popen(
                    c.command,
                    env=self.child_env(local),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if c.prefix[0] else None,
                    stderr=subprocess.PIPE if c.prefix[1] else None,
                    start_new_session=True,
                )
            except OSError as exc:
                raise CommError(f"cannot start {c.command[0]}: {exc.strerror or exc}") from exc
            child = Child(rank, local, proc)
            self.pids.add(proc.pid)
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                if stream is not None:
                    t = threading.Thread(target=self._relay, args=(rank, stream, out),
                                         daemon=True)  # fmt: skip
                    t.start()
                    child.readers.append(t)
            self.children.append(child)

    def _relay(self, rank: int, stream: IO[bytes], out: IO[str]) -> None:
        tag = f"[{rank}] ".encode()
        sink = out.buffer if hasattr(out, "buffer") else None
        for line in iter(stream.readline, b""):
            with self.out_lock:
                if sink is not None:
                    sink.write(tag + line)
                    sink.flush()
                else:
                    out.write((tag + line).decode(errors="replace"))
                    out.flush()
        stream.close()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)
        if not self.spawning:
            # before the children: end the wait in progress (a store's connect, the
            # nodes' meeting) at once
            raise _Interrupted(signum)

    def _check_signals(self) -> None:
        if self.signals:
            raise _Interrupted(self.signals[0])

    def watch(self) -> int:
        """Until every child ended, or one failed (then the others are stopped); the
        job's exit status."""
        c, store = self.cfg, self.store
        assert store is not None
        last_look = 0.0
        beats: dict[int, tuple[int, float]] = {}
        my_beat = 0.0
        done_set = False
        while True:
            if self.signals:
                sig = self.signals[0]
                _say(f"got {signal.Signals(sig).name}: stopping the children")
                self.stop(sig)
                return 128 + sig
            running = False
            for ch in self.children:
                code = ch.proc.poll()
                if code is None:
                    running = True
                elif code != 0 and self.signals:
                    # the job was told to stop and the child stopped: the signal's round
                    # (above, next time) reports it, not as a failure
                    running = True
                    break
                elif code != 0:
                    what = (f"rank {ch.rank} (local rank {ch.local}, pid {ch.pid}"
                            f"{', node ' + str(c.node_rank) if c.nnodes > 1 else ''}) "
                            f"{_status_text(code)}")  # fmt: skip
                    self._report_failure(what, code)
                    _say(f"{what}; stopping the job")
                    self.stop(signal.SIGTERM)
                    return _exit_code(code)
            now = time.monotonic()
            if c.nnodes > 1 and now - last_look > 0.5:
                last_look = now
                try:
                    failed = self._other_failure()
                    if failed is not None:
                        _say(f"{failed[0]}; stopping this node's children")
                        self.stop(signal.SIGTERM)
                        return failed[1]
                    if c.node_rank > 0 and now - my_beat > BEAT:
                        store.add(f"run/beat/{c.node_rank}", 1)
                        my_beat = now
                    if c.node_rank == 0:
                        lost = self._lost_nodes(beats, now)
                        if lost:
                            _say(f"{lost}; stopping the job")
                            self._report_failure(lost, 1)
                            self.stop(signal.SIGTERM)
                            return ExitStatus.FAILURE
                except PeerFailure:
                    _say("lost node 0's store (its launcher ended); stopping this node's children")
                    self.stop(signal.SIGTERM)
                    return ExitStatus.FAILURE
            if not running:
                if c.nnodes == 1:
                    return 0
                if not done_set:
                    store.set(f"run/done/{c.node_rank}", b"")
                    done_set = True
                if c.node_rank > 0:
                    return 0
                if store.check([f"run/done/{k}" for k in range(c.nnodes)]):
                    return 0  # node 0 keeps the store until every node is done
            time.sleep(POLL)

    def _report_failure(self, what: str, code: int) -> None:
        if self.store is None or self.cfg.nnodes == 1:
            return
        try:
            if not self.store.check(["run/failed"]):
                self.store.set("run/failed", json.dumps([what, _exit_code(code)]).encode())
        except CommError:
            pass  # the store is gone: the other nodes see that

    def _other_failure(self) -> tuple[str, int] | None:
        assert self.store is not None
        if not self.store.check(["run/failed"]):
            return None
        what, code = json.loads(self.store.get("run/failed"))
        return f"on another node, {what}", int(code) or 1

    def _lost_nodes(self, beats: dict[int, tuple[int, float]], now: float) -> str | None:
        assert self.store is not None
        for k in range(1, self.cfg.nnodes):
            if self.store.check([f"run/done/{k}"]):
                continue
            key = f"run/beat/{k}"
            n = int(self.store.get(key)) if self.store.check([key]) else 0
            seen = beats.get(k)
            if seen is None or seen[0] != n:
                beats[k] = (n, now)
            elif now - seen[1] > BEAT_LOST:
                return f"node rank {k}'s launcher stopped (no heartbeat for {BEAT_LOST:g} s)"
        return None

    def stop(self, sig: int) -> None:
        """Send ``sig`` to every running child's process group, wait up to the grace
        period, then kill what is left."""
        for ch in self.children:
            if ch.proc.poll() is None:
                _killpg(ch.pid, sig)
        deadline = time.monotonic() + self.cfg.grace
        while time.monotonic() < deadline and any(ch.proc.poll() is None for ch in self.children):
            if len(self.signals) > 1:
                break  # a second signal: no more grace
            time.sleep(POLL)
        for ch in self.children:
            if ch.proc.poll() is None:
                _killpg(ch.pid, signal.SIGKILL)

    def finish(self) -> None:
        """Reap every child, kill what their process groups left, join the relays,
        remove their shared memory, close the store."""
        for ch in self.children:
            try:
                ch.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _killpg(ch.pid, signal.SIGKILL)
                ch.proc.wait(timeout=10)
            _killpg(ch.pid, signal.SIGKILL)  # what the child left in its group, if any
            for t in ch.readers:
                t.join(timeout=5)
        if self.pids:
            from ..comm.group.shm import remove_of_pids  # (numpy: not before the children)

            remove_of_pids(self.pids)
        if self.store is not None:
            self.store.close()
            self.store = None


class _Interrupted(Exception):
    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.sig = sig


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _run(a: argparse.Namespace) -> int:
    cfg = _config(a, dict(os.environ))
    launcher = Launcher(cfg)
    old = {s: signal.signal(s, launcher._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            launcher.open_store()
            if cfg.nnodes > 1:
                launcher.meet()
            launcher._check_signals()
            launcher.spawn()
            return launcher.watch()
        except _Interrupted as exc:
            _say(f"got {signal.Signals(exc.sig).name} before the children started")
            return 128 + exc.sig
        except CommError as exc:
            _say(f"node rank {cfg.node_rank}: {exc}" if cfg.nnodes > 1 else str(exc))
            launcher.stop(signal.SIGTERM)
            return ExitStatus.FAILURE
        finally:
            launcher.finish()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(build_parser(), argv, _run)


if __name__ == "__main__":
    sys.exit(main())
