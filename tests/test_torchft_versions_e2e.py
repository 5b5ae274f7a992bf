"""examples/torchft_two_groups.py, watched by ``lightkeeper monitor``, on each torchft the suite has.

One job per torchft: a real Lighthouse (that torchft's ``torchft_lighthouse``), the monitor's CLI
and two replica groups of one rank running the example, group 0 under ``lightkeeper run`` (the
autostart hook, no Lightkeeper code) and group 1 with the explicit ``WorkerServer.start(manager)``.
Group 1 starts once group 0 has committed a step, so both see a quorum change. Checked on that
one run: one hook line for the hooked rank, ``/v1/state`` (identity, steps, quorum, the torch and
torchft versions of the packages the rank imported), ``/v1/stacks``, ``/metrics``, the Flight
Recorder dump with its torchft incarnations (its own quorum, then the one with both groups), and
the monitor verifying both ranks against the Lighthouse.

The torchfts (``flavour``):

- ``this_python``: whatever torchft this Python has (torchft 0.2.0 in .venv; in a nox session of
  noxfile.py, that session's torch and torchft);
- ``nightly``: torchft-nightly pinned in .ci/torchft-nightly.txt, unpacked beside 0.2.0 by
  bin/bootstrap into ``.venv/torchft-nightly`` and put first on the job's ``PYTHONPATH``
  (``LIGHTKEEPER_TORCHFT_NIGHTLY_SITE`` names another directory). Missing: a failure in CI, a
  skip elsewhere.

On a torch without the Flight Recorder JSON dump (before 2.8) ``/v1/fr_trace`` must answer 501
with its reason and the quorum changes are read from ``/v1/state`` (docs/install.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import requests

from lightkeeper.processes import free_port, stop_process, wait_until
from rank_wire.recorders import is_torchft_pg_name
from tests.conftest import IN_CI
from tests.support.workers import get_json, try_state

# solo: its Pythons importing torch at once fill both cores, slowing a job beside it
pytestmark = [pytest.mark.e2e, pytest.mark.solo]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchft_two_groups.py"
PIN_FILE = ROOT / ".ci" / "torchft-nightly.txt"
LIGHTKEEPER = [sys.executable, "-m", "lightkeeper.cli"]
HOOK_LINE = re.compile(r"^\[lightkeeper\] replica_group=(\d+) group_rank=(\d+) "
                       r"worker_server=(http://\S+) \(lightkeeper run\)$", re.M)
EXPLICIT_LINE = re.compile(r"^group (\d+) rank (\d+): worker_server=(http://\S+)$", re.M)
FLAVOURS = ("this_python", "nightly")


def nightly_pin() -> str:
    """The pinned torchft-nightly version (.ci/torchft-nightly.txt)."""
    for line in PIN_FILE.read_text().splitlines():
        if line.startswith("torchft-nightly=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"no torchft-nightly==<version> line in {PIN_FILE}")


def nightly_site() -> Path:
    return Path(os.environ.get("LIGHTKEEPER_TORCHFT_NIGHTLY_SITE")
                or Path(sys.prefix) / "torchft-nightly")


def installed_torchft(path: list[str] | None = None) -> tuple[str, str] | None:
    """(name, version) of the torchft distribution, either name, in ``path`` (default
    sys.path)."""
    for dist in metadata.distributions(**({"path": path} if path else {})):
        if dist.metadata["Name"] in ("torchft", "torchft-nightly"):
            return dist.metadata["Name"], dist.version
    return None


def torch_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


class Job:
    """The example's two groups, their Lighthouse and their monitor, on one torchft."""

    def __init__(self, flavour: str, d: Path) -> None:
        self.flavour, self.dir, self.procs = flavour, d, {}
        self.dist: tuple[str, str] | None = None
        base = os.environ.get("PYTHONPATH", "")
        path = [str(ROOT), *[p for p in base.split(os.pathsep) if p]]
        if flavour == "nightly":
            site = nightly_site()
            self.dist = installed_torchft([str(site)])
            path.insert(0, str(site))
            lighthouse = [str(site / "bin" / "torchft_lighthouse")]
        else:
            self.dist = installed_torchft()
            lighthouse = [str(Path(sys.executable).parent / "torchft_lighthouse")]
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE", "LIGHTKEEPER_MONITOR",
                                 "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
        port = free_port()
        self.lighthouse_url = f"http://127.0.0.1:{port}"
        self.env.update(PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1",
                        PYTHONFAULTHANDLER="1", TORCHFT_LIGHTHOUSE=self.lighthouse_url)
        self.lighthouse_cmd = [*lighthouse, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
                               "--join_timeout_ms", "5000"]
        self.monitor_port = free_port()  # known up front: group 0 starts beside the monitor
        self.monitor = f"http://127.0.0.1:{self.monitor_port}"

    def launch(self) -> None:
        """The Lighthouse, the monitor and group 0 (under ``lightkeeper run``), at once."""
        self.start("lighthouse", self.lighthouse_cmd)
        self.start("monitor", [*LIGHTKEEPER, "monitor", "--port", str(self.monitor_port),
                               "--dry-run", "--interval", "0.5", "--lighthouse",
                               self.lighthouse_url, "--state", str(self.dir / "monitor.sqlite")])
        self.start("group0", [*LIGHTKEEPER, "run", "--monitor", self.monitor, "--",
                              sys.executable, str(EXAMPLE)], REPLICA_GROUP_ID="0")

    def start(self, name: str, cmd: list[str], **extra: str) -> None:
        with open(self.dir / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                env={**self.env, **extra}, cwd=self.dir,
                                                start_new_session=True)

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def wait_line(self, name: str, pattern: re.Pattern, timeout: float = 120) -> tuple:
        def found():
            m = pattern.search(self.log(name))
            if m:
                return m.groups()
            for proc_name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(f"{self.flavour}: {proc_name} exited {proc.returncode}: "
                                         f"{self.log(proc_name)[-3000:]}")
            return None
        return wait_until(found, timeout, what=f"{self.flavour} {name}: {pattern.pattern}")

    def wait(self, predicate, timeout: float, what: str):
        """``wait_until`` whose timeout shows the end of each group's log."""
        try:
            return wait_until(predicate, timeout, what=f"{self.flavour}: {what}")
        except TimeoutError as e:
            tails = "\n".join(f"--- {n}.log\n{self.log(n)[-1500:]}" for n in ("group0", "group1")
                              if (self.dir / f"{n}.log").exists())
            raise AssertionError(f"{e}\n{tails}") from None

    def start_group1(self) -> None:
        """Once group 0 has its first quorum (alone): group 1 joins, a new quorum for both."""
        url0 = self.wait_line("group0", HOOK_LINE)[2]
        self.wait(lambda: (s := try_state(url0)) and s["quorum_id"] >= 0, 120,
                  "group 0's first quorum")
        self.start("group1", [sys.executable, str(EXAMPLE), "--worker-server"],
                   REPLICA_GROUP_ID="1", LIGHTKEEPER_MONITOR=self.monitor)

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            stop_process(proc, grace=3)


def available(flavour: str) -> str | None:
    """Why ``flavour`` cannot run here, or None."""
    if flavour == "nightly":
        site = nightly_site()
        if installed_torchft([str(site)]) is None:
            return (f"no torchft-nightly in {site}: bin/bootstrap installs it there "
                    "(or set LIGHTKEEPER_TORCHFT_NIGHTLY_SITE)")
    elif installed_torchft() is None:
        return f"no torchft in {sys.executable}"
    return None


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """Every selected and available flavour's job, started at once: most of a job's time is
    importing torch, so the jobs overlap; each group 1 starts once its group 0 has a quorum."""
    selected = {item.callspec.params["flavour"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    started: dict[str, Job] = {}
    try:
        for flavour in FLAVOURS:
            if flavour in selected and available(flavour) is None:
                started[flavour] = job = Job(flavour, tmp_path_factory.mktemp(flavour))
                job.launch()
        for job in started.values():
            job.start_group1()
        yield started
    finally:
        for job in started.values():
            job.stop()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_groups_are_served_and_verified(jobs, flavour):
    why = available(flavour)
    if why:
        if IN_CI:
            pytest.fail(why)
        pytest.skip(why)
    job = jobs[flavour]
    dist, torchft = job.dist
    if flavour == "nightly" or dist == "torchft-nightly":
        assert (dist, torchft) == ("torchft-nightly", nightly_pin())
    import torch  # the ranks run this Python: its torch (a CUDA build says "+cu128")

    torch_version = str(torch.__version__)

    group, group_rank, url0 = job.wait_line("group0", HOOK_LINE)
    assert (int(group), int(group_rank)) == (0, 0)
    _, _, url1 = job.wait_line("group1", EXPLICIT_LINE)
    urls = {0: url0, 1: url1}
    # both groups in one quorum, each a few steps into it
    states = job.wait(lambda: (s := {g: try_state(u) for g, u in urls.items()})
                      and all(x and x["num_participants"] == 2 and x["commits"] >= 2
                              for x in s.values())
                      and s[0]["quorum_id"] == s[1]["quorum_id"] and s, 120,
                      "both groups training in one quorum")
    for g, state in states.items():
        assert (state["replica_group"], state["group_rank"], state["group_world_size"]) == (g, 0, 1)
        assert state["replica_id"].startswith(f"two_groups_{g}:")
        assert (state["torchft_version"], state["torch_version"]) == (torchft, torch_version)
        assert state["participating"] and state["lighthouse"] == job.lighthouse_url
        # each step's quorum timed from the rank's start_quorum to torchft's quorum future
        step_s = {r["step"]: r["step_s"] for r in state["timing"]["recent"]}
        waits = [q for q in state["timing"]["recent_quorum"] if q["step"] in step_s]
        assert waits and all(0 <= q["wait_quorum_s"] <= step_s[q["step"]] for q in waits), \
            state["timing"]

        stacks = requests.get(urls[g] + "/v1/stacks", timeout=10)
        assert stacks.status_code == 200 and "MainThread" in stacks.text
        metrics = requests.get(urls[g] + "/metrics", timeout=10)
        assert metrics.status_code == 200
        assert f'torchft_version="{torchft}"' in metrics.text
        assert re.search(r"^lightkeeper_commits_total\{.*\} [1-9]", metrics.text, re.M)

        fr = requests.get(urls[g] + "/v1/fr_trace", timeout=30)
        if fr.status_code == 501:  # torch < 2.8: no JSON dump to serve (docs/install.md)
            assert fr.json()["missing"] and torch_minor(torch_version) < (2, 8), fr.text
            assert g == 1 or state["quorum_changes"] >= 1, state  # group 0: alone, then both
            continue
        assert fr.status_code == 200, fr.text
        incs = fr.json()["incarnations"]
        # group 0 trained alone, then with group 1: one incarnation per quorum it was in
        assert len(incs) >= (2 if g == 0 else 1), incs
        assert [i["quorum_id"] for i in incs] == sorted({i["quorum_id"] for i in incs})
        assert incs[0]["replica_world_size"] == (1 if g == 0 else 2)
        last = wait_until(lambda u=urls[g]: (i := get_json(u + "/v1/fr_trace", timeout=30)
                                             ["incarnations"][-1])["pg_id"] is not None and i,
                          60, what="the current incarnation's process group")
        assert (last["quorum_id"], last["replica_world_size"]) == (state["quorum_id"], 2)
        assert is_torchft_pg_name(last["pg_name"]), last
        dump = get_json(urls[g] + "/v1/fr_trace?pg=torchft", timeout=30)
        assert any(e["profiling_name"] == "gloo:all_reduce" for e in dump["entries"]), dump

    # the monitor (its CLI) polls both ranks and verifies them against the Lighthouse
    def verified():
        cluster = get_json(job.monitor + "/v1/cluster", timeout=5)
        groups = {g["replica_group"]: g for g in cluster["groups"]}
        ok = (set(groups) == {0, 1} and cluster["verification"]["lighthouse_ok"]
              and all(g["in_quorum"] and g["evidence_ranks"] == 1 and len(g["ranks"]) == 1
                      and (g["ranks"][0]["verification"] or {}).get("state") == "verified"
                      for g in groups.values()))
        return (cluster, groups) if ok else None
    cluster, groups = wait_until(verified, 60, interval=0.3, what=f"{flavour}: the monitor's view")
    assert {g: groups[g]["ranks"][0]["url"] for g in groups} == urls
    assert cluster["verification"]["ranks"] == {"verified": 2}

    hook_lines = [line for line in job.log("group0").splitlines() if HOOK_LINE.match(line)]
    assert len(hook_lines) == 1 and not HOOK_LINE.search(job.log("group1"))
    for name in ("group0", "group1"):  # nothing Lightkeeper could not do on either torchft
        text = job.log(name)
        assert "cannot instrument" not in text and "not recorded" not in text, text[-3000:]
        assert "bookkeeping failed" not in text, text[-3000:]
