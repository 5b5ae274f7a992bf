"""Slurm sink: ``scontrol update NodeName=<node> State=DRAIN Reason="lightkeeper: ..."`` on
quarantine (one argv entry per word, no shell), ``State=RESUME`` on release. Needs ``scontrol``
on PATH and a Slurm user allowed to update nodes (docs/quarantine.md).
"""

from __future__ import annotations

import subprocess
from typing import Any

from .base import ActionResult

SCONTROL = "scontrol"


class SlurmSink:
    name = "slurm"

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s

    def quarantine(self, event: dict[str, Any]) -> ActionResult:
        f = event.get("finding") or {}
        what = f"finding {f['id']}" if f.get("id") is not None else ""
        if f.get("replica_group") is not None:
            what = f"{what} replica_group {f['replica_group']}".strip()
        return self._run([SCONTROL, "update", f"NodeName={_node(event)}", "State=DRAIN",
                          f"Reason=lightkeeper: {event.get('kind')} {what}".strip()])

    def release(self, event: dict[str, Any]) -> ActionResult:
        return self._run([SCONTROL, "update", f"NodeName={_node(event)}", "State=RESUME"])

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
