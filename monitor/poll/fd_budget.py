"""File descriptors for the poller's connections: the process's limit raised, then shared out.

The poller keeps a keep-alive connection per rank it polls (a pool smaller than one sweep
reconnects every sweep past it, docs/scaling.md), and each connection is a file descriptor.
Under the usual soft limit (1,024: systemd's default, most shells) a monitor of a thousand
ranks runs out: connects fail with ``EMFILE`` and healthy ranks read as unreachable. So:

- :func:`raise_soft_limit` raises this process's soft ``RLIMIT_NOFILE`` to its hard limit
  (as the Go runtime does at start, and many servers), when a Poller is made;
- :func:`budget` shares what the limit allows between requests in flight and idle
  connections, leaving a reserve for everything else the process opens (its HTTP server,
  the store, the poller process's pipes, logs);
- a connect that still fails with ``EMFILE``/``ENFILE`` (something else took descriptors)
  closes idle connections and is retried once (monitor/poll/poller.py); its error names the limit.

Past the budget the poller still polls every rank: the least recently used idle connections
are closed and those ranks reconnect (slower, not wrong). :func:`advice` says so, with the
limit that would keep every connection.
"""

from __future__ import annotations

import errno
import math

try:
    import resource
except ImportError:  # not a POSIX system: no limit to raise or read
    resource = None

RESERVE = 256  # descriptors left for the rest of the process (at most a quarter of the limit)
# an infinite (or unreadable) limit: what the budget is made of instead
UNLIMITED = 1 << 20
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def soft_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` (:data:`UNLIMITED` when infinite or unknown)."""
    if resource is None:
        return UNLIMITED
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return UNLIMITED if soft == resource.RLIM_INFINITY or soft > UNLIMITED else soft


def raise_soft_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (at most :data:`UNLIMITED`); never
    lowers it, never raises an error (a system that refuses keeps its limit). Returns the soft
    limit now."""
    if resource is None:
        return UNLIMITED
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = UNLIMITED if hard == resource.RLIM_INFINITY else min(hard, UNLIMITED)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # e.g. macOS above OPEN_MAX: keep what there is
            pass
    return soft_limit()


def budget(limit: int, max_concurrency: int) -> tuple[int, int]:
    """(requests in flight, idle connections) a sweep may hold under ``limit`` descriptors:
    the reserve left aside, at most half of the rest in flight, the others idle."""
    usable = max(2, limit - min(RESERVE, limit // 4))
    in_flight = max(1, min(max_concurrency, usable // 2))
    return in_flight, max(0, usable - in_flight)


def wanted(n_targets: int, max_concurrency: int) -> int:
    """The descriptor limit under which ``n_targets`` ranks each keep their connection (the
    idle pool the monitor asks for: one per target and 1,024 more) with ``max_concurrency``
    requests in flight: what :func:`advice` recommends."""
    need = n_targets + 1024 + max_concurrency
    return max(need + RESERVE, math.ceil(need * 4 / 3))


def advice(n_targets: int, idle_cap: int, limit: int, max_concurrency: int) -> str | None:
    """A warning for an operator when ``n_targets`` ranks do not each fit a pooled connection
    under ``limit`` descriptors (None: they fit)."""
    if n_targets + 1024 <= idle_cap:
        return None
    return (f"{n_targets} targets but the file descriptor limit ({limit}) leaves the poller "
            f"{idle_cap} idle connections: ranks on addresses of their own past them reconnect "
            f"every sweep (slower, not wrong); raise the limit to "
            f"{wanted(n_targets, max_concurrency)} or more (LimitNOFILE= in a systemd unit, "
            f"ulimit -n in a shell)")


def out_of_descriptors(e: OSError) -> bool:
    """``e`` says this process (or the system) has no file descriptor left."""
    return e.errno in OUT_OF_DESCRIPTORS
