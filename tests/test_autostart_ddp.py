"""``lightkeeper run``'s line for torchft 0.2.x's ``DistributedDataParallel``.

Its comm hook asserts ``fut._fut`` after a failed all-reduce, so a lost peer ends every rank that
uses it (torchft-nightly skips the step instead): the hook says so once, when such a DDP is built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker_server import autostart
from worker_server.state import module_version

ON_02 = pytest.mark.skipif(not module_version("torchft").startswith("0.2."),
                           reason="this Python's torchft is not 0.2.x")
SAID = "DistributedDataParallel: a lost peer"


# fixtures, not imports at collection, where torch would cost every pytest-xdist worker a second
@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def patched(monkeypatch, torch):
    """torchft's real DDP class, wrapped as the hook wraps it, restored afterwards."""
    torchft_ddp = pytest.importorskip("torchft.ddp")
    DDP = torchft_ddp.DistributedDataParallel
    monkeypatch.setattr(DDP, "__init__", DDP.__init__)
    monkeypatch.setattr(autostart, "_ddp_checked", False)
    assert autostart.patch_ddp(torchft_ddp)
    assert autostart.patch_ddp(torchft_ddp)  # idempotent: wrapped once
    return DDP


def ddp(cls):
    import torch

    return cls(object(), torch.nn.Linear(2, 2))  # the Manager is only the comm hook's state


@ON_02
def test_torchft_02_ddp_is_said_once_and_still_built(patched, capfd, torch):
    capfd.readouterr()
    model = ddp(patched)
    assert model(torch.ones(1, 2)).shape == (1, 2)  # the job's DDP is untouched
    ddp(patched)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("[lightkeeper]")]
    assert lines == [
        f"[lightkeeper] torchft {module_version('torchft')}'s {SAID} (a crash, a stopped or "
        "evicted group, /v1/abort) fails its comm hook's assert and ends this rank too; use "
        "torchft-nightly, or Manager.allreduce for the gradients (docs/run.md, Limits with "
        "torchft 0.2.0)"]


def test_a_ddp_with_its_own_comm_hook_is_not_said(patched, capfd, torch):
    class Guarded(patched):
        @staticmethod
        def _comm_hook(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

    capfd.readouterr()
    ddp(Guarded)
    assert "[lightkeeper]" not in capfd.readouterr().err


def nightly_site() -> Path:
    return Path(os.environ.get("LIGHTKEEPER_TORCHFT_NIGHTLY_SITE")
                or Path(sys.prefix) / "torchft-nightly")


@pytest.mark.parametrize("flavour", ["0.2", "nightly"])
def test_under_lightkeeper_run_only_torchft_02_is_said(tmp_path, flavour):
    """The real hook at interpreter start, torchft's own import of ``torchft.ddp``."""
    path = [str(autostart.SITE_DIR), str(autostart.SITE_DIR.parents[1])]
    if flavour == "0.2" and not module_version("torchft").startswith("0.2."):
        pytest.skip("this Python's torchft is not 0.2.x")
    if flavour == "nightly":
        if not (nightly_site() / "torchft").is_dir():
            pytest.skip(f"no torchft-nightly at {nightly_site()} (bin/bootstrap unpacks it)")
        path.insert(0, str(nightly_site()))
    code = textwrap.dedent("""
        import torch
        from torchft import DistributedDataParallel
        m = DistributedDataParallel(object(), torch.nn.Linear(2, 2))
        print(m(torch.ones(1, 2)).shape == (1, 2))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTKEEPER_")}
    env.update(PYTHONPATH=os.pathsep.join(path), **{autostart.ENV_AUTOSTART: "1"})
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert (res.returncode, res.stdout.strip()) == (0, "True"), res.stderr
    said = [ln for ln in res.stderr.splitlines() if ln.startswith("[lightkeeper]")]
    if flavour == "nightly":
        assert said == [], res.stderr
    else:
        assert len(said) == 1 and SAID in said[0] and "Manager.allreduce" in said[0], res.stderr
