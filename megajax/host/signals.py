"""SIGTERM and Ctrl-C during a training run."""

from __future__ import annotations

import signal
import sys

from megajax.errors import UserError, exit_now


def _stop_signals() -> tuple:
    """A scheduler's SIGTERM and Ctrl-C; and (POSIX) the hang-up of a closed terminal or SSH
    session and the warnings batch schedulers send before a limit ends a job: SLURM's
    `--signal=USR1@120` (any signal it is told), Grid Engine's `-notify` (SIGUSR2), a CPU-time
    limit's SIGXCPU (LSF's CPULIMIT). Their default action ends the run unsaved; each is taken
    only while it has that default: one the program was started to ignore (nohup) or that
    something else handles is left as it is."""
    optional = (getattr(signal, name, None) for name in ("SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU"))
    return (signal.SIGTERM, signal.SIGINT) + tuple(
        sig for sig in optional if sig is not None and signal.getsignal(sig) is signal.SIG_DFL
    )


STOP_SIGNALS = _stop_signals()  # what every megajax program answers with a stop


class StopRequested:
    """SIGTERM or Ctrl-C. During start-up (reading data, compiling) nothing is at stake: stop at
    once with one line. Once training (`training = True`): finish the current step, save, and
    exit cleanly; further signals while that happens are noted, not obeyed, since interrupting
    the save would lose the very checkpoint they ask for (SIGKILL still ends it at once). Once
    the run is saved and writes its sample (`sampling = True`, one process): stop the sample,
    which reads `requested` between tokens.

    Python may run a handler inside a weakref callback or a finaliser, which swallows what it
    raises ("Exception ignored in ..."): so the handler always records the signal, and
    `start_training` stops a start-up whose exception was swallowed."""

    def __init__(self):
        self.requested = None
        self.training = False
        self.sampling = False
        self._old = {}

    def __enter__(self):
        _ACTIVE.append(self)
        for sig in STOP_SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some notebooks)
                pass
        return self

    def _handle(self, signum, frame):
        self.request(signal.Signals(signum).name)

    # Set by train.py. A command line has nothing at stake before training starts, so a signal
    # then ends the process at once with its line, unwinding nothing (errors.exit_now says why:
    # an exception raised here was swallowed, with "Exception ignored" on stderr, in CI); after
    # train() returns, one only says that the run is ending. train() in a notebook raises
    # instead, and leaves the handlers as it found them.
    command_line = False

    def request(self, name: str):
        if not self.training:
            self.requested = self.requested or name
            if self.command_line:
                exit_now(f"error: {self._startup_stopped()}", 2)
            raise self._startup_stopped()
        if self.requested is not None and not self.sampling:
            print(
                f"{name}: already stopping; the checkpoint is being written",
                file=sys.stderr,
                flush=True,
            )
            return
        self.requested = self.requested or name

    def sample_stopped(self) -> bool:
        return self.sampling and self.requested is not None

    def _startup_stopped(self) -> UserError:
        return UserError(f"{self.requested} during start-up: stopped before training any step")

    def start_training(self):
        if self.requested is not None:  # its exception was swallowed (see above)
            raise self._startup_stopped()
        self.training = True

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        for sig, old in self._old.items():
            # The command line's handler before train() was its start-up one, which ends the
            # process as "stopped before training any step": after train() the run is ending.
            signal.signal(sig, _already_ending if self.command_line else old)


def _already_ending(signum, frame):
    print(f"{signal.Signals(signum).name}: the run is already ending", file=sys.stderr, flush=True)


_ACTIVE: list[StopRequested] = []

# A closed stdout (`train.py | head`: cli.common.guard_stdout) stops a run as SIGTERM does. It
# goes by the name of the signal a writer to a closed pipe gets (Python ignores that signal:
# the write raises instead), since handling the signal itself would also stop a run for a
# pipe of some library's that closed.
STDOUT_CLOSED = "SIGPIPE"


def stdout_closed():
    """Stop the training run under way, if any, as SIGTERM would."""
    if _ACTIVE:
        _ACTIVE[-1].request(STDOUT_CLOSED)
