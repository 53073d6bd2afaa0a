"""A small key-value store, used only to start process groups without MPI.

Two kinds, with the same methods (``set``, ``get``, ``multi_get``, ``add``, ``wait``,
``check``, ``delete``, ``close``) and every wait bounded:

- :class:`TCPStore`: one process hosts it (a server thread, ``is_server=True``; rank 0,
  or the launcher of node 0), the others connect to it. Messages are length-prefixed
  frames (``>I`` length, then an operation byte, a ``>H`` key length, the key in UTF-8
  and the value's bytes); a frame longer than :data:`MAX_FRAME`, a key longer than
  :data:`MAX_KEY`, an unknown operation or a key that is not UTF-8 closes the
  connection. The first frame of a connection is a hello (at most :data:`MAX_HELLO`
  bytes) with the job's token: a server
  with a token refuses a client without the same one (compared in constant time), and a
  client that says nothing within :data:`HELLO_TIMEOUT` seconds is dropped. Values are
  bytes, never unpickled.
- :class:`FileStore`: a directory on a filesystem every process sees (``file://path``),
  one file per key written by an atomic rename, ``add`` under a ``lockf`` lock, waits by
  bounded polling. The directory must be new (or empty) for each job; the owner's
  ``close`` removes the files.

Failures: ``CommTimeout`` naming the key(s) and the timeout; ``CommError`` for a store
that cannot be reached, refuses this client (wrong token), or cannot listen;
``PeerFailure`` for a store lost in the middle of a request.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
import urllib.parse
from typing import Protocol

from ..._errors import CommError, CommTimeout, PeerFailure

#: the variable holding the job's store token (the same in every process of a job)
TOKEN_VAR = "NCCLTREE_STORE_TOKEN"
#: set to 1 by a launcher that hosts the store itself (every rank is then its client)
HOSTED_VAR = "NCCLTREE_STORE_HOSTED"

#: the largest frame either side accepts (values are names, ids, small JSON documents)
MAX_FRAME = 8 << 20
#: the longest key
MAX_KEY = 1024
#: the largest hello (the first frame, before the token is checked)
MAX_HELLO = 4096
#: seconds a new connection has to say hello before the server drops it
HELLO_TIMEOUT = 10.0
#: connections a server holds at once (more are refused)
MAX_CONNECTIONS = 4096
#: seconds a client waits beyond a request's own timeout for the server's answer
_MARGIN = 5.0
_VERSION = b"nccltree-store-1"

# operations (client -> server)
_HELLO, _SET, _GET, _ADD, _WAIT, _CHECK, _DELETE, _MGET = range(1, 9)
# answers (server -> client)
_OK, _VALUE, _TIMEOUT, _ERR = 100, 101, 102, 103

_HEAD = struct.Struct(">I")
_OPKEY = struct.Struct(">BH")
_F64 = struct.Struct(">d")
_I64 = struct.Struct(">q")


class Store(Protocol):
    """What a bootstrap needs from a store (:class:`TCPStore`, :class:`FileStore`)."""

    timeout: float
    #: whether this process hosts the store (its server, or the owner of its files)
    hosts: bool

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float | None = None) -> bytes: ...

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]: ...

    def add(self, key: str, n: int) -> int: ...

    def wait(self, keys: list[str], timeout: float | None = None) -> None: ...

    def check(self, keys: list[str]) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def close(self) -> None: ...


def _check_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"store: a key is a str, not {type(key).__name__}")
    raw = key.encode()
    if not raw or len(raw) > MAX_KEY:
        raise ValueError(f"store: a key has 1 to {MAX_KEY} bytes, not {len(raw)}: {key!r:.80}")
    return raw


def _check_value(value: bytes) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"store: a value is bytes, not {type(value).__name__}")
    value = bytes(value)
    if len(value) > MAX_FRAME - 64:
        raise ValueError(f"store: a value of {len(value)} bytes is over the limit ({MAX_FRAME})")
    return value


def _frame(op: int, key: bytes = b"", value: bytes = b"") -> bytes:
    body = _OPKEY.pack(op, len(key)) + key + value
    return _HEAD.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> tuple[int, bytes, bytes]:
    """One frame: (operation, key bytes, value). ``ValueError`` if malformed or longer
    than ``limit`` bytes."""
    (n,) = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if n < _OPKEY.size or n > limit:
        raise ValueError(f"a frame of {n} bytes (limit {limit})")
    body = _recv_exact(sock, n)
    op, klen = _OPKEY.unpack_from(body)
    if klen > MAX_KEY or _OPKEY.size + klen > n:
        raise ValueError(f"a key of {klen} bytes")
    key = body[_OPKEY.size : _OPKEY.size + klen]
    return op, key, body[_OPKEY.size + klen :]


def _keys_blob(keys: list[bytes]) -> bytes:
    return b"".join(_HEAD.pack(len(k)) + k for k in keys)


def _split_blob(blob: bytes) -> list[bytes]:
    out: list[bytes] = []
    i = 0
    while i < len(blob):
        if i + _HEAD.size > len(blob):
            raise ValueError("a truncated list")
        (n,) = _HEAD.unpack_from(blob, i)
        i += _HEAD.size
        if n > MAX_FRAME or i + n > len(blob):
            raise ValueError("a truncated list")
        out.append(blob[i : i + n])
        i += n
    return out


class KeysTimeout(CommTimeout):
    """A wait for keys ran out (the store itself answered). ``keys``: those waited for."""

    def __init__(self, message: str, keys: list[str]) -> None:
        super().__init__(message)
        self.keys = list(keys)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.keys))


def _timeout_error(where: str, keys: list[str], timeout: float) -> KeysTimeout:
    what = f"key {keys[0]!r}" if len(keys) == 1 else f"keys {keys!r:.300}"
    return KeysTimeout(f"{where}: waited {timeout:g} s for {what}", keys)


class _Table:
    """The server's keys and values, and the condition its waits use."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.cond = threading.Condition()
        self.closed = False

    def set(self, key: bytes, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def add(self, key: bytes, n: int) -> int:
        with self.cond:
            old = self.data.get(key, b"0")
            try:
                now = int(old.decode()) + n
            except ValueError as exc:
                raise ValueError(f"store: key {key.decode()!r} does not hold a number") from exc
            self.data[key] = str(now).encode()
            self.cond.notify_all()
            return now

    def wait(self, keys: list[bytes], timeout: float) -> bool:
        """Whether every key is set, waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(k in self.data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                self.cond.wait(min(left, 1.0))
            return True

    def values(self, keys: list[bytes]) -> list[bytes]:
        with self.cond:
            return [self.data[k] for k in keys]

    def check(self, keys: list[bytes]) -> bool:
        with self.cond:
            return all(k in self.data for k in keys)

    def delete(self, key: bytes) -> bool:
        with self.cond:
            return self.data.pop(key, None) is not None

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class _Server:
    """The listening side of a :class:`TCPStore`: a thread that accepts, and a thread per
    connection that answers it."""

    def __init__(self, host: str, port: int, token: bytes | None, table: _Table) -> None:
        self.table = table
        self.token = token
        try:
            self.sock = socket.create_server((host, port), backlog=512)
        except OSError as exc:
            why = (
                "the port is in use (another job's store? choose another port)"
                if exc.errno == errno.EADDRINUSE
                else (exc.strerror or str(exc))
            )
            raise CommError(f"store: cannot listen on {host}:{port}: {why}") from exc
        self.port: int = self.sock.getsockname()[1]
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.stopped = False
        self.thread = threading.Thread(target=self._accept, name="nccltree-store", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with self.lock:
                if self.stopped or len(self.conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self.conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="nccltree-store-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HELLO_TIMEOUT)
            op, key, value = _recv_frame(conn, MAX_HELLO)
            if op != _HELLO or key != _VERSION:
                conn.sendall(_frame(_ERR, value=b"not a client of this store's version"))
                return
            if self.token is not None and not hmac.compare_digest(value, self.token):
                conn.sendall(_frame(_ERR, value=b"wrong job token (NCCLTREE_STORE_TOKEN)"))
                return
            conn.sendall(_frame(_OK))
            conn.settimeout(None)  # a group's processes may be quiet for a long time
            while not self.stopped:
                op, key, value = _recv_frame(conn)
                conn.sendall(self._answer(op, key, value))
        except (OSError, ConnectionError, ValueError, struct.error):
            pass  # a client gone, or a malformed frame: drop the connection
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()

    def _answer(self, op: int, key: bytes, value: bytes) -> bytes:
        t = self.table
        try:
            key.decode()
            if op == _SET:
                t.set(key, value)
                return _frame(_OK)
            if op in (_GET, _WAIT, _MGET):
                (timeout,) = _F64.unpack_from(value)
                keys = [key] if op == _GET else _split_blob(value[_F64.size :])
                if not all(0 < len(k) <= MAX_KEY for k in keys):
                    raise ValueError("a bad key")
                if not t.wait(keys, min(max(timeout, 0.0), 86400.0)):
                    return _frame(_TIMEOUT)
                if op == _WAIT:
                    return _frame(_OK)
                got = t.values(keys)
                return _frame(_VALUE, value=got[0] if op == _GET else _keys_blob(got))
            if op == _ADD:
                (n,) = _I64.unpack(value)
                return _frame(_VALUE, value=_I64.pack(t.add(key, n)))
            if op == _CHECK:
                return _frame(_VALUE, value=b"1" if t.check(_split_blob(value)) else b"0")
            if op == _DELETE:
                return _frame(_VALUE, value=b"1" if t.delete(key) else b"0")
        except (ValueError, UnicodeDecodeError, struct.error, KeyError) as exc:
            return _frame(_ERR, value=f"malformed request ({exc})".encode()[:500])
        raise ValueError(f"unknown operation {op}")

    def close(self) -> None:
        self.stopped = True
        self.table.close()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (Linux)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.thread.join(timeout=2.0)


class TCPStore:
    """A key-value store over TCP (see the module docstring). ``is_server``: this
    process hosts it, listening on ``host``:``port`` (port 0: any free one; ``port``
    then says which); otherwise it connects to it, trying again until ``timeout``
    seconds have passed (the host may start later). ``token``: the job's secret (bytes
    or str); ``timeout``: the default bound of every wait. A client makes one request
    at a time (threads sharing it take turns, a blocking ``get`` included)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        is_server: bool,
        timeout: float,
        token: bytes | str | None = None,
    ) -> None:
        if not 0 <= int(port) < 65536:
            raise ValueError(f"store: port {port} is not a TCP port (0 to 65535)")
        if timeout <= 0:
            raise ValueError(f"store: timeout must be positive, not {timeout}")
        self.host = host
        self.timeout = float(timeout)
        self.token = token.encode() if isinstance(token, str) else token
        self.is_server = is_server
        self.hosts = is_server
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._table: _Table | None = None
        if is_server:
            self._table = _Table()
            self._server = _Server(host, int(port), self.token, self._table)
            self.port = self._server.port
        else:
            self.port = int(port)
            self._sock = self._connect()

    @property
    def where(self) -> str:
        return f"store at {self.host}:{self.port}"

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        delay = 0.01
        last = ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeout(
                    f"{self.where}: could not connect within {self.timeout:g} s ({last}); "
                    "is the address and port right, and did its host start?"
                )
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(left, 5.0))
            except OSError as exc:
                last = exc.strerror or str(exc)
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            break
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # the hello is bounded by the connect's own deadline
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.sendall(_frame(_HELLO, _VERSION, self.token or b""))
            op, _, value = _recv_frame(sock)
        except TimeoutError as exc:
            sock.close()
            raise CommTimeout(
                f"{self.where}: it accepted the connection but did not answer within "
                f"{self.timeout:g} s (not a nccltree store?)"
            ) from exc
        except (OSError, ConnectionError, ValueError, struct.error) as exc:
            sock.close()
            raise CommError(
                f"{self.where}: the connection failed during the hello ({exc}); "
                "not a nccltree store, or it refused this process"
            ) from exc
        if op == _ERR:
            sock.close()
            raise CommError(f"{self.where} refused this process: {value.decode(errors='replace')}")
        if op != _OK:
            sock.close()
            raise CommError(f"{self.where}: an unexpected answer to the hello ({op})")
        return sock

    def _request(self, op: int, key: bytes, value: bytes, wait: float, keys: list[str]) -> bytes:
        """Send one request, return the answer's value; bounded by ``wait`` + a margin."""
        with self._lock:
            sock = self._sock
            if sock is None:
                raise CommError(f"{self.where}: this client is closed")
            try:
                sock.settimeout(wait + _MARGIN)
                sock.sendall(_frame(op, key, value))
                aop, _, got = _recv_frame(sock)
            except TimeoutError as exc:
                self._drop()
                raise CommTimeout(
                    f"{self.where} did not answer within {wait + _MARGIN:g} s "
                    f"(a request for {keys!r:.200})"
                ) from exc
            except (OSError, ConnectionError, ValueError, struct.error) as exc:
                self._drop()
                raise PeerFailure(
                    f"lost the {self.where} ({exc}); its host (rank 0 or the launcher) ended?"
                ) from exc
        if aop == _TIMEOUT:
            raise _timeout_error(self.where, keys, wait)
        if aop == _ERR:
            raise CommError(f"{self.where}: {got.decode(errors='replace')}")
        return got

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _bound(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else float(timeout)
        if t < 0:
            raise ValueError(f"store: timeout must be >= 0, not {t}")
        return t

    def set(self, key: str, value: bytes) -> None:
        k, v = _check_key(key), _check_value(value)
        if self._table is not None:
            self._table.set(k, v)
        else:
            self._request(_SET, k, v, self.timeout, [key])

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting until it is set (``CommTimeout`` after
        ``timeout`` seconds, the store's by default)."""
        return self.multi_get([key], timeout)[0]

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, waiting until all are set (one round trip)."""
        raw = [_check_key(k) for k in keys]
        t = self._bound(timeout)
        if self._table is not None:
            if not self._table.wait(raw, t):
                raise _timeout_error(self.where, keys, t)
            return self._table.values(raw)
        if len(raw) == 1:
            return [self._request(_GET, raw[0], _F64.pack(t), t, keys)]
        return _split_blob(self._request(_MGET, b"", _F64.pack(t) + _keys_blob(raw), t, keys))

    def add(self, key: str, n: int) -> int:
        """Add ``n`` to the number under ``key`` (0 if unset); the new number."""
        k = _check_key(key)
        if self._table is not None:
            return self._table.add(k, int(n))
        return _I64.unpack(self._request(_ADD, k, _I64.pack(int(n)), self.timeout, [key]))[0]

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Until every key is set (``CommTimeout`` naming them after ``timeout``)."""
        raw = [_check_key(k) for k in keys]
        t = self._bound(timeout)
        if self._table is not None:
            if not self._table.wait(raw, t):
                raise _timeout_error(self.where, keys, t)
            return
        self._request(_WAIT, b"", _F64.pack(t) + _keys_blob(raw), t, keys)

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set, without waiting."""
        raw = [_check_key(k) for k in keys]
        if self._table is not None:
            return self._table.check(raw)
        return self._request(_CHECK, b"", _keys_blob(raw), self.timeout, keys) == b"1"

    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was set."""
        k = _check_key(key)
        if self._table is not None:
            return self._table.delete(k)
        return self._request(_DELETE, k, b"", self.timeout, [key]) == b"1"

    def close(self) -> None:
        """Disconnect (a client) or stop serving (the host: its clients' requests then
        fail with ``PeerFailure``)."""
        with self._lock:
            self._drop()
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> TCPStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_FILE_ADD_LOCK = threading.Lock()


class FileStore:
    """A key-value store in a directory every process sees (see the module
    docstring). ``owner``: this process removes the store's files at ``close``."""

    _POLL_MAX = 0.05

    def __init__(self, path: str, *, timeout: float, owner: bool = False) -> None:
        if timeout <= 0:
            raise ValueError(f"store: timeout must be positive, not {timeout}")
        self.path = os.path.abspath(path)
        self.timeout = float(timeout)
        self.owner = owner
        self.hosts = owner
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise CommError(f"store: cannot use the directory {self.path} ({exc})") from exc
        if not os.path.isdir(self.path):
            raise CommError(f"store: {self.path} is not a directory")

    @property
    def where(self) -> str:
        return f"file store {self.path}"

    def _file(self, key: str) -> str:
        raw = _check_key(key)
        name = urllib.parse.quote(key, safe="")
        if len(name) > 200:
            name = "h-" + hashlib.sha256(raw).hexdigest()
        return os.path.join(self.path, "k-" + name)

    def _write(self, path: str, value: bytes) -> None:
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, path)

    def set(self, key: str, value: bytes) -> None:
        self._write(self._file(key), _check_value(value))

    def _read(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _poll(self, paths: list[str], keys: list[str], timeout: float | None) -> list[bytes]:
        t = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + t
        delay = 0.001
        got: dict[str, bytes] = {}
        while True:
            for p in paths:
                if p not in got:
                    v = self._read(p)
                    if v is not None:
                        got[p] = v
            if len(got) == len(paths):
                return [got[p] for p in paths]
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k, p in zip(keys, paths) if p not in got]
                raise _timeout_error(self.where, missing, t)
            time.sleep(min(delay, left))
            delay = min(delay * 2, self._POLL_MAX)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._poll([self._file(key)], [key], timeout)[0]

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        return self._poll([self._file(k) for k in keys], list(keys), timeout)

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        self.multi_get(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return all(os.path.exists(self._file(k)) for k in keys)

    def add(self, key: str, n: int) -> int:
        path = self._file(key)
        # lockf excludes other processes, the module's lock this one's other threads
        with _FILE_ADD_LOCK:
            return self._add_locked(key, path, n)

    def _add_locked(self, key: str, path: str, n: int) -> int:
        fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            old = self._read(path) or b"0"
            try:
                now = int(old.decode()) + int(n)
            except ValueError as exc:
                raise ValueError(f"store: key {key!r} does not hold a number") from exc
            self._write(path, str(now).encode())
            return now
        finally:
            os.close(fd)  # drops the lock

    def delete(self, key: str) -> bool:
        try:
            os.unlink(self._file(key))
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """The owner removes the store's files (and the directory, once empty)."""
        if not self.owner:
            return
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            if name.startswith("k-") or name == "lock":
                try:
                    os.unlink(os.path.join(self.path, name))
                except OSError:
                    pass
        try:
            os.rmdir(self.path)
        except OSError:
            pass  # other files in it: not ours to remove

    def __enter__(self) -> FileStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
