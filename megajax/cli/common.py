"""What the command lines share: simulated devices, one-line errors, multi-process flags.

Nothing here imports jax at module level: the programs import it only after their arguments
are read, because --host-devices must be in XLA_FLAGS before JAX starts its CPU backend.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading

from megajax.errors import UserError, exit_now, first_line, os_error_code
from megajax.host.env import open_standard_streams, restart_with_malloc_tuning
from megajax.host.signals import STOP_SIGNALS
from megajax.specs import split_kind

# each simulated device holds host memory and threads: 100,000 exhausted 24 GiB
MAX_HOST_DEVICES = 4096


def set_host_devices(n: int | None):
    """--host-devices N: XLA's CPU backend simulates N devices (before jax is imported)."""
    if n is not None and not 1 <= n <= MAX_HOST_DEVICES:
        sys.exit(fail(f"--host-devices must be in 1..{MAX_HOST_DEVICES}, got {n}"))
    if n:
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def program_devices(host_devices: int | None) -> list | None:
    """The devices a program's mesh spans: None (all of them), or with --host-devices N in one
    process whose jax had already started with more (a notebook or a test calling `train_main`,
    where XLA_FLAGS comes too late), the first N, as a process of its own would have them."""
    jax = sys.modules.get("jax")
    if not host_devices or jax is None or process_count() > 1:
        return None
    return jax.devices()[:host_devices]


class Parser(argparse.ArgumentParser):
    """argparse with a mistake as the one `error:` line every megajax program ends with (not
    argparse's usage block before it); --help still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def given(text: str) -> str:
    """An argparse type for a path or spec: an empty one (a shell variable that was not set)
    is refused, rather than read as the current directory or the default. A `~` the shell
    left alone (`--workdir=~/run`, a quoted "~/run", `text:~/a.txt,~/b.txt`) is the home
    directory, as it is to the shell, not a folder named `~` in the current one."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    prefix, paths = spec_paths(text)
    return prefix + ",".join(os.path.expanduser(p) for p in paths)


def spec_paths(text: str) -> tuple[str, list[str]]:
    """A path argument's KIND: prefix, if any (`text:`, `bin:`, `hf:`), and its comma-separated
    paths."""
    kind, paths = split_kind(text)
    return (f"{kind}:" if kind else ""), paths.split(",")


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def lost_peer(e: Exception):
    """In a multi-process run, a failed collective or barrier almost always means another
    process died: say so in one line and leave at once, without JAX's shutdown barrier
    (which would wait for the dead peer). Checkpoints already finalised stay valid."""
    if (count := process_count()) > 1:
        jax = sys.modules["jax"]
        exit_now(
            f"error: process {jax.process_index()} of {count}: {type(e).__name__}: "
            f"{first_line(e, 300)} (another process has probably died; completed checkpoints are "
            "intact)",
            1,
        )


def process_count() -> int:
    """How many processes run this program: 1 unless JAX was started, and with a backend."""
    jax = sys.modules.get("jax")  # a program that never started JAX has no peers
    try:
        return 1 if jax is None else jax.process_count()
    except (RuntimeError, AssertionError):  # no backend (start_jax's case)
        return 1


# What the machine's file systems, not megajax, make an OS call fail with: a full disk or quota,
# a read-only, lost or unreadable file system, a path someone changed while the program ran.
FILE_SYSTEM_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EFBIG,
        errno.EROFS,
        errno.EIO,
        errno.EACCES,
        errno.EPERM,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENAMETOOLONG,
        errno.ESTALE,
    }
)


# what Python says when the operating system refuses a thread (its stack needs address space:
# `ulimit -v`; or the threads limit, `ulimit -u`)
NO_THREAD = "can't start new thread"

# what XLA:CPU says of a program over more simulated devices than one process runs (it takes the
# devices past 2048 for other processes')
SIMULATED_TOO_MANY = "Multiprocess computations aren't implemented on the CPU backend"


def failed(e: Exception, memory_hint: str) -> int:
    """A program's exit status for an exception nothing below handled. Running out of host memory
    (MemoryError) or a device's (XLA's RESOURCE_EXHAUSTED), which the user fixes with
    `memory_hint`, a file system failing (FILE_SYSTEM_ERRNOS) and a dead peer (lost_peer) are
    one line; anything else is a bug: raised."""
    device = isinstance(e, RuntimeError) and str(e).startswith("RESOURCE_EXHAUSTED")
    if device or isinstance(e, MemoryError):
        status = fail(
            f"out of {'device' if device else 'host'} memory ({first_line(e, 200)}): {memory_hint}"
        )
    elif isinstance(e, RuntimeError) and NO_THREAD in str(e):
        status = fail(
            "out of host memory (the system refused a thread: its address space or threads are "
            f"limited, `ulimit -v` / `ulimit -u`): raise the limit, or {memory_hint}"
        )
    elif SIMULATED_TOO_MANY in str(e) and process_count() == 1:
        status = fail(
            "XLA's CPU backend compiles no program over this many simulated devices in one "
            "process (more than 2048 here): simulate fewer with --host-devices, e.g. one data "
            "replica of the mesh (data=1: the same memory per device)"
        )
    elif (code := os_error_code(e)) in FILE_SYSTEM_ERRNOS:
        where = (
            f": {e.filename}"
            if getattr(e, "filename", None)
            else ""
            if isinstance(e, OSError)
            else f" ({type(e).__name__}: {first_line(e, 160)})"
        )
        status = fail(f"{os.strerror(code)}{where} (what was saved before is intact)")
    else:
        lost_peer(e)
        raise e
    # as in lost_peer: the peers' shutdown barrier would wait for processes still stepping
    if process_count() > 1:
        sys.stderr.flush()
        os._exit(status)
    return status


# a program's interpreter shutdown takes well under a second when nothing is stuck
EXIT_GRACE_S = 30.0


def end(status: int):
    """A program's end once its status is decided, bounded: the interpreter's shutdown joins every
    thread still running, and a background writer that never finishes (orbax's, waiting for a
    thread that could not start) would hold the process forever after its error line. A
    daemon timer leaves with `status` if the shutdown takes longer than EXIT_GRACE_S (the
    environment's MEGAJAX_EXIT_GRACE_S). A multi-process run is bounded by bound_shutdown."""
    if process_count() == 1:
        grace = float(os.environ.get("MEGAJAX_EXIT_GRACE_S", EXIT_GRACE_S))
        line = (
            f"warning: background threads did not end within {grace:g} s of the program's end (a "
            f"checkpoint writer that cannot finish); leaving with status {status}"
        )
        timer = threading.Timer(grace, exit_now, (line, status))
        timer.daemon = True
        timer.start()
    sys.exit(status)


def bound_shutdown(status: int) -> int:
    """A multi-process run's exit, bounded (host/distributed.py: bound_shutdown); `status`."""
    if (distributed := sys.modules.get("megajax.host.distributed")) is not None:
        distributed.bound_shutdown(status)
    return status


def add_distributed_args(p):
    g = p.add_argument_group(
        "multi-process (jax.distributed; on SLURM/Open MPI/... detected automatically)"
    )
    g.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    g.add_argument("--num-processes", type=int, help="how many processes the run has in all")
    g.add_argument("--process-id", type=int, help="this process's number, 0 .. N-1")
    g.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=60,
        help="seconds after which a silent peer counts as dead (default 60)",
    )


def start_jax(args=None):
    """JAX's multi-process runtime where `args` ask for it (or a cluster launcher is detected),
    then its backend. A backend that does not start is the machine's setup, not a bug: one
    line. (JAX_PLATFORMS=cuda with a jax built without CUDA raises a bare AssertionError.)"""
    if args is not None:
        from megajax.host.distributed import initialize  # imports jax: after set_host_devices

        initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)
    import jax

    if jax.config.jax_disable_jit:
        raise UserError(
            "JAX_DISABLE_JIT is set: megajax compiles its steps ahead of time and cannot run them "
            "uncompiled; unset it (to step through a model eagerly, call it from Python under "
            "jax.disable_jit())"
        )
    # The programs compute in the dtypes their configs name; JAX_ENABLE_X64 (from a notebook's or
    # a cluster's environment) would move some host-side means to float64 and change last digits.
    jax.config.update("jax_enable_x64", False)
    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:
        asked = os.environ.get("JAX_PLATFORMS", "").strip()
        why = first_line(e, 300) if str(e).strip() else f"this jax has no {asked or 'such'} backend"
        raise UserError(
            f"jax could not start its backend{f' (JAX_PLATFORMS={asked})' if asked else ''}: "
            f"{why}. Install the jax built for this machine (NVIDIA GPUs: the jax[cuda] extra), or "
            "unset JAX_PLATFORMS to use what it has"
        ) from None


class Stopped(BaseException):  # not an Exception: nothing on the way may swallow it
    pass


def stop_with_a_line(message: str):
    """A tool's stop signals (SIGTERM, SIGINT, SIGHUP, a scheduler's warnings: host/signals.py)
    raise Stopped("SIGNAL: message"), which its main prints as one line (`stopped`) instead of a
    traceback; what it writes is atomic, so nothing is half done."""

    def handler(signum, frame):
        raise Stopped(f"{signal.Signals(signum).name}: {message}", signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def exit_on_signal(message, status=lambda signum: 128 + signum):
    """For a program with nothing to save when stopped (eval.py, whose result appears whole at
    the end or not at all; megajax-convert, whose output appears in one rename; train.py before
    training starts): the stop signals print one line and end the process at once
    (errors.exit_now says why not by raising). `message` is a str.format template of {signal},
    or a function of the signal's name that returns the line (and may clean up first)."""

    def handler(signum, frame):
        name = signal.Signals(signum).name
        exit_now(
            message(name) if callable(message) else message.format(signal=name), status(signum)
        )

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def stopped(e: "Stopped") -> int:
    print(f"stopped by {e.args[0]}", file=sys.stderr, flush=True)
    return 128 + (e.args[1] if len(e.args) > 1 else signal.SIGINT)


def stop_during_startup(signum, frame):
    """train.py's handler until train() takes the signals over (megajax/host/signals.py):
    nothing is written before training starts, so leave at once (see exit_on_signal)."""
    exit_now(
        f"error: {signal.Signals(signum).name} during start-up: stopped before training any step", 2
    )


def guard_stdout(on_close=None, to_stderr: bool = False):
    """A reader that goes away (`train.py | head`, `megajax-plan | less` quit early) closes the
    pipe under stdout (or stderr: `2>&1 | head`), and the next write anywhere raises
    BrokenPipeError; a closed terminal (SSH gone) makes it raise EIO. From then on stdout goes to
    stderr (`to_stderr`: a run's last lines, where it says it stopped and saved) or, as stderr
    does, to /dev/null (Python's own recipe: then not even the flush at exit fails), and `on_close`
    is called once (train.py: stop as on SIGTERM, saving a checkpoint)."""
    open_standard_streams()
    for stream in (sys.stdout, sys.stderr):
        # A terminal or PYTHONIOENCODING that cannot encode a character (a sample's U+FFFD, a
        # path's accent, under an ASCII or Latin-1 locale) prints it escaped instead of failing.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    if not isinstance(sys.stderr, _PipeGuard):
        sys.stderr = _PipeGuard(sys.stderr, None, to_stderr=False, name="standard error")
    if not isinstance(sys.stdout, _PipeGuard):
        sys.stdout = _PipeGuard(sys.stdout, on_close, to_stderr, name="standard output")


class _PipeGuard:
    def __init__(self, stream, on_close, to_stderr: bool, name: str):
        self._stream, self._on_close, self._name = stream, on_close, name
        self._targets = ["stderr", "devnull"] if to_stderr else ["devnull"]
        self._closed = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._reader_gone(e)
            return self.write(text)  # to the new target (once on /dev/null, a write cannot fail)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            self._reader_gone(e)
            self.flush()

    def _reader_gone(self, e: OSError):
        if e.errno not in (errno.EPIPE, errno.EIO):  # a closed pipe; a closed terminal (EIO)
            # a full disk: failed() names what it could not write
            raise OSError(e.errno, e.strerror, self._name) from e
        target = self._targets.pop(0)
        fd = sys.stderr.fileno() if target == "stderr" else os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, self._stream.fileno())
        if target == "devnull":
            os.close(fd)
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                self._on_close()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def command(main, restart: bool = True):
    """A program's entry point: first restart with the host settings of megajax/host/env.py
    (`restart`), then `main`, then a bounded `end`."""

    def run() -> int:
        if restart:
            restart_with_malloc_tuning()
        end(main())

    return run
