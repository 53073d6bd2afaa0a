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
* ``141`` (``ExitStatus.BROKEN_PIPE``): stdout (or stderr) was closed before the command
  finished, as in ``nccltree-train ... | head -1``: the command stops quietly, with the
  status the shell reports for ``yes | head -1``'s ``yes`` (128 + SIGPIPE). Not ``0``: the
  work was cut short (a trainer stops at its next line, with no ``final.npz``), and a
  pipeline under ``set -o pipefail`` must not take that for a finished run.

In a job of several processes (``mpiexec -n P``, ``nccltree-run``, torchrun's variables,
an ``srun`` step: :func:`job_size`), a usage error is printed once per job, by the process
whose launcher rank is 0 (:func:`job_rank`, read from the launcher's variables without
starting anything); every process still exits with ``2``. ``nccltree-train`` first
agrees on its configuration across the processes, so that the first process also names
what the others found; ``nccltree-bench`` takes every process to have been given the same
command line. An error a process may have found alone (:attr:`UsageError.alone`) is
printed by that process.

``2`` is argparse's status for a bad flag, kept for every error of the same kind, so that a
script can tell "nothing ran, the command is wrong" (retry another way) from "the run
failed" (``1``) and from "the run computed something wrong" (``3``), which is worse than a
crash and must not look like one.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn, TextIO

from .._errors import NcclTreeError

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

    from ..backends.base import Device
    from ..comm.group.launch_env import LaunchEnv


class ExitStatus(enum.IntEnum):
    """The exit statuses of every nccltree command line (see the module's docstring)."""

    OK = 0
    FAILURE = 1
    USAGE = 2
    WRONG = 3
    INTERRUPTED = 130
    BROKEN_PIPE = 141
    # what a shell reports for a process SIGTERM ended: a job manager (Slurm, Kubernetes)
    # sees the termination it asked for, and a script can tell it from Ctrl-C
    TERMINATED = 143


EXIT_STATUS_EPILOG = (
    "Exit status: 0 success; 1 the run failed; 2 bad usage (nothing ran: a flag, or what it "
    "asks of this machine, is wrong); 3 wrong results (a benchmark's #wrong, a missed "
    "--target-accuracy); 130 interrupted (Ctrl-C); 141 the output was closed early "
    "(| head); 143 terminated (SIGTERM)."
)

# What a check of the flags, or a run, may raise: the library's bad-argument errors, its
# own error family (a missing backend, a failed rank), a path that cannot be used, an
# optional package that is not installed. Anything else is a bug and keeps its traceback.
ERRORS: tuple[type[Exception], ...] = (NcclTreeError, ValueError, TypeError, OSError, ImportError)


class UsageError(ValueError):
    """The command cannot run as given (exit status 2); the message says what is accepted.

    ``alone``: this process may be the only one of a job to have found it (its own
    environment, say), so it prints it even where it is not the job's first process."""

    alone = False


class RuntimeFailure(NcclTreeError):
    """The work failed on what it read, not on how it was asked (exit status 1), even
    inside :func:`checking`: a corrupt record is not a usage error."""


# -- jobs of several processes -----------------------------------------------------------------


def launched(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """What the launcher that started this process told it
    (:func:`nccltree.comm.group.launch_env.detect`: an MPI launcher's variables, then
    torchrun's ``RANK``/``WORLD_SIZE``, then an srun step's ``SLURM_STEP_NUM_TASKS`` with
    ``SLURM_PROCID``), or None for a process started on its own. A variable that is not
    a whole number is a :class:`UsageError` this process reports itself."""
    from ..comm.group.launch_env import detect

    try:
        return detect(os.environ if env is None else env)
    except ValueError as exc:
        error = UsageError(f"the launcher's environment: {exc}")
        error.alone = True
        raise error from None


def job_size(env: Mapping[str, str] | None = None) -> int:
    """The number of processes the launcher started this one among (1 when none did):
    ``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``, ``MV2_COMM_WORLD_SIZE`` or an srun step's
    size under ``PMIX_RANK`` (MPI), else ``WORLD_SIZE`` (torchrun, ``nccltree-run``),
    else ``SLURM_STEP_NUM_TASKS`` with ``SLURM_PROCID`` (``srun``), as
    :func:`launched`. Read from the environment: nothing is started."""
    seen = launched(env)
    return seen.size if seen is not None else 1


def job_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank among those the launcher started (``PMI_RANK``,
    ``OMPI_COMM_WORLD_RANK``, ``MV2_COMM_WORLD_RANK``, ``PMIX_RANK``; ``RANK``;
    ``SLURM_PROCID``, as :func:`launched`); 0 when none did. Read from the environment:
    no MPI is started."""
    seen = launched(env)
    return seen.rank if seen is not None and seen.rank is not None else 0


def over_mpi(env: Mapping[str, str] | None = None) -> bool:
    """Whether the process group of this job meets over MPI (``init_process_group`` with
    no ``init_method``): under an MPI launcher, or started alone where mpi4py imports
    (:func:`nccltree.comm.group.launch_env.default_method`)."""
    from ..comm.group.launch_env import default_method

    env = os.environ if env is None else env
    return default_method(env, launched(env)) == "mpi"


def job_processes(n: int, env: Mapping[str, str] | None = None) -> str:
    """``"N MPI processes"`` for a job over MPI, ``"N processes"`` otherwise (messages)."""
    return f"{n} {'MPI ' if over_mpi(env) else ''}processes"


def reports_usage(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints usage errors and help: always, except in a job of
    several processes, where the one of launcher rank 0 speaks for the job."""
    try:
        return job_size(env) <= 1 or job_rank(env) == 0
    except UsageError:  # its own environment: it says so itself
        return True


# -- the parser ------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` as every nccltree command line uses it: no abbreviated
    long flags (``--snapshot 500`` must not mean ``--snapshot-every 500``: to a Caffe user
    ``-snapshot FILE`` means resume) and the exit statuses as the epilog. Sub-commands made
    with ``add_subparsers().add_parser`` are of this class too, so they inherit both."""

    def __init__(
        self,
        prog: str | None = None,
        description: str | None = None,
        epilog: str | None = None,
        formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter,
        allow_abbrev: bool = False,
    ) -> None:
        super().__init__(
            prog=prog,
            description=description,
            epilog=EXIT_STATUS_EPILOG if epilog is None else epilog,
            formatter_class=formatter_class,
            allow_abbrev=allow_abbrev,
        )

    #: raise a :class:`UsageError` for a bad flag instead of printing it and exiting (a
    #: caller that decides who reports it: the processes of a job)
    raising = False

    def error(self, message: str) -> NoReturn:
        """argparse's usage error (the usage and ``PROG: error: MESSAGE``, status 2),
        printed by one process of a job (:func:`reports_usage`)."""
        if self.raising:
            raise UsageError(message)
        if not reports_usage():
            self.exit(ExitStatus.USAGE)
        super().error(message)

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        """``--help``, printed by one process of a job."""
        if reports_usage():
            super().print_help(file)


def make_parser(prog: str, description: str, epilog: str | None = None) -> Parser:
    """The top-level parser of a command line (see :class:`Parser`)."""
    return Parser(prog=prog, description=description, epilog=epilog)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``; argparse names the flag in the error
    (``argument -n/--iters: must be an integer >= 1, got '0'``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse's "invalid <name> value" wording
    return parse


@contextlib.contextmanager
def checking() -> Iterator[None]:
    """Inside, an error of the flags' check (or of the library rejecting what they ask)
    becomes a :class:`UsageError`: the work has not started."""
    try:
        yield
    except (UsageError, RuntimeFailure):
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
    return run_body(parser, name, lambda: body(args), show_usage=show_usage)


def run_body(
    parser: argparse.ArgumentParser, name: str, body: Callable[[], int], *, show_usage: bool
) -> int:
    """``body()``, turning what ends it into an exit status (as :func:`run_main`, for a
    command line that parses its flags itself)."""
    try:
        return body()
    except UsageError as exc:
        if exc.alone or reports_usage():  # once per job (see the module's docstring)
            if show_usage:
                parser.print_usage(sys.stderr)
            report_error(name, exc)
        return ExitStatus.USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return ExitStatus.INTERRUPTED
    except BrokenPipeError:
        # before ERRORS (an OSError): the reader is gone, there is nobody to tell
        silence_closed_streams()
        return ExitStatus.BROKEN_PIPE
    except ERRORS as exc:
        report_error(name, exc)
        return ExitStatus.FAILURE


def silence_closed_streams() -> None:
    """Point stdout and stderr at ``os.devnull`` where their reader has gone, so that
    flushing them again at exit raises no second ``BrokenPipeError`` (the recipe of
    Python's ``signal`` documentation, "Note on SIGPIPE"). A stream without a file
    descriptor (a test's capture) is left as it is."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            continue
        except (BrokenPipeError, ValueError):
            pass
        try:
            fd = stream.fileno()
        except (OSError, ValueError):
            continue
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


def error_text(exc: BaseException | str) -> str:
    """The message of ``exc`` for a person: an ``OSError`` as ``PATH: reason`` (no
    ``[Errno 20]``), anything else as ``str(exc)``."""
    if isinstance(exc, OSError) and exc.strerror:
        reason = exc.strerror[:1].lower() + exc.strerror[1:]
        return f"{exc.filename}: {reason}" if exc.filename is not None else reason
    return str(exc)


def report_error(prog: str, exc: BaseException | str, stream: TextIO | None = None) -> None:
    """``PROG: error: MESSAGE`` on stderr, the form argparse uses."""
    text = error_text(exc)
    print(f"{prog}: error: {text}", file=stream if stream is not None else sys.stderr, flush=True)


# -- output files ----------------------------------------------------------------------------


def check_output(flag: str, path: str) -> None:
    """Raise :class:`UsageError` unless ``path`` (the value of ``flag``) can be written:
    its directory exists and takes a new file, and ``path`` is not a directory. Checked
    before the work starts, so that an hour's sweep is not lost to a typo at its end."""
    where = f"{flag} {path}"
    if os.path.isdir(path):
        raise UsageError(f"{where}: is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{where}: {probe} is not a directory")
    if probe != parent:
        raise UsageError(f"{where}: the directory {parent} does not exist")
    try:  # the write that will happen: a new file beside the target (see write_output)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".nccltree-probe-"):
            pass
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied", path)
    except OSError as exc:
        raise UsageError(f"{where}: cannot be written ({error_text(exc)})") from None


@contextlib.contextmanager
def write_output(path: str, newline: str | None = None) -> Iterator[TextIO]:
    """A text file that replaces ``path`` when the block ends without an error (see
    :func:`output_path`): a reader sees the old file or the new one, never half of one."""
    with output_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline=newline) as f:
        yield f


@contextlib.contextmanager
def output_path(path: str) -> Iterator[str]:
    """A temporary name beside ``path`` (same extension, for writers that choose the format
    by it, as matplotlib does), renamed over ``path`` when the block ends without error; a
    killed or failed run leaves no truncated output and no temporary file."""
    fd, tmp = _temporary_beside(path)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _temporary_beside(path: str) -> tuple[int, str]:
    parent, name = os.path.split(os.path.abspath(path))
    return tempfile.mkstemp(prefix=f".{name}.tmp-", suffix=os.path.splitext(name)[1], dir=parent)


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


def approx_bytes(n: float) -> str:
    """``512 B``, ``3.5 KiB``, ``18.3 GiB``, ``2.0 TiB``: a size for a person, rounded."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{int(n)} B"


def human_bytes(n: int) -> str:
    """``8 B``, ``64 KiB``, ``64 MiB``: exact binary units where they fit."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
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
