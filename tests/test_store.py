"""The start-up key-value stores (TCP and file) and the bootstrap over them."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nccltree._errors import CommError, CommTimeout, MissingRanks, PeerFailure
from nccltree.comm.group.bootstrap import LocalBootstrap, StoreBootstrap
from nccltree.comm.group.store import MAX_FRAME, FileStore, KeysTimeout, TCPStore

HOST = "127.0.0.1"


@pytest.fixture
def server():
    s = TCPStore(HOST, 0, is_server=True, timeout=5.0, token="sesame")
    yield s
    s.close()


def client(server: TCPStore, token: str | None = "sesame", timeout: float = 5.0) -> TCPStore:
    return TCPStore(HOST, server.port, is_server=False, timeout=timeout, token=token)


def run_threads(fn, n: int) -> list[object]:
    """``fn(i)`` in ``n`` threads; their results, or the exceptions they raised."""
    out: list[object] = [None] * n

    def one(i: int) -> None:
        try:
            out[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            out[i] = exc

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


@pytest.fixture(params=["tcp", "file"])
def pair(request, tmp_path):
    """Two handles on one store: the host's and a client's."""
    if request.param == "tcp":
        s = TCPStore(HOST, 0, is_server=True, timeout=5.0, token="sesame")
        c = client(s)
        yield s, c
        c.close()
        s.close()
    else:
        host = FileStore(str(tmp_path / "store"), timeout=5.0, owner=True)
        c = FileStore(str(tmp_path / "store"), timeout=5.0)
        yield host, c
        c.close()
        host.close()
        assert not (tmp_path / "store").exists()


def test_operations(pair):
    host, c = pair
    c.set("a", b"1")
    assert host.get("a") == b"1"
    host.set("b", b"\x00\xff")
    assert c.multi_get(["a", "b"]) == [b"1", b"\x00\xff"]
    assert c.add("n", 3) == 3
    assert host.add("n", -1) == 2
    assert c.check(["a", "b"]) and not c.check(["a", "zz"])
    assert c.delete("a") and not host.delete("a")
    assert not host.check(["a"])
    c.wait(["b", "n"], timeout=1.0)


def test_get_waits_until_set(pair):
    host, c = pair

    def later() -> None:
        time.sleep(0.2)
        host.set("late", b"here")

    t = threading.Thread(target=later)
    t.start()
    assert c.get("late", timeout=5.0) == b"here"
    t.join()


def test_get_times_out_naming_the_key(pair):
    _, c = pair
    with pytest.raises(KeysTimeout, match="'never'") as info:
        c.get("never", timeout=0.2)
    assert info.value.keys == ["never"]
    with pytest.raises(CommTimeout, match="missing"):
        c.wait(["missing", "also"], timeout=0.1)


def test_concurrent_adds(pair):
    host, c = pair
    got = run_threads(lambda i: (host if i % 2 else c).add("k", 1), 8)
    assert sorted(got) == list(range(1, 9))  # type: ignore[type-var]


def test_bad_keys_and_values(server):
    with pytest.raises(ValueError, match="key"):
        server.set("", b"x")
    with pytest.raises(ValueError, match="key"):
        server.set("k" * 2000, b"x")
    with pytest.raises(TypeError, match="bytes"):
        server.set("k", "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="over the limit"):
        server.set("k", bytes(MAX_FRAME))


def test_token_required(server):
    for token in ("wrong", None):
        with pytest.raises(CommError, match="refused this process: wrong job token"):
            client(server, token=token)
    c = client(server)
    c.set("ok", b"1")
    c.close()


def test_no_token_accepts_any(tmp_path):
    with TCPStore(HOST, 0, is_server=True, timeout=5.0) as s:
        c = TCPStore(HOST, s.port, is_server=False, timeout=5.0, token="anything")
        c.set("x", b"1")
        assert s.get("x") == b"1"
        c.close()


def raw_hello(port: int, token: bytes) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=5)
    key = b"nccltree-store-1"
    body = struct.pack(">BH", 1, len(key)) + key + token
    sock.sendall(struct.pack(">I", len(body)) + body)
    head = sock.recv(4)
    (n,) = struct.unpack(">I", head)
    assert sock.recv(n)[0] == 100  # OK
    return sock


@pytest.mark.parametrize(
    "junk",
    [
        struct.pack(">I", MAX_FRAME + 1),  # too long: refused before anything is read
        struct.pack(">I", 1) + b"\x02",  # shorter than its header
        struct.pack(">I", 3) + struct.pack(">BH", 2, 60000),  # a key longer than the frame
        struct.pack(">I", 3) + struct.pack(">BH", 77, 0),  # an unknown operation
    ],
)
def test_malformed_frames_drop_the_connection(server, junk):
    sock = raw_hello(server.port, b"sesame")
    sock.sendall(junk)
    sock.settimeout(5)
    try:
        assert sock.recv(4) == b""  # closed by the server
    except ConnectionResetError:
        pass  # closed with data unread: a reset
    sock.close()
    c = client(server)  # the server still serves
    c.set("after", b"1")
    c.close()


def test_malformed_request_answers_an_error(server):
    sock = raw_hello(server.port, b"sesame")
    body = struct.pack(">BH", 4, 1) + b"k" + b"abc"  # ADD with a number of 3 bytes
    sock.sendall(struct.pack(">I", len(body)) + body)
    (n,) = struct.unpack(">I", sock.recv(4))
    assert sock.recv(n)[0] == 103  # ERR
    sock.close()


def test_silent_connection_does_not_block_others(server):
    quiet = socket.create_connection((HOST, server.port), timeout=5)
    c = client(server)
    c.set("x", b"1")
    assert c.get("x") == b"1"
    c.close()
    quiet.close()


def test_port_in_use():
    with TCPStore(HOST, 0, is_server=True, timeout=1.0) as s:
        with pytest.raises(
            CommError, match=rf"cannot listen on {HOST}:{s.port}: the port is in use"
        ):
            TCPStore(HOST, s.port, is_server=True, timeout=1.0)


def test_nobody_listening():
    probe = socket.socket()
    probe.bind((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(CommTimeout, match=rf"{port}: could not connect within 0.3 s"):
        TCPStore(HOST, port, is_server=False, timeout=0.3)


def test_store_that_never_answers():
    mute = socket.create_server((HOST, 0))
    port = mute.getsockname()[1]
    with pytest.raises(CommTimeout, match="accepted the connection but did not answer"):
        TCPStore(HOST, port, is_server=False, timeout=0.3)
    mute.close()


def test_lost_server(server):
    c = client(server)
    c.set("x", b"1")
    server.close()
    with pytest.raises(PeerFailure, match="lost the store"):
        c.get("x")
    c.close()


def test_client_connects_before_the_server_starts():
    probe = socket.socket()
    probe.bind((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()
    box: list[TCPStore] = []

    def late() -> None:
        time.sleep(0.3)
        box.append(TCPStore(HOST, port, is_server=True, timeout=5.0))

    t = threading.Thread(target=late)
    t.start()
    c = TCPStore(HOST, port, is_server=False, timeout=5.0)
    t.join()
    c.set("x", b"1")
    assert box[0].get("x") == b"1"
    c.close()
    box[0].close()


# -- the bootstrap over a store ------------------------------------------------------------


def boots(server: TCPStore, n: int, timeout: float = 5.0) -> list[StoreBootstrap]:
    """A bootstrap per process (rank 0's on the server's handle), made in threads."""
    return run_threads(  # type: ignore[return-value]
        lambda i: StoreBootstrap(server if i == 0 else client(server), i, n, timeout), n
    )


def test_exchange_and_barrier(server):
    bs = boots(server, 3)
    for round_ in range(3):
        got = run_threads(lambda i, r=round_: bs[i].exchange({"rank": i, "round": r}), 3)
        assert got == [[{"rank": i, "round": round_} for i in range(3)]] * 3
    assert run_threads(lambda i: bs[i].barrier(), 3) == [None] * 3
    # rank 0 deleted every round's keys but the last one's
    assert len(server._table.data) < 3 * 2 + 10  # type: ignore[union-attr]
    run_threads(lambda i: bs[i].close(), 3)


def test_a_second_bootstrap_reuses_no_key(server):
    first = boots(server, 2)
    run_threads(lambda i: first[i].exchange(i), 2)
    for b in first[1:]:
        b.close()  # rank 0's stays: it owns the server this test still uses
    second = boots(server, 2)
    assert second[0].prefix != first[0].prefix
    assert run_threads(lambda i: second[i].exchange(10 + i), 2) == [[10, 11]] * 2
    for b in second[1:]:
        b.close()


def test_missing_process_named(server):
    bs = boots(server, 3, timeout=0.5)
    got = run_threads(lambda i: bs[i].exchange(i), 2)  # process 2 never comes
    for exc in got:
        assert isinstance(exc, MissingRanks)
        assert exc.ranks == (2,)
        assert "processes [2] did not reach the bootstrap's exchange within 0.5 s" in str(exc)
    for b in bs[1:]:
        b.close()


def test_abort_seen_by_the_others(server):
    bs = boots(server, 3)

    def step(i: int) -> object:
        if i == 1:
            bs[1].abort("out of memory")
            return None
        return bs[i].exchange(i)

    got = run_threads(step, 3)
    for i in (0, 2):
        assert isinstance(got[i], PeerFailure)
        assert "process 1 gave up: out of memory" in str(got[i])
    for b in bs[1:]:
        b.close()


def test_sub(server):
    bs = boots(server, 4)
    evens = run_threads(lambda i: bs[i].sub("evens", [0, 2]) if i % 2 == 0 else None, 4)
    got = run_threads(
        lambda i: evens[i].exchange(f"e{i}") if i % 2 == 0 else None,  # type: ignore[union-attr]
        4,
    )
    assert got == [["e0", "e2"], None, ["e0", "e2"], None]
    assert evens[2].rank == 1 and evens[2].size == 2  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="not among"):
        bs[1].sub("evens", [0, 2])
    with pytest.raises(ValueError, match="distinct"):
        bs[0].sub("x", [0, 0])
    run_threads(lambda i: bs[i].close(), 4)


def test_file_store_bootstrap(tmp_path):
    path = str(tmp_path / "fs")

    def one(i: int) -> object:
        b = StoreBootstrap(FileStore(path, timeout=5.0, owner=i == 0), i, 3, 5.0)
        got = [b.exchange([i, "x"]), b.exchange(i)]
        b.barrier()
        b.close()
        return got

    assert run_threads(one, 3) == [[[[0, "x"], [1, "x"], [2, "x"]], [0, 1, 2]]] * 3
    assert not os.path.exists(path)


def test_local_bootstrap():
    b = LocalBootstrap()
    assert b.exchange({"a": (1, 2)}) == [{"a": [1, 2]}]
    b.barrier()
    assert b.sub("x", [0]).size == 1
    b.close()


def test_bad_arguments(server):
    with pytest.raises(ValueError, match="rank 3 is not in 0..2"):
        StoreBootstrap(server, 3, 3, 1.0)
    with pytest.raises(ValueError, match="not a TCP port"):
        TCPStore(HOST, 70000, is_server=True, timeout=1.0)


# -- across processes ----------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys
    from nccltree.comm.group.bootstrap import StoreBootstrap
    from nccltree.comm.group.store import FileStore, TCPStore
    kind, where, rank, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if kind == "tcp":
        store = TCPStore("127.0.0.1", int(where), is_server=rank == 0, timeout=20, token="t")
    else:
        store = FileStore(where, timeout=20, owner=rank == 0)
    b = StoreBootstrap(store, rank, size, 20.0)
    got = b.exchange({"r": rank})
    assert got == [{"r": p} for p in range(size)], got
    assert b.exchange(rank * 10) == [p * 10 for p in range(size)]
    b.barrier()
    b.close()
    print("ok", rank)
    """
)


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_processes(kind, tmp_path):
    if kind == "tcp":
        probe = socket.socket()
        probe.bind((HOST, 0))
        where = str(probe.getsockname()[1])
        probe.close()
    else:
        where = str(tmp_path / "fs")
    n = 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, kind, where, str(r), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in reversed(range(n))  # rank 0 last: the clients wait for it
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * n, outs
    assert sorted(o.strip() for o in outs) == [f"ok {r}" for r in range(n)]
    if kind == "file":
        assert not os.path.exists(where)
