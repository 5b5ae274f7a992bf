"""The ``Content-Type`` of ``/metrics`` on a rank's WorkerServer and on the monitor is the
exposition format's own, each parameter once: Flask's ``mimetype=`` added a second
``charset=utf-8`` to prometheus-client's type, an error by RFC 6838 (section 4.3) that a strict
parser may refuse (Prometheus' Go parser accepts a repeat of the same value). This reads the
header of real servers.
"""

from __future__ import annotations

import requests
from prometheus_client import CONTENT_TYPE_LATEST

from monitor.config import MonitorConfig
from monitor.service import Monitor
from worker_server import RankIdentity, RankState, WorkerServer


def parameter_names(content_type: str) -> list[str]:
    return [p.split("=", 1)[0].strip().lower() for p in content_type.split(";")[1:]]


def test_metrics_content_type_has_each_parameter_once(tmp_path):
    srv = WorkerServer(RankState(RankIdentity(job="unit", replica_group=0, group_rank=0,
                                              group_world_size=1)))
    srv.serve()
    mon = Monitor(MonitorConfig(port=0, interval_s=0.2, targets=[],
                                state_path=str(tmp_path / "state.sqlite"),
                                sd_out=str(tmp_path / "targets.json"), job="unit")).start()
    try:
        for url in (srv.url, mon.url):
            ctype = requests.get(url + "/metrics", timeout=5).headers["Content-Type"]
            names = parameter_names(ctype)
            assert len(names) == len(set(names)), (url, ctype)
            assert ctype == CONTENT_TYPE_LATEST, (url, ctype)
    finally:
        srv.stop()
        mon.stop()
