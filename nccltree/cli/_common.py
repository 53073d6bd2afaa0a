"""What the three command lines share: exit statuses, error reporting, the progress line,
the host-runtime guard and the formatting of sizes and Markdown tables.

Exit statuses (every ``--help`` epilog prints :data:`EXIT_STATUS_EPILOG`):

* ``0`` (``ExitStatus.OK``): success.
* ``1`` (``ExitStatus.FAILURE``): the work started and failed -- a rank raised, a collective
  timed out, a file or database could not be read or written.
* ``2`` (``ExitStatus.USAGE``): the command cannot run as given, found before any work starts
  -- argparse's own errors and every check of the flags against the library and this
  machine (a bad value, an unknown device, a backend or optional package this machine
  lacks, a path that does not exist, a batch that does not split across the ranks).
  Nothing ran: change the command and run it again.
* ``3`` (``ExitStatus.WRONG``): the work finished but its results fail their check -- a
  benchmark's ``#wrong`` column is not zero, the held-out accuracy is below
  ``--target-accuracy``.
* ``130`` (``ExitStatus.INTERRUPTED``): interrupted by Ctrl-C (SIGINT), 128 + 2 as the shell
  reports a process killed by that signal.

``2`` is argparse's status for a bad flag, kept for every error of the same kind, so that a
script can tell "nothing ran, the command is wrong" (retry another way) from "the run
failed" (``1``) and from "the run computed something wrong" (``3``), which is worse than a
crash and must not look like one.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

from .._errors import NcclTreeError

if TYPE_CHECKING:
    from ..backends.base import Device


class ExitStatus(enum.IntEnum):
    """The exit statuses of every nccltree command line (see the module's docstring)."""

    OK = 0
    FAILURE = 1
    USAGE = 2
    WRONG = 3
    INTERRUPTED = 130


EXIT_STATUS_EPILOG = (
    "Exit status: 0 success; 1 the run failed; 2 bad usage (nothing ran: a flag, or what it "
    "asks of this machine, is wrong); 3 wrong results (a benchmark's #wrong, a missed "
    "--target-accuracy); 130 interrupted (Ctrl-C)."
)

# What a check of the flags, or a run, may raise: the library's bad-argument errors, its
# own error family (a missing backend, a failed rank), a path that cannot be used, an
# optional package that is not installed. Anything else is a bug and keeps its traceback.
ERRORS: tuple[type[Exception], ...] = (NcclTreeError, ValueError, TypeError, OSError, ImportError)


class UsageError(ValueError):
    """The command cannot run as given (exit status 2); the message says what is accepted."""


@contextlib.contextmanager
def checking() -> Iterator[None]:
    """Inside, an error of the flags' check (or of the library rejecting what they ask)
    becomes a :class:`UsageError`: the work has not started."""
    try:
        yield
    except UsageError:
        raise
    except ERRORS as exc:
        raise UsageError(str(exc)) from exc


def run_main(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    body: Callable[[argparse.Namespace], int],
    *,
    prog: Callable[[argparse.Namespace], str] | None = None,
    show_usage: bool = False,
) -> int:
    """Parse ``argv`` and run ``body(args)``, turning what ends it into an exit status.

    ``prog(args)`` names the command in error messages (default: the parser's prog);
    ``show_usage`` prints the usage line before a usage error, as argparse does.
    """
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0), or a flag argparse itself rejects (2)
        code = exc.code
        return (
            code if isinstance(code, int) else ExitStatus.OK if code is None else ExitStatus.USAGE
        )
    name = prog(args) if prog is not None else parser.prog
    try:
        return body(args)
    except UsageError as exc:
        if show_usage:
            parser.print_usage(sys.stderr)
        report_error(name, exc)
        return ExitStatus.USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return ExitStatus.INTERRUPTED
    except ERRORS as exc:
        report_error(name, exc)
        return ExitStatus.FAILURE


def report_error(prog: str, exc: BaseException | str, stream: TextIO | None = None) -> None:
    """``PROG: error: MESSAGE`` on stderr, the form argparse uses."""
    print(f"{prog}: error: {exc}", file=stream if stream is not None else sys.stderr, flush=True)


# -- the host runtime ------------------------------------------------------------------------


def release_devices(devices: Sequence[Device]) -> None:
    """Stop the host runtime's worker threads (virtual CPU devices made from a spec own
    them); CUDA devices hold nothing to release."""
    if devices and devices[0].backend == "host":
        devices[0].runtime.shutdown()


@contextlib.contextmanager
def open_devices(spec: str) -> Iterator[list[Device]]:
    """``nccltree.devices(spec)``, released again when the block ends however it ends."""
    from ..backends import devices as make_devices

    devs = make_devices(spec)
    try:
        yield devs
    finally:
        release_devices(devs)


# -- the progress line -----------------------------------------------------------------------


class Progress:
    """A status line on a stream (stderr): redrawn in place on a terminal (at most every
    ``redraw_s`` seconds, always for the last one), printed as a line of its own elsewhere
    when the caller says it is worth a line; messages print without breaking it; nothing
    at all when ``quiet``."""

    def __init__(self, stream: TextIO, quiet: bool, redraw_s: float = 0.0) -> None:
        self.stream, self.quiet, self.redraw_s = stream, quiet, redraw_s
        self.tty = stream.isatty()
        self._open = False
        self._last_draw = -float("inf")

    def show(self, line: str, *, log: bool, last: bool = False) -> None:
        """Draw ``line``; ``log``: worth a line of its own when the stream is no terminal;
        ``last``: the final state (drawn at once and the line ended)."""
        if self.quiet:
            return
        if self.tty:
            now = time.monotonic()
            if last or now - self._last_draw >= self.redraw_s:
                self.stream.write("\r\x1b[2K" + line)
                self.stream.flush()
                self._open, self._last_draw = True, now
            if last:
                self.finish()
        elif log or last:
            print(line, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line of its own (an evaluation, a table row's note), above the status line."""
        if self.quiet:
            return
        self.clear()
        print(text, file=self.stream, flush=True)

    def clear(self) -> None:
        """Erase the status line (a terminal), so that other output starts on a clean line."""
        if self._open:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._open = False

    def finish(self) -> None:
        """End the status line where it stands (a terminal), keeping it on screen."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


# -- formatting ------------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    """``8 B``, ``64 KiB``, ``64 MiB``: exact binary units where they fit."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None
) -> list[str]:
    """A Markdown table's lines; ``align`` has an ``l`` or ``r`` per column (default: the
    first column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header):
        raise ValueError(f"align has {len(align)} letters for {len(header)} columns")
    sep = ["---:" if a == "r" else ":---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out
