"""A Prometheus server for ``lightkeeper demo``: 127.0.0.1, ephemeral port, own storage, by PID.

The binary comes from ``$PROMETHEUS_BIN`` or PATH (Debian's ``prometheus`` package). The demo
runs without Prometheus when neither is there (:func:`binary` returns None).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from .cluster import stop_process


class PrometheusError(RuntimeError):
    pass


def binary() -> str | None:
    return os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrometheusServer:
    url: str
    proc: subprocess.Popen
    log_path: Path
    config_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        stop_process(self.proc, grace=grace)


def start(config: dict, workdir: str | os.PathLike, *, timeout: float = 30.0) -> PrometheusServer:
    """Write ``config`` (JSON is YAML) to ``workdir/prometheus.yml`` and start Prometheus on it.

    Waits until ``/-/ready``; raises PrometheusError when the binary is missing or it never
    becomes ready (after up to 3 attempts on fresh ports).
    """
    exe = binary()
    if exe is None:
        raise PrometheusError("prometheus not found (install Debian's prometheus package or set "
                              "PROMETHEUS_BIN)")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(json.dumps(config, indent=1))
    log_path = workdir / "prometheus.log"
    last_error = ""
    for _attempt in range(3):  # the port could be taken between probing and binding
        port = _free_port()
        cmd = [exe, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d",
               "--log.level=info"]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=workdir)
        server = PrometheusServer(f"http://127.0.0.1:{port}", proc, log_path, config_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if requests.get(f"{server.url}/-/ready", timeout=1).status_code == 200:
                    return server
            except requests.RequestException:
                pass
            time.sleep(0.2)
        last_error = server.log()
        server.stop(grace=2.0)
        if "address already in use" not in last_error:
            break
    raise PrometheusError(f"Prometheus did not become ready:\n{last_error[-2000:]}")
