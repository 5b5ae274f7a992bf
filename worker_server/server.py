"""The per-rank WorkerServer: the Flask app on a production WSGI server (waitress) in a thread.

Two lines in any torchft training script, right after creating the ``Manager``::

    from worker_server import WorkerServer
    server = WorkerServer.start(manager, replica_group=int(os.environ["REPLICA_GROUP_ID"]))

It binds 127.0.0.1 on an ephemeral port unless told otherwise (``host``/``port`` or
``LIGHTKEEPER_WORKER_HOST`` / ``LIGHTKEEPER_WORKER_PORT`` + ``LOCAL_RANK``) and serves
read-only endpoints; ``LIGHTKEEPER_EXIT_TOKEN`` enables the monitor's actions on the rank
(``POST /v1/exit``, ``/v1/abort``, ``/v1/probe``). ``server="torch"`` (``LIGHTKEEPER_WORKER_SERVER=torch``) serves
the read-only endpoints as handlers on torch's own per-rank server instead
(:mod:`worker_server.torch_server`); where torch has none, Flask serves and one line says so.
With ``LIGHTKEEPER_MONITOR=URL`` set it registers itself with that monitor and keeps
re-registering, so a restarted monitor finds it again; a monitor that is down only delays that.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any
from urllib.parse import urlsplit

import requests

from http_serving import (
    BackgroundWSGIServer,
    failure_reason,
    is_loopback_host,
    is_monitor_url,
    redact_entry,
    redact_url,
    url_list,
)

from .abort import GlooConnections, NothingToAbort, abort_cross_group, watch_manager
from .app import EXIT_AUTH, create_app, payload_signed
from .autostart import say, worker_port
from .flight_recorder import IncarnationTracker, fr_dump
from .instrument import instrument_manager
from .metrics import WorkerMetrics
from .state import RankIdentity, RankState
from .torch_server import TorchServer, TorchServerUnavailable

log = logging.getLogger(__name__)

REGISTER_INTERVAL_S = 5.0
FINISH_WAIT_S = 3.0  # finish(): how long a clean end waits for a monitor's read
# stopped(): a leader-polling monitor reads a non-leader every --member-interval (10 s); under
# the 30 s a kubelet, Slurm (KillWait) and torchrun give a SIGTERMed process before SIGKILL
STOP_WAIT_S = 20.0
# stopped(): however often a monitor reads, a sweep may come seconds late (its cores shared, a
# sweep waiting on a dump or a dead rank): its next read is waited for this long at least
STOP_FLOOR_S = 5.0
POLLED_RECENTLY_S = 10.0  # finish() waits only for a reader seen this recently
SENT_WAIT_S = 1.0  # finish()/stopped(): the most they wait for a read answer to be sent
# ... and the least after it was written: without it a clean end was sometimes read as a crash
# on a loaded host although sent() had seen the answer leave (cause not pinned down)
SENT_FLOOR_S = 0.1
EXIT_STATUS = 1  # as torchft's Manager exits on the Lighthouse's kill
# servers of this process that are serving, held until stop(): a server started by a bare
# WorkerServer.start(...) still serves, and checkpoint phases and planned stops must find it
_SERVING: dict[WorkerServer, None] = {}
_SERVING_LOCK = threading.Lock()
SERVERS = ("flask", "torch")  # Lightkeeper's own (waitress), torch's _WorkerServer (handlers)
ENV_SERVER = "LIGHTKEEPER_WORKER_SERVER"
# a bind error of the port itself (torch's server says no errno)
_PORT_TAKEN = (errno.EADDRINUSE, errno.EACCES, None)


def registration_token(env: Any = os.environ) -> str | None:
    """The bearer token a rank registers with: ``LIGHTKEEPER_REGISTER_TOKEN`` (it admits a
    registration and nothing else), else ``LIGHTKEEPER_TOKEN`` for a deployment made before the
    split (then the rank holds the monitor's admin token: docs/monitor.md, Trust model).
    Stripped: a secret file's final newline is no header value (requests refuses it); blank:
    unset."""
    return (env.get("LIGHTKEEPER_REGISTER_TOKEN") or "").strip() \
        or (env.get("LIGHTKEEPER_TOKEN") or "").strip() or None


def port_number(value: Any, name: str) -> int:
    """``value`` as a TCP port (0: ephemeral); ValueError naming ``name`` otherwise."""
    try:
        port = int(str(value).strip())
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{name}={value!r} is not a port (0-65535)")
    return port


def serving() -> list[WorkerServer]:
    """The WorkerServers this process serves now, from :meth:`WorkerServer.serve` to
    :meth:`WorkerServer.stop`, kept or not by the code that started them."""
    with _SERVING_LOCK:
        return list(_SERVING)


def exit_process(reason: str, delay_s: float = 0.2) -> None:
    """End this process ``delay_s`` from now (the HTTP answer goes out first), whatever its
    training thread is doing: blocked in a collective or hung, it could not be asked to stop.
    ``os._exit`` skips cleanup; the OS frees the process's ports, memory and devices. The timer
    starts before the line is written: a closed stdout/stderr (a pipe's reader gone) stops neither."""
    timer = threading.Timer(delay_s, os._exit, args=(EXIT_STATUS,))
    timer.daemon = True
    timer.start()
    say(f"exiting (status {EXIT_STATUS}): {reason}")


def server_kind(given: str | None, env) -> str:
    """``given``, else ``LIGHTKEEPER_WORKER_SERVER``, else flask; ValueError naming its source."""
    raw, source = (given, "server") if given else (env.get(ENV_SERVER), ENV_SERVER)
    kind = (raw or "flask").strip().lower()
    if kind not in SERVERS:
        raise ValueError(f"{source}={raw!r}: one of {', '.join(SERVERS)}")
    return kind


def monitor_urls(given: str | None, env) -> list[str]:
    """The monitors to register with: ``given``, else ``LIGHTKEEPER_MONITOR``, comma-separated
    (sharded monitors, docs/scaling.md), blanks skipped. An entry that is no
    ``http(s)://host:port`` URL is left out in one line (its password not shown): a typo in a
    monitor's address costs that registration, never the rank's server (``lightkeeper run``
    refuses it up front). A list of blanks alone (``"$A,$B"`` with both unset) registers with
    none, said in one line too."""
    raw, source = ((given, "monitor_url") if given
                   else (env.get("LIGHTKEEPER_MONITOR"), "LIGHTKEEPER_MONITOR"))
    given_urls = url_list(raw)
    if given_urls is None:
        say(f"{source} {raw!r} names no monitor URL; this rank is registered with none")
        return []
    urls = []
    for url in given_urls:
        if is_monitor_url(url):  # as lightkeeper run checks it
            urls.append(url)
        else:
            say(f"not registering with {redact_entry(url)!r} ({source}): not an "
                "http(s)://host:port URL; this rank is not registered there")
    return urls


def _routed_from(family: int, addr: tuple) -> str | int:
    """The address this host sends to ``addr`` from, as its kernel routes it (a UDP connect()
    sends nothing), else the errno (socket()'s EAFNOSUPPORT: a family absent). Not bind():
    with ip_nonlocal_bind (VIP hosts) every address binds."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr[0], _DISCARD_PORT, *addr[2:]))  # an IPv6 address's scope kept
            return s.getsockname()[0]
    except OSError as e:
        return e.errno or -1


_DISCARD_PORT = 9  # any port would do: nothing is sent
_LOOPBACK = {socket.AF_INET: ("127.0.0.1", 0), socket.AF_INET6: ("::1", 0, 0, 0)}
# unless the family's loopback is routed: with disable_ipv6 Linux answers every IPv6 address,
# ::1 too, with EADDRNOTAVAIL (no source address), not ENETUNREACH
_NO_FAMILY = (errno.EAFNOSUPPORT, errno.ENETUNREACH, errno.EADDRNOTAVAIL)
_NOT_HERE = (errno.EHOSTUNREACH, errno.EINVAL)  # an unreachable route, an unscoped ``fe80::``


def _own(routed: str, address: str) -> bool:
    """``address`` is this host's: the kernel sends to it from itself (a local route)."""
    ip = ipaddress.ip_address(address.partition("%")[0])
    # the rest of 127.0.0.0/8 (Debian's 127.0.1.1 for the host's name) is sent from 127.0.0.1
    return ip.is_loopback or ip.is_unspecified \
        or ipaddress.ip_address(routed.partition("%")[0]) == ip


def _family_here(family: int) -> bool | None:
    """Whether this host has ``family`` on: anything of it is routed, its loopback at least.
    False where it has none or has it off (``disable_ipv6``: its loopback has no source
    address, EADDRNOTAVAIL); None on another error."""
    routed = _routed_from(family, _LOOPBACK[family]) if family in _LOOPBACK else ""
    return None if isinstance(routed, int) and routed not in _NO_FAMILY \
        else isinstance(routed, str)


def _on_this_host(host: str) -> bool | None:
    """Whether ``host`` is this host: a loopback name or address, or one whose every address is
    this host's own (the kernel routes it locally). An address of a family this host lacks or
    has switched off is skipped (``localhost`` -> ``::1`` where IPv6 is off); any other one
    routed elsewhere or not at all (an unscoped ``fe80::``: EINVAL) makes it another host, also
    when another of its addresses is on many hosts (docker0's 172.17.0.1, a VIP). None when it
    does not resolve (the registration's own failure says so) or routing failed otherwise
    (EMFILE, EACCES)."""
    if is_loopback_host(host):  # localhost may also resolve to a ::1 a host without IPv6 lacks
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    here: dict[int, bool | None] = {}
    own = unknown = False
    for family, _, _, _, addr in infos:
        routed = _routed_from(family, addr)
        if isinstance(routed, str):
            if not _own(routed, addr[0]):
                return False  # sent out of this host: another's address
            own = True
        elif routed in _NO_FAMILY:
            if family not in here:
                here[family] = routed != errno.EAFNOSUPPORT and _family_here(family)
            if here[family]:
                return False  # a family this host has, an address no route reaches
            unknown = unknown or here[family] is None
        elif routed in _NOT_HERE:
            return False
        else:
            unknown = True
    return None if unknown else own


def loopback_for_remote(own_url: str, monitor_url: str) -> bool:
    """``own_url`` is on loopback and ``monitor_url`` on another host: the monitor would poll
    its own loopback, never this rank."""
    host = urlsplit(own_url).hostname or ""
    return is_loopback_host(host) and _on_this_host(urlsplit(monitor_url).hostname or "") is False


class WorkerServer:
    """Serves one rank's state, Flight Recorder dump, stacks and metrics over HTTP."""

    def __init__(self, state: RankState, tracker: IncarnationTracker | None = None,
                 host: str = "127.0.0.1", port: int = 0, threads: int = 4,
                 fr_dumper=fr_dump, fault_handler=None, fault_token: str | None = None,
                 exit_token: str | None = None, server: str = "flask",
                 exit_auth: str = "any") -> None:
        if server not in SERVERS:
            raise ValueError(f"server {server!r}: one of {', '.join(SERVERS)}")
        self.state = state
        self.tracker = tracker or IncarnationTracker(state.identity.group_rank)
        self.metrics = WorkerMetrics(state)
        self.app = create_app(state, self.tracker, self.metrics, fr_dumper=fr_dumper,
                              fault_handler=fault_handler, fault_token=fault_token,
                              exit_handler=exit_process if exit_token else None,
                              exit_token=exit_token,
                              abort_handler=self.abort if exit_token else None,
                              exit_auth=exit_auth)
        self._http: BackgroundWSGIServer | TorchServer | None = None
        if server == "torch":
            self._http = self._torch_server(host, port, fr_dumper,
                                            acts=bool(exit_token or fault_token))
        self.server = "torch" if self._http is not None else "flask"
        if self._http is None:
            # waitress: a real WSGI server with a small thread pool; one slow /v1/fr_trace does
            # not block /healthz or /v1/stacks.
            # a peer's signed probe fetch is never paced
            self._http = BackgroundWSGIServer(
                self.metrics.count_cpu(self.app, trusted=lambda environ: payload_signed(
                    environ, state, exit_token)),
                host=host, port=port, threads=threads, name="lightkeeper-worker-http")
        self.host, self.port, self.url = host, self._http.port, self._http.url
        state.worker_url = self.url
        # a wildcard bind is reached by itself on loopback: its advertised name may resolve
        # through the network (DNS) and would put the network back into the probe's control
        wild = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(host)
        state.control_url = f"http://{wild}:{self.port}" if wild else self.url
        self._stop = threading.Event()
        self._register_threads: list[threading.Thread] = []  # one per register_with()
        self.autostarted = False  # started by lightkeeper run's hook, not by the job's code
        # the Manager POST /v1/abort acts on (the last attached) and its gloo group's sockets
        self._manager: Any = None
        self._connections: GlooConnections | None = None

    def _torch_server(self, host: str, port: int, fr_dumper, acts: bool) -> TorchServer | None:
        """torch's server with Lightkeeper's handlers, or None (said in one line) where this
        torch has none: the rank is then served by Flask. A port that is taken raises OSError."""
        try:
            served = TorchServer(self.state, self.tracker, self.metrics, host=host, port=port,
                                 fr_dumper=fr_dumper)
        except TorchServerUnavailable as e:
            say(f"WorkerServer: torch's server cannot carry Lightkeeper's handlers ({e}); "
                "serving on Lightkeeper's own server (Flask) instead")
            return None
        if acts:
            say("WorkerServer: on torch's server only the read-only endpoints are served (it "
                "checks no token): POST /v1/exit, /v1/abort, /v1/probe and /v1/faults are off")
        return served

    @classmethod
    def start(cls, manager: Any = None, *, replica_group: int | None = None,
              group_rank: int | None = None, group_world_size: int | None = None,
              job: str | None = None, lighthouse: str | None = None,
              host: str | None = None, port: int | None = None,
              faults: list[str] | None = None, monitor_url: str | None = None,
              fault_handler=None, server: str | None = None) -> WorkerServer:
        """Start serving; with ``manager``, instrument what of it can be (a Manager of a torchft
        this code does not know gets one line on stderr: :mod:`worker_server.instrument`).

        Unset arguments come from the environment torchft users already have:
        ``REPLICA_GROUP_ID``, ``RANK``, ``WORLD_SIZE``, ``TORCHFT_LIGHTHOUSE``, ``LIGHTKEEPER_JOB``.
        ``fault_handler(spec)`` with ``LIGHTKEEPER_FAULT_TOKEN`` set enables ``POST /v1/faults``;
        ``LIGHTKEEPER_EXIT_TOKEN`` enables ``POST /v1/exit`` (:func:`exit_process`);
        ``LIGHTKEEPER_EXIT_AUTH=hmac`` refuses the monitor's deprecated bearer token there
        (another value than ``hmac`` or ``any``: ValueError).
        ``server`` (else ``LIGHTKEEPER_WORKER_SERVER``, else ``"flask"``): ``"torch"`` serves the
        read-only endpoints as handlers on torch's server (:mod:`worker_server.torch_server`),
        Flask where this torch cannot. Raises ValueError for another value, ``OSError`` when
        ``port`` cannot be bound. Without ``port``: ``LIGHTKEEPER_WORKER_PORT`` + ``LOCAL_RANK``
        (torchrun's ranks of a node, one port each), else ephemeral; an environment's port that
        is no port, or one that is taken, is said in one line and the rank serves on an ephemeral
        port (the job goes on); an address that cannot be bound (a ``LIGHTKEEPER_WORKER_HOST``
        this host lacks) raises ``OSError`` on any port. A ``monitor_url`` (else
        ``LIGHTKEEPER_MONITOR``) entry that is no URL is left out in one line, and the rank
        still serves and registers with the others (:func:`monitor_urls`). A ``manager`` that
        already has a server (``lightkeeper run``'s hook started one,
        :mod:`worker_server.autostart`) gets that server back, unchanged: one WorkerServer per
        rank. The server serves until :meth:`stop`, whether or
        not the caller keeps it.
        """
        existing = getattr(manager, "_lightkeeper_server", None) if manager is not None else None
        if existing is not None:
            log.info("this Manager is already served at %s (lightkeeper run)", existing.url)
            return existing
        env = os.environ
        identity = RankIdentity(
            job=job or env.get("LIGHTKEEPER_JOB") or "lightkeeper",  # set empty: unset
            replica_group=int(replica_group if replica_group is not None
                              else env.get("REPLICA_GROUP_ID", 0)),
            group_rank=int(group_rank if group_rank is not None else env.get("RANK", 0)),
            group_world_size=int(group_world_size if group_world_size is not None
                                 else env.get("WORLD_SIZE", 1)),
            lighthouse=lighthouse or env.get("TORCHFT_LIGHTHOUSE"),
        )
        # the deprecated bearer is taken until the operator sets hmac (docs/worker_server.md)
        exit_auth = (env.get("LIGHTKEEPER_EXIT_AUTH") or "").strip().lower() or "any"
        if exit_auth not in EXIT_AUTH:
            raise ValueError(f"LIGHTKEEPER_EXIT_AUTH={env.get('LIGHTKEEPER_EXIT_AUTH')!r}: one "
                             f"of {', '.join(EXIT_AUTH)}")
        settings = dict(
            host=host or env.get("LIGHTKEEPER_WORKER_HOST") or "127.0.0.1",  # set empty: unset
            # stripped, blank unset: a blank token would open a route no request can pass
            fault_handler=fault_handler,
            fault_token=(env.get("LIGHTKEEPER_FAULT_TOKEN") or "").strip() or None,
            exit_token=(env.get("LIGHTKEEPER_EXIT_TOKEN") or "").strip() or None,
            exit_auth=exit_auth,
            server=server_kind(server, env),
        )
        why = ""  # the environment's port not served: said once the rank is, naming its URL
        if port is not None:
            bound = port_number(port, "port")
        else:
            try:
                bound = worker_port(env)
            except ValueError as e:
                bound, why = 0, str(e)
        try:
            server = cls(RankState(identity, faults=faults), port=bound, **settings)
        except OSError as e:
            # the environment's port is the node's, not the script's (a sibling holds it): it
            # must not end the job; another error (an address this host lacks) is any port's
            if port is not None or not bound or e.errno not in _PORT_TAKEN:
                raise
            why = f"{e} (LIGHTKEEPER_WORKER_PORT + LOCAL_RANK)"
            server = cls(RankState(identity, faults=faults), port=0, **settings)
        if why:
            say(f"WorkerServer: {why}; serving on {server.url} instead, an ephemeral port: "
                "what expects the fixed port (a readiness probe, a PodMonitor, a file_sd list, "
                "a NetworkPolicy's port range) misses this rank; a monitor it registers with "
                "(LIGHTKEEPER_MONITOR) finds it where its network reaches that port")
        if manager is not None:
            server.attach(manager)
        server.serve()
        for url in monitor_urls(monitor_url, env):
            server.register_with(url, token=registration_token(env))
        return server

    def serve(self) -> WorkerServer:
        """Start answering HTTP requests on a background thread; returns self."""
        self._http.start()
        with _SERVING_LOCK:
            _SERVING[self] = None
        return self

    def attach(self, manager: Any) -> None:
        """Instrument a torchft Manager created after the server started; never raises (what
        cannot be instrumented is said in one line on stderr, the rest is served). It is also
        the Manager ``POST /v1/abort`` acts on (:meth:`abort`)."""
        instrument_manager(manager, self.state, self.tracker)
        connections = watch_manager(manager)
        try:
            self._manager = weakref.ref(manager)  # the server must not keep a Manager alive
        except TypeError:
            self._manager = lambda m=manager: m
        self._connections = connections

    def abort(self, reason: str, decision: int | None = None,
              quorum_id: int | None = None) -> dict[str, Any]:
        """``POST /v1/abort``: fail a collective blocked in the attached Manager's cross-group
        process group now (:func:`worker_server.abort.abort_cross_group`); the process goes on.
        Raises :class:`~worker_server.abort.NothingToAbort` when no Manager is attached, or the
        rank is not in the cross-group collective (phase ``allreduce``) of ``quorum_id``."""
        manager = self._manager() if self._manager is not None else None
        # told late (another survivor's abort failed its step first), the rank is in its next
        # step: an abort now would fail that one, and its peers would wait out the group's timeout
        phase = self.state.phase
        if manager is not None and phase != "allreduce":
            raise NothingToAbort(f"moved on: this rank is in phase {phase}, not blocked in the "
                                 "cross-group collective")
        result = abort_cross_group(manager, reason, decision, self._connections, quorum_id)
        return {**result.as_dict(), "aborted": True, "reason": reason, "decision": decision,
                "pid": self.state.identity.pid, "rank": self.state.identity.rank}

    def register_with(self, monitor_url: str, token: str | None = None) -> None:
        """Keep this rank registered with a monitor (``POST {monitor}/v1/targets``) with its
        registration ``token`` (:func:`registration_token`). A refusal is logged once per
        status and retried; a token no HTTP header carries (not Latin-1) is said once, and
        nothing is sent; the rank keeps training either way."""
        body = {
            "url": self.url,
            "job": self.state.identity.job,
            "replica_group": self.state.identity.replica_group,
            "rank": self.state.identity.rank,
        }
        shown = redact_url(monitor_url)
        try:  # HTTP sends header values as Latin-1: anything else fails every request
            (token or "").encode("latin-1")
        except UnicodeEncodeError:
            say(f"not registering with monitor {shown}: its registration token "
                "(LIGHTKEEPER_REGISTER_TOKEN or LIGHTKEEPER_TOKEN) is not ASCII/Latin-1 text, "
                "which no HTTP header carries; this rank is not monitored")
            return
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            basic = "@" in urlsplit(monitor_url).netloc  # requests sends its Basic auth
        except ValueError:  # no URL: the loop says so
            basic = False
        if token and basic:
            say(f"monitor {shown}: its URL's user:password and the registration token both need "
                "the Authorization header, and the URL's (Basic) is the one sent: the monitor "
                "will refuse this rank (401); give the monitor's URL without them")

        def tell(message: str) -> None:
            if not self._stop.is_set():  # a lookup or request that outlasted stop() says nothing
                say(message)

        def loop() -> None:
            said: int | str | None = None  # the last trouble said (a status, "unreachable")
            while not self._stop.is_set():
                try:
                    if loopback_for_remote(self.url, monitor_url):
                        if said != "loopback":
                            tell(f"not registering {self.url} with monitor {shown}: it runs on "
                                 "another host and cannot reach this host's loopback; bind an "
                                 "address it reaches (LIGHTKEEPER_WORKER_HOST=0.0.0.0 or this "
                                 "host's address, lightkeeper run --worker-host)")
                        said = "loopback"
                        self._stop.wait(REGISTER_INTERVAL_S)
                        continue
                    r = requests.post(f"{monitor_url.rstrip('/')}/v1/targets", json=body,
                                      headers=headers, timeout=2)
                    if r.status_code != 200 and r.status_code != said:
                        # 401 (token), 403 (address not allowed), 409 (another job), 429
                        # (monitor full): the operator has to act; not monitored until then.
                        # Said on stderr: the job's logging may hide or reformat a warning.
                        hint = ("; give the rank the monitor's registration token "
                                "(LIGHTKEEPER_REGISTER_TOKEN, lightkeeper run --register-token)"
                                if r.status_code == 401 else "")
                        tell(f"monitor {shown} refused this rank's registration: HTTP "
                             f"{r.status_code} {' '.join(r.text.split())[:200]}{hint}")
                    elif r.status_code == 200 and said is not None:
                        tell(f"registered with monitor {shown}")
                    said = None if r.status_code == 200 else r.status_code
                except requests.RequestException as e:
                    if said != "unreachable":  # once: a typo in the URL leaves it unmonitored
                        why = failure_reason(e) or type(e).__name__
                        tell(f"cannot register with monitor {shown} ({why}); this rank is not "
                             f"monitored until it can, tried every {REGISTER_INTERVAL_S:.0f} s")
                    said = "unreachable"
                except ValueError:  # urlsplit's: no URL (its text may hold the password)
                    if said != "no url":
                        tell(f"cannot register with monitor {shown}: it is not an "
                             "http(s)://host:port URL; this rank is not monitored")
                    said = "no url"
                self._stop.wait(REGISTER_INTERVAL_S)

        thread = threading.Thread(target=loop, name="lightkeeper-register", daemon=True)
        self._register_threads.append(thread)
        thread.start()

    def finish(self, wait_s: float = FINISH_WAIT_S) -> bool:
        """Say training completed (``/v1/state``: ``"finished": true``), so that a monitor counts
        this rank ended, not dead, once it stops answering; call it after the last step, before
        :meth:`stop`, and never on an error path (a crashed rank must be found dead).

        While a monitor reads ``/v1/state`` (a read in the last 10 s; on Flask, a read is a
        monitor's when it says ``User-Agent: lightkeeper-monitor``, as the monitor's poller does,
        so a user's ``curl`` or a dashboard does not count), waits up to ``wait_s`` for one
        answer saying finished to be sent to it, so the rank's end is delayed by about one
        monitor interval at most; returns whether one was. Unread (no monitor, or it polls less
        often), the monitor finds the rank dead, as without this call."""
        self.state.finish()
        read_at = self.state.state_read_at
        if wait_s <= 0 or read_at is None or time.monotonic() - read_at > POLLED_RECENTLY_S:
            return False
        if not self._finished_read(wait_s):
            say(f"training finished, but nothing read /v1/state within {wait_s:g} s to learn it: "
                "a monitor may count this rank dead")
            return False
        return True

    def stopped(self, by: str = "SIGTERM") -> bool:
        """Say the rank was asked to stop (a rolling restart, ``kubectl delete pod``,
        ``scancel``, torchrun ending its workers): ``/v1/state`` says ``"finished": true`` and
        ``"stopped_by"``, so a monitor counts it ended, not dead, and does not blame its host.

        Waits for a polling monitor's next read, until two of its intervals (the longer of the
        last two gaps between its reads), and at least ``STOP_FLOOR_S`` (a busy monitor's sweep
        comes late), have passed since its last one, and at most ``STOP_WAIT_S``: a monitor
        stopped at the same moment holds the rank's end that long at most. Returns whether one
        was."""
        self.state.finish(stopped_by=by)
        read_at, gap = self.state.state_read_at, self.state.read_gap_s
        if read_at is None or gap is None:
            return False
        wait_s = min(STOP_WAIT_S, read_at + max(2 * gap, STOP_FLOOR_S) - time.monotonic())
        return wait_s > 0 and self._finished_read(wait_s)

    def _finished_read(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for an answer saying finished to be written, then for it to go
        out (the server sends it after the handler returns: a busy host's server thread may
        send it well after)."""
        if not self.state.wait_finished_read(wait_s):
            return False
        written = time.monotonic()
        self._http.sent(SENT_WAIT_S)
        self._stop.wait(max(0.0, written + SENT_FLOOR_S - time.monotonic()))
        return True

    def stop(self) -> None:
        """Stop serving and registering. Waits up to 1 s in all for the registrations in
        flight (one per monitor), so that they say nothing after the caller stopped the server
        (a slow monitor is left to the daemon thread's request timeout)."""
        self._stop.set()
        with _SERVING_LOCK:
            _SERVING.pop(self, None)
        self.state.set_phase("stopped")
        self._http.stop()
        deadline = time.monotonic() + 1.0
        for thread in self._register_threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
