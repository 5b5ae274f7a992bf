"""What every sink shares: the result of one attempt, the sink protocol, the config error."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Protocol

# one node as Slurm and Kubernetes name it: never a hostlist (n[1-64], a,b), a path or an option
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


@dataclass
class ActionResult:
    ok: bool
    detail: str
    retry: bool = True  # False: retrying cannot help (forbidden, not found, bad command)


class Sink(Protocol):
    name: str
    # the sink keeps each job's quarantine apart (a drain's job list, a per-job taint): another
    # job's action never overtakes one of this job's (monitor/act/host_actions.py)
    per_job: bool

    def quarantine(self, event: dict[str, Any]) -> ActionResult: ...

    def release(self, event: dict[str, Any]) -> ActionResult: ...


def sink_name(kind: str, given: str, public: str) -> str:
    """A sink's shown and stored name, ``kind:public``; where ``given`` holds more (possibly a
    secret), a digest of it follows, stable across restarts so queued actions find their sink."""
    if public == given:
        return f"{kind}:{given}"
    return f"{kind}:{public}...#{hashlib.sha256(given.encode()).hexdigest()[:8]}"


class SinkConfigError(ValueError):
    """An ``--action`` the monitor cannot build a sink from."""


def one_node(event: dict[str, Any]) -> str:
    """The event's node, which a rank claims; ValueError unless it names exactly one node
    (Slurm's ``ALL`` names every one)."""
    node = str(event.get("node") or event["host"])
    if not NODE_NAME.fullmatch(node) or node.upper() == "ALL":
        raise ValueError(f"node {node!r} is not one node name: nothing done")
    return node


def event_shard(event: dict[str, Any]) -> str:
    """The shard index ("" unsharded) of the quarantine the event acts on, kept with the host
    like its job (an event an older version queued: the sender's). Shards of one job (one ledger
    each) hold their own drain entries and taints, a slice's holder and standby share theirs."""
    shard = event["shard"] if "shard" in event else (event.get("monitor") or {}).get("shard")
    return str(shard or "").partition("/")[0]
