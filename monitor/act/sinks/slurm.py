"""Slurm sink: drain the quarantined node, resume it on release or expiry.

Quarantine runs ``scontrol update NodeName=<node> State=DRAIN Reason="lightkeeper: <kind>
<finding>"`` (one argv entry per word; the Reason is one entry, so no shell quoting is
involved); release runs ``scontrol update NodeName=<node> State=RESUME``. A drained node
finishes its running jobs and takes no new ones, so the requeued job lands elsewhere. The
monitor needs ``scontrol`` on PATH and a Slurm user allowed to update nodes (SlurmUser or an
operator/admin account: ``sacctmgr modify user <u> set adminlevel=operator``). Exit status 0 is
success; anything else, a timeout or a missing ``scontrol`` is a failure with scontrol's stderr.
"""

from __future__ import annotations

import subprocess
from typing import Any

from .base import ActionResult

SCONTROL = "scontrol"


def drain_argv(node: str, kind: str, finding: str) -> list[str]:
    return [SCONTROL, "update", f"NodeName={node}", "State=DRAIN",
            f"Reason=lightkeeper: {kind} {finding}".strip()]


def resume_argv(node: str) -> list[str]:
    return [SCONTROL, "update", f"NodeName={node}", "State=RESUME"]


class SlurmSink:
    name = "slurm"

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s

    def quarantine(self, event: dict[str, Any]) -> ActionResult:
        f = event.get("finding") or {}
        what = f"finding {f['id']}" if f.get("id") is not None else ""
        if f.get("replica_group") is not None:
            what = f"{what} replica_group {f['replica_group']}".strip()
        return self._run(drain_argv(_node(event), str(event.get("kind")), what))

    def release(self, event: dict[str, Any]) -> ActionResult:
        return self._run(resume_argv(_node(event)))

    def _run(self, argv: list[str]) -> ActionResult:
        try:
            p = subprocess.run(argv, capture_output=True, timeout=self.timeout_s, check=False)
        except FileNotFoundError:
            return ActionResult(False, "scontrol not found on PATH", retry=False)
        except subprocess.TimeoutExpired:
            return ActionResult(False, f"scontrol did not finish within {self.timeout_s:g}s")
        except OSError as e:
            return ActionResult(False, f"cannot run scontrol: {e}")
        shown = " ".join(argv[1:])
        if p.returncode == 0:
            return ActionResult(True, f"scontrol {shown}")
        err = p.stderr.decode(errors="replace").strip()[-300:]
        # a node Slurm does not know stays unknown: retrying cannot help
        return ActionResult(False, f"scontrol {shown} exited {p.returncode}: {err}",
                            retry="Invalid node name" not in err)


def _node(event: dict[str, Any]) -> str:
    return str(event.get("node") or event["host"])
