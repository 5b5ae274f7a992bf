"""A real Prometheus server: 127.0.0.1, ephemeral port, its own storage, stopped by PID.

Used by ``lightkeeper demo`` and by the tests::

    from lightkeeper import prometheus
    prom = prometheus.start(["127.0.0.1:8000"], tmp_path, scrape_interval="1s")
    try:
        prom.wait_for_targets(1)
        prom.query('lightkeeper_step')  # -> list of {"metric": {...}, "value": [t, "v"]}
    finally:
        prom.stop()

``start(config, workdir)`` takes a configuration (a path to a YAML file, or a dict written out as
JSON, which Prometheus reads as YAML) or a list of scrape targets (``host:port`` or URLs) for
which it writes a minimal config with ``honor_labels: true`` (the ``job`` label is the training
job's). Storage and the log live under ``workdir``. The binary comes from ``$PROMETHEUS_BIN`` or
PATH (Debian's ``prometheus`` package, which ``bin/bootstrap --prometheus`` or ``--system``
installs as root); :func:`binary` returns None when there is none and :data:`INSTALL_HINT` says,
in one line, how to get it.
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
from typing import Any
from urllib.parse import urlsplit

import requests

from .processes import stop_process

INSTALL_HINT = ("no prometheus binary: as root, `bin/bootstrap --prometheus` installs Debian's "
                "prometheus (bin/lightkeeper demo and bin/test do it), or set PROMETHEUS_BIN")


class PrometheusError(RuntimeError):
    pass


def binary() -> str | None:
    return os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_port(target: str) -> str:
    if "://" in target:
        parts = urlsplit(target)
        return parts.netloc
    return target


def static_config(targets: list[str], *, scrape_interval: str = "1s",
                  job_name: str = "lightkeeper", rule_files: list[str] | None = None) -> dict:
    """A minimal configuration scraping ``targets`` (``host:port`` or URLs) every interval."""
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                   "scrape_timeout": scrape_interval},
        "rule_files": list(rule_files or []),
        "scrape_configs": [{"job_name": job_name, "honor_labels": True,
                            "static_configs": [{"targets": [_host_port(t) for t in targets]}]}],
    }


@dataclass
class PrometheusServer:
    url: str
    pid: int
    proc: subprocess.Popen
    workdir: Path
    log_path: Path
    config_path: Path

    # --- HTTP API -----------------------------------------------------------------------------
    def api(self, path: str, **params: Any) -> Any:
        r = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        try:
            body = r.json()
        except ValueError:
            raise PrometheusError(f"GET {path}: HTTP {r.status_code}: {r.text[:500]}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"GET {path} {params}: {body.get('errorType')}: "
                                  f"{body.get('error')}")
        return body["data"]

    def query(self, expr: str, time_: float | None = None) -> list[dict]:
        """Instant query; the result vector (or ``[{"value": ...}]`` for a scalar)."""
        params = {"query": expr}
        if time_ is not None:
            params["time"] = str(time_)
        data = self.api("query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=str(start), end=str(end),
                        step=str(step))["result"]

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def wait_for_targets(self, count: int, timeout: float = 30.0, job: str | None = None
                         ) -> list[dict]:
        """Wait until at least ``count`` targets (of scrape ``job``) are up."""
        deadline = time.monotonic() + timeout
        up: list[dict] = []
        while time.monotonic() < deadline:
            self.check_alive()
            up = [t for t in self.targets() if t.get("health") == "up"
                  and (job is None or t.get("scrapePool") == job)]
            if len(up) >= count:
                return up
            time.sleep(0.25)
        raise TimeoutError(f"only {len(up)} of {count} targets up after {timeout}s: "
                           f"{json.dumps(self.targets(), indent=1)[:3000]}")

    # --- lifecycle ----------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise PrometheusError(f"Prometheus exited with {self.proc.returncode}:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM this Prometheus (by PID), SIGKILL after ``grace`` seconds."""
        stop_process(self.proc, grace=grace)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(config: str | os.PathLike | dict | list[str], workdir: str | os.PathLike, *,
          scrape_interval: str = "1s", rule_files: list[str] | None = None,
          timeout: float = 30.0, extra_args: list[str] | None = None) -> PrometheusServer:
    """Start Prometheus on 127.0.0.1 (ephemeral port) with storage under ``workdir``.

    ``config``: a YAML file path, a config dict, or a list of scrape targets (then
    ``scrape_interval`` and ``rule_files`` shape the generated config). Waits until the server
    is ready; raises PrometheusError if it does not become ready. Interrupted while it waits
    (Ctrl-C), it stops the process first.
    """
    exe = binary()
    if exe is None:
        raise PrometheusError(INSTALL_HINT)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if isinstance(config, (list, tuple)):
        if not config:
            raise ValueError("no scrape targets")
        config = static_config(list(config), scrape_interval=scrape_interval,
                               rule_files=rule_files)
    if isinstance(config, dict):
        config_path = workdir / "prometheus.yml"
        config_path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    else:
        config_path = Path(config)
    log_path = workdir / "prometheus.log"
    last_error = ""
    for _attempt in range(3):  # the port could be taken between probing and binding
        port = _free_port()
        data = workdir / f"data-{port}"
        cmd = [exe, f"--config.file={config_path}", f"--storage.tsdb.path={data}",
               f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
               "--log.level=info", *(extra_args or [])]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=config_path.parent)
        server = PrometheusServer(f"http://127.0.0.1:{port}", proc.pid, proc, workdir, log_path,
                                  config_path)
        try:
            if _wait_ready(server, timeout):
                return server
        except BaseException:  # a Ctrl-C or SIGTERM while it starts: none is left running
            server.stop(grace=1.0)
            raise
        last_error = server.log()
        server.stop()
        if "address already in use" not in last_error:
            break
    raise PrometheusError(f"Prometheus did not become ready:\n{last_error}")


def _wait_ready(server: PrometheusServer, timeout: float) -> bool:
    """Whether ``server`` answers /-/ready within ``timeout`` s (False: it exited, or not yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return False
        try:
            if requests.get(f"{server.url}/-/ready", timeout=1).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.1)
    return False
