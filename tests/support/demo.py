"""``lightkeeper demo`` as a subprocess, for the demo's end-to-end tests: start it, wait for
``--keep-running`` to announce the running cluster, check that everything still serves and
works, stop it with SIGTERM and check that nothing it started is left."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from lightkeeper.processes import stop_process


def demo_args(*argv: str) -> argparse.Namespace:
    """``lightkeeper demo``'s flags as its parser reads ``argv``."""
    from lightkeeper import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(list(argv))


def poll(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: only its parent can reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def get_json(url: str):
    try:
        r = requests.get(url, timeout=2)
        return r.json() if r.ok else None
    except (requests.RequestException, ValueError):
        return None


@dataclass
class RunningDemo:
    proc: subprocess.Popen
    out_path: Path
    report_dir: Path

    @classmethod
    def start(cls, d: Path, *args: str) -> RunningDemo:
        """``lightkeeper demo --keep-running ARGS`` with ``d/tmp`` as its TMPDIR (its own demo
        lock, so two can run at once), its output in ``d/demo.out``."""
        (d / "tmp").mkdir(exist_ok=True)
        out_path, report_dir = d / "demo.out", d / "report"
        with open(out_path, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lightkeeper.cli", "demo", "--report-dir",
                 str(report_dir), "--keep-running", *args],
                stdout=out, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "TMPDIR": str(d / "tmp")})
        return cls(proc, out_path, report_dir)

    def text(self) -> str:
        return self.out_path.read_text()

    def announced(self, timeout: float = 400) -> dict:
        """The report written once the scenario is over and the cluster is announced."""
        def ready():
            assert self.proc.poll() is None, f"demo exited ({self.proc.returncode}):\n" + \
                self.text()[-4000:]
            return "the cluster keeps running" in self.text() and \
                (self.report_dir / "report.json").exists()

        poll(ready, timeout, "the demo to announce the running cluster")
        return json.loads((self.report_dir / "report.json").read_text())

    def check_keeps_working(self, report: dict, stepping: bool = True) -> list[str]:
        """Every process still serves, the monitor keeps sweeping and (``stepping``) every rank
        the demo lists keeps stepping; returns those ranks' URLs."""
        urls = report["urls"]
        sweeps = get_json(urls["monitor"] + "/v1/cluster")["sweeps"]
        assert requests.get(urls["lighthouse"] + "/status", timeout=2).ok
        if urls["prometheus"]:
            assert requests.get(urls["prometheus"] + "/-/ready", timeout=2).ok
        poll(lambda: (get_json(urls["monitor"] + "/v1/cluster") or {}).get("sweeps", 0)
             >= sweeps + 5, 60, "the monitor to keep sweeping")
        ranks = re.findall(r"curl (http://127\.0\.0\.\d+:\d+)/v1/state", self.text())
        if stepping:
            steps = {u: get_json(u + "/v1/state")["step"] for u in ranks}
            poll(lambda: all((get_json(u + "/v1/state") or {}).get("step", -1) > steps[u]
                             for u in ranks), 60, "every rank to keep stepping")
        assert self.proc.poll() is None, "the demo exited on its own"
        return ranks

    def stop(self, report: dict | None) -> dict:
        """SIGTERM; the demo exits 0 with a completed final report, and every process it
        started (those of ``report`` too) is gone. Returns the final report."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            stop_process(self.proc, grace=0)
            raise
        text = self.text()
        assert code == 0, text[-4000:]
        assert "Traceback" not in text, text[-4000:]
        final = json.loads((self.report_dir / "report.json").read_text())
        assert final["outcome"] == "completed"
        pids = set(final["pids"]) | set((report or {}).get("pids", []))
        assert len(pids) >= 5  # Lighthouse, monitor, the groups and their ranks
        poll(lambda: all(gone(p) for p in pids), 30, "every process the demo started to be gone")
        return final

    def kill(self) -> None:
        """For a test that failed before it stopped its demo."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                stop_process(self.proc, grace=0)


def check_ft_hsdp(text: str) -> None:
    """FT-HSDP under torchrun, from a rank's Flight Recorder: group 0's rank 1 (torchrun's
    second worker; the agent hosts the group's store) in a quorum of the 3 groups reduces across
    them with global ranks 1, 3 and 5 (torchft's gloo all_reduce) and all-gathers inside its
    group (FSDP2)."""
    [url] = re.findall(r"curl (\S+)/v1/state +# group 0 rank 1$", text, re.M)
    poll(lambda: (get_json(url + "/v1/state") or {}).get("num_participants") == 3, 30,
         "group 0's rank 1 in a quorum of the 3 groups")
    dump = get_json(url + "/v1/fr_trace")
    inc = dump["incarnations"][-1]
    assert inc["group_rank"] == 1 and inc["global_ranks"] == [1, 3, 5], inc
    names = {(e["process_group"][0], e["profiling_name"]) for e in dump["entries"]}
    assert ("", "gloo:all_reduce") in names, names  # across groups (torchft)
    assert any(n.startswith("gloo:all_gather") for _, n in names), names  # FSDP2 inside
