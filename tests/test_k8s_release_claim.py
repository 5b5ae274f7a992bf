"""The ``k8s`` sink's release touches only a node that carries the job's own taint. A quarantine
refused (``claim not verified``: the rank named a node where the job runs no pod, maybe another
team's) is still followed by a release at TTL or by hand; that release must not write a
``Released`` condition onto that node, lift its taints or undo its cordon. A release still
ends right when another job's monitor acts on the node meanwhile or the node is deleted. Against
the FAKE API server of tests/test_hosts_sinks.py (none can run here), which keeps the node's
taints and annotations and checks resourceVersion."""

from __future__ import annotations

import json

import pytest

from monitor.act.sinks import build_sink
from monitor.config import QuarantineConfig
from tests import test_hosts_sinks

kube = test_hosts_sinks.kube
EVENT = test_hosts_sinks.EVENT
RELEASE = {**EVENT, "event": "release"}
LEGACY = {"key": "lightkeeper.io/quarantined", "value": "dead_rank", "effect": "NoSchedule"}
OTHER = {"key": "other", "value": "x", "effect": "NoExecute"}


def _patches(rx):
    return [r.path for r in rx.requests if r.method == "PATCH"]


def _cond(api):
    (cond,) = [c for c in api.node["status"]["conditions"] if c["type"] == "LightkeeperQuarantined"]
    return cond["status"], cond["reason"], cond.get("message")


def test_release_of_a_node_with_no_taint_of_the_job_patches_nothing(kube):
    """No taint of the job: nothing on the node is its own. Another team's node, or this job's
    quarantined by an older version before an upgrade (its taint names no job), cordoned by it:
    the release leaves all of it as it is and is done, naming the older taint (a failure
    could never be cleared on another team's node), so an operator lifts it by hand."""
    api, rx, sink = kube
    api.pods = {}  # no pod of the job on the node: the claim is not verified
    api.node["spec"].update(unschedulable=True, taints=[OTHER, LEGACY])
    api.node["metadata"]["annotations"] = {"lightkeeper.io/cordoned": "true"}
    api.node["status"] = {"conditions": [{"type": "LightkeeperQuarantined", "status": "True"}]}
    before = json.loads(json.dumps(api.node))
    res = sink.quarantine(EVENT)
    assert not res.ok and "claim not verified" in res.detail, res.detail
    res = sink.release(RELEASE)
    assert res.ok, res
    assert "no lightkeeper.io/quarantined-j taint, nothing to release; an older version's " \
        "lightkeeper.io/quarantined holds it" in res.detail, res.detail
    assert _patches(rx) == [] and api.node == before


def test_an_older_versions_taint_stays_and_holds_the_cordon(kube):
    """It names no job, so it may be another team's older monitor's quarantine: this job's
    quarantine and release leave it, and with it the cordon and the condition, as they leave
    another job's; the condition then names what holds the node, not this job's reason."""
    api, rx, sink = kube
    api.node["spec"]["taints"] = [OTHER, LEGACY]
    assert sink.quarantine(EVENT).ok
    rx.requests.clear()
    res = sink.release(RELEASE)
    assert res.ok and res.detail == "node node-1: taint removed; still quarantined by " \
        "lightkeeper.io/quarantined", res.detail
    assert api.node["spec"]["taints"] == [OTHER, LEGACY]
    assert api.node["spec"]["unschedulable"] is True
    assert _patches(rx) == ["/api/v1/nodes/node-1/status", "/api/v1/nodes/node-1"]
    assert _cond(api) == ("True", "Quarantined", "still quarantined by lightkeeper.io/quarantined")


def test_a_release_racing_a_quarantine_and_its_release_leaves_no_stale_condition(kube):
    """Another job's monitor quarantines the node after this release wrote Released, and
    releases it after this one wrote 'still quarantined': this attempt must not lift the last
    taint under a True condition; its retry releases the node."""
    api, rx, sink = kube
    other = {**EVENT, "job": "other", "kind": "hang"}
    api.pods = {f"{j}-0": ("node-1", {**api.JOB_POD, "lightkeeper/job": j}) for j in ("j", "other")}
    monitor_b = build_sink("k8s", QuarantineConfig(k8s_namespace="train", action_timeout_s=5))
    assert sink.quarantine(EVENT).ok
    steps = [lambda: monitor_b.quarantine(other), lambda: monitor_b.release(
        {**other, "event": "release"})]

    def b_acts(fake):  # at each of this release's status writes, B's whole action runs
        fake.on_status = None
        assert steps.pop(0)().ok
        fake.on_status = b_acts if steps else None
    api.on_status = b_acts
    res = sink.release(RELEASE)
    assert not res.ok and res.retry and "changed meanwhile" in res.detail, res.detail
    assert sink.release(RELEASE).ok
    assert api.node["spec"]["taints"] == [OTHER] and api.node["spec"]["unschedulable"] is False
    assert _cond(api)[:2] == ("False", "Released")


@pytest.mark.parametrize("gone_at", ["/api/v1/nodes/node-1/status", "/api/v1/nodes/node-1"])
def test_a_node_deleted_during_its_release_is_released(kube, gone_at):
    """Deleted (an autoscaler) after the release first read it, its condition or taint write
    answers 404: the node is gone, as when the first read finds none, so the release is done
    rather than failed for good."""
    api, rx, sink = kube
    assert sink.quarantine(EVENT).ok
    api.fail[("PATCH", gone_at)] = 404
    res = sink.release(RELEASE)
    assert res.ok and res.detail == "node node-1: gone, nothing to release", res


def test_a_release_that_failed_midway_is_carried_out_by_its_retry(kube):
    """The condition is set before the taint is lifted: a retry after either failed still
    finds the job's taint, so the node does not keep a stale LightkeeperQuarantined=True."""
    api, rx, sink = kube
    assert sink.quarantine(EVENT).ok
    api.fail[("PATCH", "/api/v1/nodes/node-1/status")] = 500
    res = sink.release(RELEASE)
    assert not res.ok and res.retry and "HTTP 500" in res.detail, res.detail
    del api.fail[("PATCH", "/api/v1/nodes/node-1/status")]
    api.fail[("PATCH", "/api/v1/nodes/node-1")] = 409  # a concurrent change of the node
    res = sink.release(RELEASE)
    assert not res.ok and res.retry and res.detail.startswith(
        "node node-1: condition LightkeeperQuarantined=False; then HTTP 409"), res.detail
    api.fail.clear()
    rx.requests.clear()
    res = sink.release(RELEASE)
    assert res.ok and res.detail == "node node-1: condition LightkeeperQuarantined=False; " \
        "taint removed", res.detail
    (cond,) = json.loads(rx.requests[1].body)["status"]["conditions"]
    assert (cond["status"], cond["reason"]) == ("False", "Released")
    assert api.node["spec"]["taints"] == [OTHER] and api.node["spec"]["unschedulable"] is False
    rx.requests.clear()  # done: a release by hand after it finds nothing of the job's
    assert "nothing to release" in sink.release(RELEASE).detail and _patches(rx) == []
