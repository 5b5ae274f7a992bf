"""A job name the ``k8s`` quarantine sink cannot use. The sink deletes the job's pods on a
quarantined node by the label selector ``lightkeeper/job=<--job>``; a Kubernetes label value is
at most 63 characters of [A-Za-z0-9_.-], first and last alphanumeric, so a pod cannot carry
``team/llm-70b run#2`` and the API server answers such a selector 400 (retried, never a pod
deleted, every quarantine a failure). The monitor refuses it at start instead. No API server
runs here: the sink's requests go to tests/test_hosts_sinks.py's FAKE one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from monitor.config import MonitorConfig, QuarantineConfig
from monitor.service import check_config
from tests import test_hosts_sinks

kube = test_hosts_sinks.kube
EVENT = test_hosts_sinks.EVENT


@pytest.mark.parametrize("job", ["team/llm-70b run#2", "a" * 80])
def test_a_job_name_that_is_no_label_value_stops_a_k8s_monitor_at_start(tmp_path, job):
    p = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
                        "--state", str(tmp_path / "m.sqlite"), "--action", "k8s", "--job", job],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    line = p.stderr.strip().splitlines()[-1]
    assert "Traceback" not in p.stderr and f"--job {job!r}" in line and "63" in line, line
    assert not (tmp_path / "m.sqlite").exists()


def test_the_same_name_is_fine_without_k8s_or_with_a_pod_selector(kube):
    bad = "team/llm-70b run#2"
    check_config(MonitorConfig(state_path=":memory:", job=bad))  # a Prometheus label: any text
    check_config(MonitorConfig(state_path=":memory:", job="a" * 63,
                               quarantine=QuarantineConfig(actions=("k8s",))))
    check_config(MonitorConfig(state_path=":memory:", job=bad, quarantine=QuarantineConfig(
        actions=("k8s",), k8s_pod_selector="app=train")))
    # with a selector of its own the sink needs the job only in its taint key, made valid
    api, rx, _ = kube
    api.pods = {"train-0": ("node-1", {"app": "train"})}  # the selector's pod on the node
    sink = test_hosts_sinks.build_sink("k8s", QuarantineConfig(
        k8s_namespace="train", k8s_pod_selector="app=train", action_timeout_s=5))
    assert sink.quarantine({**EVENT, "job": bad}).ok
    lists = [r for r in rx.requests if r.method == "GET" and r.path.endswith("/pods")]
    assert [r.query["labelSelector"] for r in lists] == [["app=train"]] * 2
    keys = [t["key"] for t in api.node["spec"]["taints"] if t["key"].startswith("lightkeeper")]
    assert len(keys) == 1 and keys[0].startswith("lightkeeper.io/quarantined-team_llm-70b_run_2-")


def test_job_names_that_read_the_same_as_a_taint_key_get_keys_of_their_own():
    """``a/b`` and ``a_b`` (a custom pod selector admits both), or two long names that differ
    past the 51st character: each job's quarantine has its own taint, so one job's release does
    not take the other's quarantine off the node. A name that fits is its key as it is."""
    from monitor.act.sinks.kubernetes import taint_key

    keys = [taint_key(j) for j in ("a/b", "a_b", "x" * 60 + "1", "x" * 60 + "2", "alpha")]
    assert len(set(keys)) == 5, keys
    assert keys[1] == "lightkeeper.io/quarantined-a_b" and keys[4].endswith("-alpha"), keys
    assert all(len(k.split("/", 1)[1]) <= 63 for k in keys), keys
