"""A planned stop, said before the rank goes: on SIGTERM (a rolling restart, ``kubectl delete
pod``, ``scancel``, torchrun ending its workers) every WorkerServer serving in the process says
the rank stopped (:meth:`WorkerServer.stopped`), then the process ends by SIGTERM as it would
have. A monitor then counts the rank ended, not dead, and does not hold the stop against its
host. ``lightkeeper train`` arms it; a script of one's own calls :func:`watch_sigterm` first
thing (before importing torch, which starts a thread).

Python runs a signal handler only between bytecodes, so with a handler a rank blocked in a
collective would not stop on SIGTERM until the collective returned. Instead SIGTERM is blocked
in every thread but one, which waits for it (``sigwait``): the stop is said at once whatever the
main thread is doing, and the signal is raised again with its default action.

Children get SIGTERM as without the watcher: a ``fork``'s child unblocks it, and a child started
by ``subprocess``, ``os.posix_spawn[p]`` or multiprocessing's spawn or forkserver starts with it
unblocked (but for ``posix_spawn``, which sets the child's mask, unblocked in the starting thread
for that call: a SIGTERM in that instant ends this process unsaid); a Python child under
``lightkeeper run --planned-stops`` arms it again. multiprocessing's resource tracker
is kept from unblocking it in the thread that starts the tracker.

Limits: it must be armed before any other thread starts (threads inherit the blocked signal; one
started earlier could take SIGTERM and end the process unmarked); a child started otherwise
(``os.system``, a C library) inherits SIGTERM blocked. A SIGTERM handler the program installs
runs after the stop was said, once the main thread runs Python again (a sleep or a blocking read
there is no longer cut short by SIGTERM).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from .autostart import enabled, hook_import, say

TYPE_CHECKING = False  # typing's imports cost every interpreter start (autostart)
if TYPE_CHECKING:
    from collections.abc import Callable

_SIGNALS = {signal.SIGTERM}
_armed = False
unarmed_no_rank = False
ENV_PLANNED_STOPS = "LIGHTKEEPER_PLANNED_STOPS"  # lightkeeper run --planned-stops sets it


def arm_from_env(env=os.environ) -> None:
    """Under ``lightkeeper run --planned-stops``: arm in a training rank (``RANK`` or
    ``LOCAL_RANK`` set, as launchers set them for ranks and not for torchrun's own agent);
    called by the hook at interpreter start, before the program runs."""
    global unarmed_no_rank
    if not enabled(env, ENV_PLANNED_STOPS):
        return
    if "RANK" in env or "LOCAL_RANK" in env:
        why = watch_sigterm()
        if why:
            say(f"--planned-stops: SIGTERM will end this rank unsaid: {why}")
    else:
        unarmed_no_rank = True  # said if this process turns out a rank (autostart.on_manager)


def watch_sigterm(on_stop: Callable[[], object] | None = None) -> str | None:
    """On SIGTERM call ``on_stop`` (default: every serving WorkerServer says it stopped), then
    end the process by it. Call from the main thread before any other thread starts. Returns
    None once armed, else why it is not (one line; SIGTERM then ends the process as before)."""
    global _armed
    if _armed:  # by the hook (lightkeeper run --planned-stops), before the program ran
        return None
    if threading.current_thread() is not threading.main_thread():
        return "not called from the main thread"
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return "needs Linux's /proc to see that no other thread runs yet"
    if threads > 1:
        return f"{threads - 1} other thread(s) already run and could take SIGTERM unmarked"
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return "SIGTERM already has a handler"
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    _armed = True
    os.register_at_fork(after_in_child=_forked)
    _start_children_unblocked()
    threading.Thread(target=_wait, args=(on_stop or _servers_stopped,), name="lightkeeper-sigterm",
                     daemon=True).start()
    return None


def _servers_stopped() -> None:
    server = sys.modules.get("worker_server.server")  # not imported (a child): nothing serves
    # still importing (a stop within the first second): nothing serves yet either
    serving = getattr(server, "serving", None)
    for s in serving() if serving else ():
        s.stopped()


def _start_children_unblocked() -> None:
    """subprocess and multiprocessing's spawn start a child with the starting thread's signal
    mask (``_posixsubprocess.fork_exec``): unblock SIGTERM in that thread for the call.
    ``os.posix_spawn`` (subprocess's way when ``close_fds=False``) is given the mask instead."""
    import _posixsubprocess

    original = _posixsubprocess.fork_exec
    if getattr(original, "_lightkeeper", False):
        return

    def fork_exec(*args, **kwargs):
        mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        try:
            return original(*args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    fork_exec._lightkeeper = True  # type: ignore[attr-defined]
    _posixsubprocess.fork_exec = fork_exec
    if getattr(sys.modules.get("subprocess"), "_fork_exec", None) is original:
        sys.modules["subprocess"]._fork_exec = fork_exec  # bound at its import
    for name in ("posix_spawn", "posix_spawnp"):  # subprocess's too (close_fds=False)
        spawn = getattr(os, name, None)
        if spawn is not None and not getattr(spawn, "_lightkeeper", False):
            setattr(os, name, _spawned_unblocked(spawn))
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    if tracker is None:
        hook_import("multiprocessing.resource_tracker", _tracker_keeps_sigterm_blocked)
    else:
        _tracker_keeps_sigterm_blocked(tracker)


def _spawned_unblocked(original):
    """``os.posix_spawn[p]`` giving the child this thread's mask less SIGTERM, unless the
    caller chose the child's mask itself (``setsigmask``)."""
    def spawn(*args, **kwargs):
        if kwargs.get("setsigmask") is None:
            kwargs["setsigmask"] = signal.pthread_sigmask(signal.SIG_BLOCK, ()) - _SIGNALS
        return original(*args, **kwargs)

    spawn._lightkeeper = True  # type: ignore[attr-defined]
    return spawn


def _tracker_keeps_sigterm_blocked(module) -> None:
    # it blocks, then unblocks, these in the thread that starts it (the main thread, mostly)
    ignored = getattr(module, "_IGNORED_SIGNALS", None)
    if isinstance(ignored, tuple):  # a Python without it: nothing to do, never an import error
        module._IGNORED_SIGNALS = tuple(s for s in ignored if s not in _SIGNALS)


def _forked() -> None:
    global _armed
    _armed = False  # the child has no watcher thread: not armed until it arms itself
    _unblock()


def _unblock() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def _wait(on_stop: Callable[[], object]) -> None:
    signal.sigwait(_SIGNALS)
    try:
        on_stop()
    except Exception as e:  # the stop goes on, unsaid: the monitor finds the rank dead
        say(f"SIGTERM: could not say the planned stop ({type(e).__name__}: {e})")
    _unblock()  # in this thread only, so that the signal raised here takes its default action
    signal.raise_signal(signal.SIGTERM)
    # still here: the program handles SIGTERM itself (its handler runs in the main thread); this
    # thread, the only one not blocking SIGTERM, stays to take the next ones for it
    threading.Event().wait()
