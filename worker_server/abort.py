"""Abort a rank's cross-group process group: ``POST /v1/abort``, the monitor's fast way out of a
collective whose peer is gone.

When a peer's host drops off the network its TCP connections stay open, so the survivors sit in
torchft's cross-group all_reduce until the process group's timeout (60 s at torchft's default)
although the monitor knows within seconds. :func:`abort_cross_group` makes that collective fail
now: torchft's ``_ManagedWork.wait`` catches the error and reports it to the Manager, the step
does not commit, and the next quorum (torchft bumps its id after a commit failure) rebuilds the
process group without the dead peer. The training process is never stopped.

What really unblocks a waiting collective, measured with torch 2.13 and torchft 0.2.0:

- ``ProcessGroupGloo`` (in-process gloo): neither torchft's ``abort()`` nor c10d's
  ``ProcessGroup.abort()``/``shutdown()`` wakes a pending gloo op; it waits out its timeout.
  torchft's ``abort()`` also drops its last reference to the c10d group, whose destructor then
  joins gloo's worker threads, so the caller blocks until that timeout too. What does work is
  ``shutdown(SHUT_RDWR)`` on the group's own TCP connections: gloo fails every pending op on
  them at once ("Connection closed by peer") and the next ``configure`` replaces the group in
  milliseconds. :class:`GlooConnections` learns which sockets those are from what the group's
  ``_create_pg`` opens (gloo connects its full mesh there) and the listening addresses the ranks
  published in the group's store: other threads open sockets in that window too (NCCL's
  bootstrap, a data loader), and those are never touched. Nor is gloo's listening socket: gloo
  aborts the whole process when ``accept`` fails.
- ``ProcessGroupBaby*`` (the group runs in a subprocess): its ``abort()`` is a no-op and its
  ``shutdown()`` can wait 10 s for a helper thread; killing the subprocess makes a pending
  ``wait`` raise ``EOFError`` at once and the next ``configure`` starts a new one.
- ``ProcessGroupNCCL``/``ProcessGroupXCCL``: torchft's ``abort()`` (``ncclCommAbort``), which
  torchft itself calls from its timeout thread, marks the group errored and unblocks it.
- Anything else: the error is reported to the Manager (the step will not commit) and the answer
  says the collective ends at the group's own timeout.

The Manager is always told (``report_error``), so a step whose collective had already finished
does not commit either.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class NothingToAbort(Exception):
    """No torchft Manager, or no process group, is attached to this rank (answered 409)."""


@dataclass
class AbortResult:
    """What one abort did: ``mechanism`` is ``gloo_connections``, ``baby_killed``,
    ``pg_abort`` or ``report_only``; ``detail`` says it in one line."""

    pg: str
    mechanism: str
    detail: str
    quorum_id: int | None
    step: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"pg": self.pg, "mechanism": self.mechanism, "detail": self.detail,
                "quorum_id": self.quorum_id, "step": self.step}


MAX_REASON = 1000
MAX_DECISION = 1 << 62


def abort_request(body: Any) -> tuple[str, int | None, int | None]:
    """``(reason, decision, quorum_id)`` from a ``POST /v1/abort`` body ``{"reason": str,
    "decision": int|null, "quorum_id": int|null}``; ValueError saying what is wrong (answered
    400). ``quorum_id``: the quorum whose collective is to fail (absent: whichever is now)."""
    if not isinstance(body, dict):
        raise ValueError('body must be JSON {"reason": "...", "decision": <int or null>, '
                         '"quorum_id": <int or null>}')
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON:
        raise ValueError(f"reason must be a non-empty string of at most {MAX_REASON} characters")
    decision = body.get("decision")
    if decision is not None and (isinstance(decision, bool) or not isinstance(decision, int)
                                 or abs(decision) > MAX_DECISION):
        raise ValueError(f"decision must be an integer or null, got {decision!r}")
    quorum_id = body.get("quorum_id")
    if quorum_id is not None and (isinstance(quorum_id, bool) or not isinstance(quorum_id, int)
                                  or abs(quorum_id) > MAX_DECISION):
        raise ValueError(f"quorum_id must be an integer or null, got {quorum_id!r}")
    return reason.strip(), decision, quorum_id


# --- sockets of this process ------------------------------------------------------------

def socket_fds() -> dict[int, int]:
    """{socket inode: fd} for every socket this process has open; {} without /proc."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _open_socket(fd: int, inode: int) -> socket.socket | None:
    """A duplicate of ``fd`` as a socket object, or None when ``fd`` no longer is socket
    ``inode`` (closed, or reused by another socket since it was listed). Closing the
    duplicate leaves the original open; ``shutdown`` on it acts on the shared socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != inode:
            os.close(dup)
            return None
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _endpoint(address: Any) -> tuple[str, int] | None:
    """``(ip, port)`` of a ``getsockname``/``getpeername`` answer, an IPv4-mapped IPv6 address
    written as IPv4 and without a scope, so both ends of a connection compare equal."""
    if not isinstance(address, tuple) or len(address) < 2:
        return None
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(address[1])


def _connections(inodes: dict[int, int]) -> dict[int, tuple[Any, Any]]:
    """{inode: (local endpoint, peer endpoint)} of the connected TCP sockets among ``inodes``."""
    out = {}
    for inode, fd in inodes.items():
        s = _open_socket(fd, inode)
        if s is None:
            continue
        with s:
            try:
                if (s.family not in (socket.AF_INET, socket.AF_INET6)
                        or s.type != socket.SOCK_STREAM
                        or s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                    continue
                out[inode] = (_endpoint(s.getsockname()), _endpoint(s.getpeername()))
            except OSError:  # not connected (yet, or any more)
                continue
    return out


# gloo's tcp transport publishes each rank under "<device>/<rank>" (torch's ProcessGroupGloo
# prefixes its device index): size_t hostname length, hostname, size_t address length, the
# device's listening address (a sockaddr_storage, then a sequence number), then pair ids
_SIZE_T = struct.Struct("@N")
MAX_DEVICES = 8


def gloo_address(info: bytes) -> tuple[str, int] | None:
    """The listening ``(ip, port)`` in one rank's gloo rendezvous record; None when it is not
    one this code can read."""
    try:
        (host_len,) = _SIZE_T.unpack_from(info, 0)
        at = _SIZE_T.size + host_len
        (addr_len,) = _SIZE_T.unpack_from(info, at)
        addr = info[at + _SIZE_T.size:at + _SIZE_T.size + addr_len]
        if len(addr) != addr_len or addr_len < 8:
            return None
        (family,) = struct.unpack_from("=H", addr, 0)
        (port,) = struct.unpack_from("!H", addr, 2)
        if family == socket.AF_INET:
            ip = socket.inet_ntop(socket.AF_INET, addr[4:8])
        elif family == socket.AF_INET6 and addr_len >= 24:
            ip = socket.inet_ntop(socket.AF_INET6, addr[8:24])
        else:
            return None
    except (struct.error, ValueError, OSError, OverflowError):
        return None
    return _endpoint((ip, port)) if port else None


def gloo_endpoints(store: Any, rank: int, world_size: int) -> set[tuple[str, int]] | None:
    """The listening addresses every rank of a gloo group published in ``store`` (the one its
    ``_create_pg`` was given); None when this rank's record is missing or any record cannot
    be read: then nothing is known to be the group's."""
    if not isinstance(rank, int) or not isinstance(world_size, int) or not 0 <= rank < world_size:
        return None
    out: set[tuple[str, int]] = set()
    for device in range(MAX_DEVICES):
        if not store.check([f"{device}/{rank}"]):  # never wait on a key: it may never come
            break
        keys = [f"{device}/{r}" for r in range(world_size)]
        if not store.check(keys):
            return None
        multi_get = getattr(store, "multi_get", None)
        values = multi_get(keys) if callable(multi_get) else [store.get(k) for k in keys]
        for value in values:
            address = gloo_address(bytes(value))
            if address is None:
                return None
            out.add(address)
    return out or None


def _create_pg_call(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """``(store, rank, world_size)`` of a ``_create_pg(store, rank, world_size)`` call."""
    store, rank, world_size = (*args[:3], None, None, None)[:3]
    return (kwargs.get("store", store), kwargs.get("rank", rank),
            kwargs.get("world_size", world_size))


class GlooConnections:
    """The TCP connections of the current incarnation of a torchft ``ProcessGroupGloo``.

    :meth:`hook` wraps the group's ``_create_pg`` (called by ``configure`` at every quorum
    change): a connection it opened is the new group's when one of its ends is a listening
    address a rank of the group published in the group's store (gloo's full mesh). Other threads
    open sockets in that window (it waits seconds for every peer): NCCL's bootstrap and proxy, a
    data loader, a WorkerServer poll; gloo opens some on its own threads, so which thread opened
    a socket tells nothing. Recording never raises into torchft: a failure, or a store whose
    records cannot be read, leaves nothing recorded, and an abort then says so. Without /proc
    (not Linux) nothing is ever recorded.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inodes: frozenset[int] = frozenset()
        self.recorded = False  # connections of the current group are known

    def hook(self, pg: Any) -> bool:
        """Wrap ``pg._create_pg``; False when it has none (nothing to hook). A group hooked
        before keeps its first recorder (:func:`watch_manager` returns that one)."""
        original = getattr(pg, "_create_pg", None)
        if not callable(original) or getattr(original, "_lightkeeper_conns", None) is not None:
            return callable(original)

        def create_pg(*args, **kwargs):
            with self._lock:  # the previous group's are gone (configure aborted it first)
                self._inodes, self.recorded = frozenset(), False
            before = self._safe(socket_fds)
            result = original(*args, **kwargs)
            keep = self._safe(self._record, before, _create_pg_call(args, kwargs))
            with self._lock:
                self._inodes, self.recorded = keep or frozenset(), bool(keep)
            return result

        create_pg._lightkeeper_conns = self  # type: ignore[attr-defined]
        pg._create_pg = create_pg
        return True

    @staticmethod
    def _safe(fn, *args):
        try:
            return fn(*args)
        except Exception:  # bookkeeping only: the group is created either way
            return None

    @staticmethod
    def _record(before: dict[int, int] | None, call: tuple[Any, Any, Any]) -> frozenset[int]:
        """The connections opened since ``before`` that end at a listening address of the
        group's ranks; empty when unsure."""
        if before is None:
            return frozenset()
        endpoints = gloo_endpoints(*call)
        if not endpoints:
            return frozenset()
        new = {i: fd for i, fd in socket_fds().items() if i not in before}
        return frozenset(i for i, (local, peer) in _connections(new).items()
                         if local in endpoints or peer in endpoints)

    def shutdown(self) -> int:
        """``shutdown(SHUT_RDWR)`` every recorded connection still open; returns how many.
        Never closes a descriptor (gloo's threads own them) and never touches a listener."""
        with self._lock:
            inodes = self._inodes
        done = 0
        for inode, fd in socket_fds().items():
            if inode not in inodes:
                continue
            s = _open_socket(fd, inode)
            if s is None:
                continue
            with s:
                try:
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue  # gloo terminates the process when its accept() fails
                    s.shutdown(socket.SHUT_RDWR)
                    done += 1
                except OSError:  # already closed by the peer: nothing left to wake
                    continue
        return done


# --- the abort ---------------------------------------------------------------------------

def innermost_pg(pg: Any) -> Any:
    """The torchft group that holds the transport: wrappers (``ErrorSwallowingProcessGroup
    Wrapper``, ``ManagedProcessGroup``) hold another torchft group in ``_pg``; a transport
    group's ``_pg`` is a c10d group (not a torchft one) or None."""
    from torchft.process_group import ProcessGroup as TorchftPG

    seen = 0
    while isinstance(getattr(pg, "_pg", None), TorchftPG) and seen < 8:
        pg, seen = pg._pg, seen + 1
    return pg


def pg_kind(pg: Any) -> str:
    """``gloo``, ``baby``, ``nccl`` (NCCL, XCCL) or ``other``."""
    from torchft import process_group as tpg

    if isinstance(pg, tpg.ProcessGroupBaby):
        return "baby"
    if isinstance(pg, tpg.ProcessGroupGloo):
        return "gloo"
    if isinstance(pg, tuple(getattr(tpg, n) for n in ("ProcessGroupNCCL", "ProcessGroupXCCL")
                            if hasattr(tpg, n))):
        return "nccl"
    return "other"


def watch_manager(manager: Any) -> GlooConnections:
    """The recorder of ``manager``'s gloo group's connections, hooked now (or the one hooked
    when the Manager was first attached). Never raises: a group that cannot be watched gets one
    line on stderr, and an abort then only reports the error."""
    from .autostart import say

    connections = GlooConnections()
    try:
        pg = getattr(manager, "_pg", None)
        pg = None if pg is None else innermost_pg(pg)
        if pg is None or pg_kind(pg) != "gloo":
            return connections
        if not connections.hook(pg):
            say("WorkerServer: this gloo group has no _create_pg to watch; POST /v1/abort "
                "will only report the error to the Manager")
        return getattr(pg._create_pg, "_lightkeeper_conns", connections)
    except Exception as e:
        say(f"WorkerServer: cannot watch the cross-group process group's connections "
            f"({type(e).__name__}: {e}); POST /v1/abort will only report the error")
        return connections


def _int_or_none(fn) -> int | None:
    try:
        value = fn()
        return None if value is None else int(value)
    except Exception:
        return None


def _timeout_text(pg: Any) -> str:
    """`` (60 s)`` from a group's ``_timeout`` (a timedelta, or seconds for a Baby group)."""
    t = getattr(pg, "_timeout", None)
    seconds = t.total_seconds() if hasattr(t, "total_seconds") else t
    return f" ({seconds:g} s)" if isinstance(seconds, (int, float)) else ""


def _unblock(pg: Any, connections: GlooConnections | None, ends: str) -> tuple[str, str]:
    """Fail what is pending in ``pg`` now: (mechanism, what was done)."""
    kind = pg_kind(pg)
    if kind == "gloo":
        if connections is None or not connections.recorded:
            return "report_only", ("no connections of this gloo group are known (it was built "
                                   "before the WorkerServer attached, connects lazily, its "
                                   "ranks' addresses could not be read from its store, or "
                                   "there is no /proc): " + ends)
        n = connections.shutdown()
        return "gloo_connections", (f"shut down {n} connection(s) of the gloo group: a "
                                    "collective in it fails now")
    if kind == "baby":
        proc = getattr(pg, "_p", None)
        if proc is None or not proc.is_alive():
            return "report_only", "the group's subprocess is not running"
        pid = proc.pid
        proc.kill()
        return "baby_killed", f"killed the group's subprocess (pid {pid}): a collective in it " \
                              "fails now"
    if kind == "nccl":
        pg.abort()
        return "pg_abort", "aborted the communicator (torchft's abort(): ncclCommAbort)"
    return "report_only", f"{type(pg).__name__} cannot be aborted here: {ends}"


def abort_cross_group(manager: Any, reason: str, decision: int | None = None,
                      connections: GlooConnections | None = None,
                      for_quorum: int | None = None) -> AbortResult:
    """Make a collective blocked in ``manager``'s cross-group process group fail now (see the
    module doc for how, per group type) and tell the Manager, so the step does not commit.

    Raises :class:`NothingToAbort` when there is no Manager or it has no process group, when
    the Manager waits for its next quorum, or when ``for_quorum`` is given and the Manager is in
    another quorum (its rebuilt group is healthy: failing it would cost a good step). Never
    stops the process; what it could not do is said in ``detail`` and the one log line."""
    if manager is None:
        raise NothingToAbort("no torchft Manager is attached to this WorkerServer")
    outer = getattr(manager, "_pg", None)
    if outer is None:
        raise NothingToAbort("the torchft Manager has no process group")
    try:
        pg = innermost_pg(outer)
    except Exception:  # a torchft this code does not know: abort what the Manager holds
        pg = outer
    from .instrument import quorum_pending

    # torchft's allreduce waits for the step's quorum before any collective: a report now would
    # land in the new quorum's step (torchft cleared the last one at start_quorum) and fail it
    if quorum_pending(manager):
        raise NothingToAbort("waiting for its next quorum, in no collective"
                             + (f" (the abort was for quorum {for_quorum})"
                                if for_quorum is not None else ""))
    quorum_id = _int_or_none(lambda: getattr(manager, "_quorum_id", None))
    if for_quorum is not None and quorum_id is not None and quorum_id != for_quorum:
        raise NothingToAbort(f"moved on: this rank is in quorum {quorum_id}, the abort was for "
                             f"quorum {for_quorum}")
    step = _int_or_none(manager.current_step)
    said = f"aborted by Lightkeeper: {reason}" + (f" (decision {decision})" if decision is not None
                                                  else "")
    try:
        manager.report_error(RuntimeError(said))
        # torchft clears it at the next quorum; a rank out of the collective is refused before
        # (WorkerServer.abort): reported in the next step, it would fail that one
        told = "reported to the Manager (the step in progress, if any, will not commit)"
    except Exception as e:
        told = f"reporting to the Manager failed ({type(e).__name__}: {e})"
    ends = "a blocked collective ends at the process group's timeout" + _timeout_text(pg)
    try:
        mechanism, what = _unblock(pg, connections, ends)
    except Exception as e:  # said in the answer and the log line; the process goes on
        mechanism, what = "report_only", f"aborting {type(pg).__name__} failed " \
                                          f"({type(e).__name__}: {e}): {ends}"
    detail = f"{what}; {told}"
    log.warning("[lightkeeper] abort of the cross-group process group (%s, quorum %s, step %s)%s: "
                "%s: %s", type(pg).__name__, quorum_id, step,
                "" if decision is None else f" decision {decision}", reason, detail)
    return AbortResult(type(pg).__name__, mechanism, detail, quorum_id, step)
