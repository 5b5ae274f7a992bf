"""The replica group's TCPStore, found or hosted the way torch's ``env://`` does it, with a bound.

A replica group's ranks meet in one TCPStore: the in-group process group (FSDP) rendezvous there,
torchft's Manager publishes its ManagerServer address there, and other groups connect to it to
build torchft's cross-group process group. Who hosts it:

- under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``): group rank 0 of each attempt hosts a
  fresh store on an ephemeral port of ``bind`` (the rule below for a lone rank) and publishes its
  address in the agent's store under ``lightkeeper/attempt_{TORCHELASTIC_RESTART_COUNT}/store``;
  the other ranks wait for that key, then connect. Across nodes ``bind`` must be one the other
  nodes reach, as for rank 0's ManagerServer. torchrun's agent keeps one store, and every key in
  it, across its restarts (pytorch#135712): a group using it directly would rendezvous with the
  previous attempt's addresses and read its Manager address and replica id;
- with ``MASTER_ADDR``/``MASTER_PORT`` set and no agent store (a launcher that sets the variables
  and runs bare processes, as Kubernetes operators do): group rank 0 hosts it on ``MASTER_PORT``,
  the other ranks connect;
- with neither, a group of one rank hosts its own on an ephemeral port of ``bind`` (the address
  its WorkerServer binds; 127.0.0.1 by default) and advertises that address, or its host name for
  a wildcard: other groups' ranks connect to this store to build the cross-group process group.

A store this process hosts listens on ``bind`` only (a wildcard: every address), or on a
loopback ``MASTER_ADDR`` only; on any other ``MASTER_ADDR`` on every address, as torch's does.

A rank that connects waits at most ``timeout_s`` for the store to accept connections (under
torchrun: for the agent's store, rank 0's key and rank 0's store, all together), then fails
with :class:`StoreUnavailable` naming the address. (torchft's Manager, given an address where no
store listens, would sit in its TCPStore connect for its 300 s default and then fail far from the
cause.)
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


class StoreUnavailable(RuntimeError):
    """The replica group's TCPStore cannot be hosted or reached; the message says where and why."""


@dataclass
class GroupStore:
    store: Any  # torch.distributed.TCPStore
    addr: str
    port: int
    hosted: bool  # this process runs the store's server

    @property
    def address(self) -> str:
        return f"{self.addr}:{self.port}"


def uses_agent_store(env: Mapping[str, str]) -> bool:
    # torch.distributed.rendezvous._torchelastic_use_agent_store compares with str(True) as well.
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _port(env: Mapping[str, str]) -> int:
    raw = env.get("MASTER_PORT", "").strip()
    try:
        port = int(raw)
    except ValueError:
        raise StoreUnavailable(f"MASTER_ADDR is set but MASTER_PORT={raw!r} is not a port "
                               "number") from None
    if not 0 < port < 65536:
        raise StoreUnavailable(f"MASTER_PORT={port} is not a port number (1..65535)")
    return port


def wait_for_listener(addr: str, port: int, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll until something accepts TCP connections on ``addr:port``; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, remaining))):
                return True
        except OSError:
            pass
        if time.monotonic() + interval_s >= deadline:
            return False
        time.sleep(interval_s)


def advertised_address(bind: str) -> str:
    """The address other hosts reach this rank at, from the address it binds: that address,
    or for a wildcard bind this host's name (what torchft's Manager advertises for itself)."""
    return socket.gethostname() if is_wildcard(bind) else bind.strip().strip("[]")


def is_wildcard(bind: str) -> bool:
    return bind.strip().strip("[]") in ("", "0.0.0.0", "::")


def listener(bind: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``bind:port`` only (a wildcard: every address), for servers
    that would otherwise listen on every address."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(bind.strip().strip("[]"), port,
                                                          type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) resolves to loopback addresses only."""
    try:
        infos = socket.getaddrinfo(host.strip().strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def group_store(group_rank: int, group_world_size: int, timeout_s: float,
                env: Mapping[str, str] | None = None,
                bind: str = "127.0.0.1") -> GroupStore:
    """Host or connect to this replica group's store (see the module docstring).

    Raises StoreUnavailable: several ranks but no ``MASTER_ADDR``, a bad ``MASTER_PORT``, a port
    rank 0 cannot listen on, or no store reachable (under torchrun: none published by group
    rank 0) within ``timeout_s``."""
    from torch.distributed import TCPStore

    env = os.environ if env is None else env
    timeout = timedelta(seconds=timeout_s)
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        if group_world_size > 1:
            raise StoreUnavailable(
                f"a replica group of {group_world_size} ranks needs MASTER_ADDR and MASTER_PORT "
                "(torchrun sets them; other launchers must set them to group rank 0's address)"
            )
        return _host_on(bind, timeout)

    port = _port(env)
    if uses_agent_store(env):
        return _attempt_store(group_rank, addr, port, timeout_s, env, bind)
    if group_rank == 0:
        try:
            fd = listener(addr, port).detach() if is_loopback(addr) else None
            store = TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=timeout,
                             multi_tenant=True, master_listen_fd=fd)
        except Exception as e:  # DistNetworkError and friends: say which address failed
            raise StoreUnavailable(
                f"group rank 0 hosts the replica group's TCPStore (torch's env:// convention) "
                f"but cannot listen on {addr}:{port}: {str(e).splitlines()[0]}"
            ) from None
        return GroupStore(store, addr, port, hosted=True)

    return _connect(addr, port, timeout_s, timeout_s, "(MASTER_ADDR:MASTER_PORT)",
                    "group rank 0 hosts this replica group's store")


def _host_on(bind: str, timeout: timedelta) -> GroupStore:
    """A fresh store on an ephemeral port of ``bind``, advertised as :func:`advertised_address`."""
    from torch.distributed import TCPStore

    advertise, sock = advertised_address(bind), None
    if not is_wildcard(bind):  # else every address, as torch's own
        sock = listener(bind)
    store = TCPStore(advertise, sock.getsockname()[1] if sock else 0, is_master=True,
                     wait_for_workers=False, timeout=timeout,
                     master_listen_fd=sock.detach() if sock else None)
    return GroupStore(store, advertise, store.port, hosted=True)


def _connect(addr: str, port: int, wait_s: float, timeout_s: float, what: str,
             host: str) -> GroupStore:
    """A client of the store at ``addr:port``, waiting at most ``wait_s`` for it to listen."""
    from torch.distributed import TCPStore

    if not wait_for_listener(addr, port, wait_s):
        raise StoreUnavailable(
            f"no TCPStore at {addr}:{port} {what} after {timeout_s:g}s: "
            f"{host}; is it running, and is that its address?"
        )
    try:
        store = TCPStore(addr, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise StoreUnavailable(f"cannot connect to the TCPStore at {addr}:{port}: "
                               f"{str(e).splitlines()[0]}") from None
    return GroupStore(store, addr, port, hosted=False)


def _attempt_store(group_rank: int, addr: str, port: int, timeout_s: float,
                   env: Mapping[str, str], bind: str) -> GroupStore:
    """This torchrun attempt's own store: rank 0 hosts it and publishes it in the agent's."""
    deadline = time.monotonic() + timeout_s
    agent = _connect(addr, port, timeout_s, timeout_s, "(MASTER_ADDR:MASTER_PORT)",
                     "torchrun's agent hosts this replica group's rendezvous store").store
    # torch tells its attempts apart by this variable, which the agent sets for every worker
    key = f"lightkeeper/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0').strip()}/store"
    if group_rank == 0:
        try:
            fresh = _host_on(bind, timedelta(seconds=timeout_s))
        except Exception as e:
            raise StoreUnavailable(f"group rank 0 cannot host this attempt's TCPStore on "
                                   f"{bind or 'every address'}: {str(e).splitlines()[0]}") from None
        agent.set(key, fresh.address)
        return fresh
    try:
        agent.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
        published = agent.get(key).decode("utf-8")
    except Exception:
        raise StoreUnavailable(
            f"group rank 0 did not publish this attempt's TCPStore ({key!r} in torchrun's agent "
            f"store at {addr}:{port}) within {timeout_s:g}s; is group rank 0 running?"
        ) from None
    fresh_addr, _, fresh_port = published.rpartition(":")
    return _connect(fresh_addr, int(fresh_port), max(0.0, deadline - time.monotonic()), timeout_s,
                    f"({key} in torchrun's agent store)",
                    "group rank 0 of this torchrun attempt hosts this replica group's store")
