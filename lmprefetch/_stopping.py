"""How the ``lmprefetch`` command stops on SIGINT and SIGTERM, whenever they come.

A user stops a command with Ctrl-C (SIGINT to the terminal's whole process group), with
``kill`` (SIGTERM or SIGINT to one process), or with ``timeout`` or a supervisor (SIGTERM to the
group).  Each way must end the command promptly, with one line, leaving no temporary file and
no child process behind.  The command (:func:`lmprefetch.cli.main`) runs inside
:func:`handling`, and the code that makes temporary files or child processes follows four
rules:

* **The first signal raises** :class:`Stopped` (a ``KeyboardInterrupt``, so every ``finally``
  and context manager on the way runs) in the main thread, wherever it is; later signals are
  only counted: the unwinding, which is bounded (children are killed, not awaited), is never
  cut short half-way through removing a directory.  Only a signal that comes
  :data:`PATIENCE_S` after the first one, when the unwinding should long be over, ends the
  process at once (``os._exit``): something hangs, and the user insists.
* **Acquire with** :func:`enter` (or :func:`temporary_directory`): a signal that arrives while
  a resource is made takes effect once the resource is in the hands of the code that releases
  it; :func:`deferred` keeps a signal from cutting a short step in two.  Waits that must end
  early on a signal watch :func:`wakeup_fd`.
* **Start children inside** :func:`spawning`: they start with SIGINT and SIGTERM blocked
  (a signal mask is inherited across ``fork`` and ``exec``), so that a Ctrl-C while one is
  still importing cannot print its traceback; their entry point calls :func:`child_signals`,
  which ignores SIGINT (the parent stops its children; the terminal's Ctrl-C reached them too)
  and lets SIGTERM end them.
* **Run Trio through** :func:`run_trio`: there a signal cancels the run (Trio's ordinary,
  cancellation-safe way out) instead of being raised at an arbitrary point of Trio's loop.

Outside :func:`handling` (the package used as a library, or in a test) nothing here changes
how a signal is handled: :func:`deferred` and :func:`run_trio` then only do their work.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

__all__ = [
    "Stopped",
    "checkpoint",
    "child_signals",
    "deferred",
    "end_at_once_on_repeat",
    "enter",
    "handling",
    "received",
    "resource_tracker_stopped_at_exit",
    "run_trio",
    "spawning",
    "temporary_directory",
    "wakeup_fd",
]

_T = TypeVar("_T")

#: The signals that stop the command.
SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Seconds after the first signal from which another one ends the process at once.
PATIENCE_S = 5.0


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the command (raised once, in the main thread)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def what(self) -> str:
        """``"interrupted"`` (SIGINT) or ``"terminated"`` (SIGTERM)."""
        return describe(self.signum)


def describe(signum: int) -> str:
    """``"interrupted"`` for SIGINT, ``"terminated"`` for any other signal."""
    return "interrupted" if signum == signal.SIGINT else "terminated"


class _State:
    """The command's signal state (there is one command per process)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.installed = False
        #: The first stop signal, once it came.
        self.received: int | None = None
        #: Whether :class:`Stopped` was raised for it already.
        self.raised = False
        #: When the first signal came (``time.monotonic()``).
        self.received_at = 0.0
        #: Nesting depth of :func:`deferred` blocks.
        self.deferring = 0
        #: Seconds after the first signal from which another one ends the process at once.
        self.patience_s = PATIENCE_S
        #: The pipe a signal writes one byte to (see :func:`wakeup_fd`).
        self.wake_r = -1
        self.wake_w = -1


_state = _State()


def _on_signal(signum: int, _frame: object) -> None:
    state = _state
    if state.received is not None:  # stopping already: the unwinding is bounded, let it end
        if time.monotonic() - state.received_at >= state.patience_s:
            os._exit(128 + signum)
        return
    state.received, state.received_at = signum, time.monotonic()
    if state.wake_w >= 0:
        with contextlib.suppress(OSError):  # full: a byte is there already
            os.write(state.wake_w, b"\0")
    if not state.deferring:
        state.raised = True
        raise Stopped(signum)


@contextlib.contextmanager
def handling(*, restore: bool = True) -> Iterator[None]:
    """SIGINT and SIGTERM stop the command (see the module docstring) while the block runs.

    Installed only in the main thread (elsewhere Python cannot), also for a signal this
    process was started with ignored.  A signal can come while the handlers are being
    installed or put back: a caller catches :class:`Stopped` around the ``with`` statement,
    not only inside it.

    Args:
        restore: at the end, put the previous handlers back (the command called as a
            function); ``False``: ignore both signals from then on (the process is about to
            exit, its clean-up done: a signal now must not print a traceback).
    """
    if threading.current_thread() is not threading.main_thread() or _state.installed:
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    previous_hook = sys.unraisablehook

    def unraisable(info: Any) -> None:
        # A Stopped raised where it cannot propagate (see checkpoint): no "Exception ignored"
        # traceback, and the next check point raises it again.
        if isinstance(info.exc_value, Stopped):
            _state.raised = False
            return
        previous_hook(info)

    _state.reset()
    _state.wake_r, _state.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    _state.installed = True
    try:
        for sig in SIGNALS:
            # Even one this process was started with ignored: a shell script's background job
            # inherits SIGINT ignored, and `kill -INT` is still a way to stop the command.
            signal.signal(sig, _on_signal)
        sys.unraisablehook = unraisable
        yield
    finally:
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler if restore else signal.SIG_IGN)
        os.close(_state.wake_r)
        os.close(_state.wake_w)
        _state.wake_r = _state.wake_w = -1
        _state.installed = False


def end_at_once_on_repeat() -> None:
    """From now on a second signal ends the process at once: for a command that makes no
    temporary files, whose unwinding may wait on something slow (a worker's start-up)."""
    _state.patience_s = 0.0


def received() -> int | None:
    """The stop signal received so far (its number), or ``None``."""
    return _state.received


def wakeup_fd() -> int | None:
    """A file descriptor that becomes readable when a stop signal arrives (and stays so), for
    waits that must end early on one (``multiprocessing.connection.wait``, ``select``);
    ``None`` outside :func:`handling`."""
    return _state.wake_r if _state.installed else None


def checkpoint() -> None:
    """Raise :class:`Stopped` if a stop signal came, even if it was raised once already.

    For the points where a command starts its work (its imports done, its arguments read) and
    where a Trio run ends: reaching one with a signal received means its :class:`Stopped` was
    lost.  Python drops an exception raised where it cannot propagate, with an "Exception
    ignored in ..." line: a signal handled while the import system runs a weakref callback, or
    while a ``__del__`` runs, raises into nothing, and the command would go on as if no signal
    had come.  Inside a :func:`deferred` block it waits for the block's end, as a signal does.
    """
    state = _state
    if state.received is not None and not state.deferring:
        state.raised = True
        raise Stopped(state.received)


def _raise_pending() -> None:
    state = _state
    if state.received is not None and not state.raised and not state.deferring:
        state.raised = True
        raise Stopped(state.received)


@contextlib.contextmanager
def _holding() -> Iterator[None]:
    """A stop signal in this block only records itself (see :func:`deferred`)."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal that arrives in this block raises :class:`Stopped` at its end (not inside it).

    For short steps that must not be cut in two (removing a directory).  A block that raises
    keeps its own exception (the command still reports the signal).  To make a resource and
    hand it to its owner in one step, see :func:`enter`.
    """
    with _holding():
        yield
    _raise_pending()


def enter(stack: contextlib.ExitStack, make: Callable[[], contextlib.AbstractContextManager[_T]]
          ) -> _T:  # fmt: skip
    """``stack.enter_context(make())``, with a stop signal held until the new context is in
    ``stack`` (whose unwinding then exits it): a signal cannot come between making a resource
    and handing it to what releases it."""
    with _holding():
        value = stack.enter_context(make())
    _raise_pending()
    return value


@contextlib.contextmanager
def temporary_directory(prefix: str, directory: str | None = None) -> Iterator[str]:
    """A new directory (``tempfile.mkdtemp``), removed with everything in it at the end,
    whatever happens; a stop signal cuts neither the making nor the removal in two."""
    import shutil
    import tempfile

    with _holding():
        path = tempfile.mkdtemp(prefix=prefix, dir=directory)
    try:
        _raise_pending()
        yield path
    finally:
        with deferred():
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """Start child processes in this block (``multiprocessing``'s spawn, ``subprocess``); put
    each where the code that stops them finds it *before* starting it.

    The block is :func:`deferred`, and the children start with SIGINT and SIGTERM blocked, so
    that no signal reaches one before its entry point called :func:`child_signals` (a
    ``multiprocessing`` child stopped while it imports prints a traceback, and a parent
    stopped half-way through starting one leaves it an ``EOFError``).
    """
    with deferred():
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def child_signals() -> None:
    """In a child started under :func:`spawning`, first thing: SIGINT is ignored (the parent
    stops its children; a Ctrl-C reaches the whole process group) and SIGTERM ends the
    process, then both are unblocked (a SIGTERM sent meanwhile ends it now).  Nothing outside
    a process's main thread (an entry point run in a thread, as tests do)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def run_trio(async_fn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """``trio.run(async_fn, *args)``, in which a stop signal cancels the run.

    Inside :func:`handling`, SIGINT and SIGTERM are received with ``trio.open_signal_receiver``
    for the whole run: the first one cancels everything ``async_fn`` started (its ``finally``
    blocks and shielded clean-ups run as on any cancellation), later ones are only counted,
    and :class:`Stopped` is raised once ``trio.run`` has returned.  A signal before the receiver
    is open (while Trio starts) is held until it is, then acts the same.
    """
    import trio

    if not _state.installed:
        return trio.run(async_fn, *args)
    outcome: list[_T] = []

    async def main() -> None:
        with trio.open_signal_receiver(*SIGNALS) as signals:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    async for signum in signals:
                        if _state.received is None:
                            _state.received = signum
                        nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                if _state.received is not None:  # while Trio started
                    nursery.cancel_scope.cancel()
                outcome.append(await async_fn(*args))
                nursery.cancel_scope.cancel()

    with _holding():
        trio.run(main)
    checkpoint()  # a signal came: Stopped, also if one raised before the run was lost
    return outcome[0]


def _resource_tracker() -> Any:
    module = sys.modules.get("multiprocessing.resource_tracker")
    return getattr(module, "_resource_tracker", None)


@contextlib.contextmanager
def resource_tracker_stopped_at_exit() -> Iterator[None]:
    """At the end of the block, stop ``multiprocessing``'s resource tracker if the block
    started it.

    Starting a process with the spawn method starts the tracker, and it outlives the command
    by a moment (it ends when it reads end-of-file on its pipe): the command stops it before
    it returns, so that when it has exited none of the processes it made is left.  A tracker
    that ran before the block (the command called as a function, in a process that uses
    ``multiprocessing`` itself) is left alone.
    """
    tracker = _resource_tracker()
    running_before = getattr(tracker, "_pid", None) is not None
    try:
        yield
    finally:
        tracker = _resource_tracker()
        stop = getattr(tracker, "_stop", None)
        if not running_before and stop is not None and getattr(tracker, "_pid", None):
            with contextlib.suppress(OSError, ChildProcessError):
                stop()
