"""File descriptors for the poller's connections: the soft limit raised to the hard one, then
shared between requests in flight and idle connections (past it: reconnects, slower not wrong).
"""

from __future__ import annotations

import errno
import math

try:
    import resource
except ImportError:  # not a POSIX system: no limit to raise or read
    resource = None

RESERVE = 256  # descriptors left for the rest of the process (at most a quarter of the limit)
UNLIMITED = 1 << 20  # what an infinite (or unreadable) limit counts as
SPARE_IDLE = 1024  # idle connections the monitor keeps beyond one per target


def soft_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` (:data:`UNLIMITED` when infinite or unknown)."""
    if resource is None:
        return UNLIMITED
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return UNLIMITED if soft == resource.RLIM_INFINITY or soft > UNLIMITED else soft


def raise_soft_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (never lowers it, never raises an
    error); returns the soft limit now."""
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
    """(requests in flight, idle connections) under ``limit`` descriptors: the reserve left
    aside, at most half of the rest in flight, the others idle."""
    usable = max(2, limit - min(RESERVE, limit // 4))
    in_flight = max(1, min(max_concurrency, usable // 2))
    return in_flight, max(0, usable - in_flight)


def advice(n_targets: int, limit: int, max_concurrency: int) -> str | None:
    """A warning when ``n_targets`` ranks (and the :data:`SPARE_IDLE` the monitor asks for) do not
    each fit a pooled connection under ``limit``, with the limit that would; None if they fit."""
    idle_cap = budget(limit, max_concurrency)[1]
    if n_targets + SPARE_IDLE <= idle_cap:
        return None
    need = n_targets + SPARE_IDLE + max_concurrency
    wanted = max(need + RESERVE, math.ceil(need * 4 / 3))
    return (f"{n_targets} targets but the file descriptor limit ({limit}) leaves the poller "
            f"{idle_cap} idle connections: ranks on addresses of their own past them reconnect "
            f"every sweep (slower, not wrong); raise the limit to {wanted} or more "
            f"(LimitNOFILE= in a systemd unit, ulimit -n in a shell)")


def out_of_descriptors(e: OSError) -> bool:
    return e.errno in (errno.EMFILE, errno.ENFILE)
