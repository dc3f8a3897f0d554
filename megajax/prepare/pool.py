"""The pool of processes megajax-prepare tokenizes with, for every kind of corpus (text, chat,
BERT sentence pairs).

A process pool has two ways to hang: a worker whose start fails (multiprocessing.Pool starts
it again, for ever) and a worker that dies mid-task (its task's result never comes). Here a
start failure is kept by the worker and raised by each task it is given, so the run ends with
that error; a worker that dies breaks the pool (concurrent.futures), which ends the run with one
line. Either way the finished units are on disk and a rerun resumes from them.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from megajax.errors import UserError
from megajax.host.signals import STOP_SIGNALS

_START_FAILURE: list[str] = []


class WorkerStartFailed(UserError):
    pass


def _start(initializer: Callable, *args):
    """Ctrl-C reaches the whole process group: the main process alone answers it (and ends the
    pool, with SIGTERM); a worker just stops, without the main process's handlers (a fork
    inherits them) or a traceback that would only repeat the main process's one line."""
    for sig in STOP_SIGNALS:  # a closed terminal's SIGHUP, too, reaches the whole group
        signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.SIG_IGN)
    try:
        initializer(*args)
    except Exception as e:  # noqa: BLE001  (raised again, by each task: _call)
        _START_FAILURE.append(str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}")


def _call(fn: Callable, job):
    if _START_FAILURE:
        raise WorkerStartFailed(f"a tokenizing process could not start: {_START_FAILURE[0]}")
    return fn(job)


class WorkerPool:
    """`workers` processes, each started with `initializer(*args)`; `imap_unordered` and `map`
    as multiprocessing.Pool's. A context manager: leaving it ends the processes."""

    def __init__(self, workers: int, initializer: Callable, args: tuple):
        # fork is the cheapest start (megajax-prepare itself never imports jax); after JAX has
        # started its threads (a notebook, a test) a fork could inherit a held lock: forkserver.
        context = multiprocessing.get_context("forkserver" if "jax" in sys.modules else "fork")
        self._executor = ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start, initargs=(initializer, *args)
        )

    def imap_unordered(self, fn: Callable, jobs: Iterable) -> Iterator:
        futures = {self._executor.submit(_call, fn, job) for job in jobs}
        try:
            while futures:
                done, futures = wait(futures, return_when=FIRST_EXCEPTION)
                for future in done:
                    yield future.result()
        except BrokenProcessPool:
            raise UserError(
                "a tokenizing process ended without its result (killed, or out of memory?); the "
                "finished units are kept: run the same command again to go on"
            ) from None

    def map(self, fn: Callable, jobs: Iterable) -> list:
        jobs = list(jobs)
        results = dict(self.imap_unordered(_indexed, [(fn, i, job) for i, job in enumerate(jobs)]))
        return [results[i] for i in range(len(jobs))]

    def close(self):
        """Ends the processes now, whatever they are doing (their unfinished units are redone by
        the next run; a finished one is written atomically)."""
        for process in list(getattr(self._executor, "_processes", {}).values()):
            process.terminate()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _indexed(job):
    fn, i, inner = job
    return i, fn(inner)
