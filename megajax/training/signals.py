"""SIGTERM and Ctrl-C during a training run."""
from __future__ import annotations

import signal
import sys

from megajax.errors import UserError


class SampleStopped(Exception):
    """A signal while the finished run writes its sample: nothing is at stake any more."""


class StopRequested:
    """SIGTERM or Ctrl-C. During start-up (reading data, compiling) nothing is at stake: stop at
    once with one line. Once training (`training = True`): finish the current step, save, and
    exit cleanly; further signals while that happens are noted, not obeyed, since interrupting
    the save would lose the very checkpoint they ask for (SIGKILL still ends it at once). Once
    the run is saved and writes its sample (`sampling = True`, one process): stop the sample."""

    def __init__(self):
        self.requested = None
        self.training = False
        self.sampling = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some notebooks)
                pass
        return self

    def _handle(self, signum, frame):
        if self.sampling:
            raise SampleStopped(signal.Signals(signum).name)
        if not self.training:
            raise UserError(f"{signal.Signals(signum).name} during start-up: stopped before training any step")
        if self.requested is not None:
            print(f"{signal.Signals(signum).name}: already stopping; the checkpoint is being written",
                  file=sys.stderr, flush=True)
            return
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
