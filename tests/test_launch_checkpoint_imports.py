"""A DCP save in a process that never used torchft, under ``lightkeeper run``'s hook: saved as
without it, and Flask, waitress, requests and prometheus_client are not even imported (docs/
run.md, "Nothing without torchft").

Faked: torch's ``torch.distributed.checkpoint`` (a stand-in first on ``PYTHONPATH``), so the
fresh interpreter starts in milliseconds; the hook and its patch of the saver are real."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.hook import hooked_env

SAVER = "def save(state_dict, **kwargs):\n    return 'saved'\n\nasync_save = save\n"
SCRIPT = """
import json, sys
import torch.distributed.checkpoint as dcp
result = dcp.save({"w": 1}, checkpoint_id="x")
print(json.dumps({"result": result, "patched": "worker_server.checkpoint" in sys.modules,
                  "loaded": sorted(m for m in ("flask", "waitress", "requests", "prometheus_client",
                                               "worker_server.server") if m in sys.modules)}))
"""


def test_a_save_without_torchft_imports_no_server(tmp_path):
    env = hooked_env(tmp_path)
    dcp = tmp_path / "fakes" / "torch" / "distributed" / "checkpoint"
    dcp.mkdir(parents=True)
    for package in (dcp.parent.parent, dcp.parent):
        (package / "__init__.py").write_text("")
    (dcp / "__init__.py").write_text("from .state_dict_saver import save, async_save\n")
    (dcp / "state_dict_saver.py").write_text(SAVER)
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=30)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert out == {"result": "saved", "patched": True, "loaded": []}, (out, res.stderr)
