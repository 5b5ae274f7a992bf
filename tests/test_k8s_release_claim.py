"""The ``k8s`` sink's release touches only a node that carries the job's own taint. A quarantine
refused (``claim not verified``: the rank named a node where the job runs no pod, maybe another
team's) is still followed by a release at TTL or by hand; that release must not write a
``Released`` condition onto that node, lift its taints or undo its cordon. Against the FAKE API
server of tests/test_hosts_sinks.py (none can run here), which keeps the node's taints and
annotations."""

from __future__ import annotations

import json

from tests import test_hosts_sinks

kube = test_hosts_sinks.kube
EVENT = test_hosts_sinks.EVENT
RELEASE = {**EVENT, "event": "release"}
LEGACY = {"key": "lightkeeper.io/quarantined", "value": "dead_rank", "effect": "NoSchedule"}
OTHER = {"key": "other", "value": "x", "effect": "NoExecute"}


def _patches(rx):
    return [r["path"] for r in rx.requests if r["method"] == "PATCH"]


def test_release_of_a_node_with_no_taint_of_the_job_patches_nothing(kube):
    """Another team's node, quarantined by an older version (its taint names no job) and
    cordoned by it: the refused claim's release leaves all of it as it is."""
    api, rx, sink = kube
    api.pods = {}  # no pod of the job on the node: the claim is not verified
    api.node["spec"].update(unschedulable=True, taints=[OTHER, LEGACY])
    api.node["metadata"]["annotations"] = {"lightkeeper.io/cordoned": "true"}
    before = json.loads(json.dumps(api.node))
    res = sink.quarantine(EVENT)
    assert not res.ok and "claim not verified" in res.detail, res.detail
    res = sink.release(RELEASE)
    assert res.ok, res.detail
    assert res.detail == "node node-1: no lightkeeper.io/quarantined-j taint, nothing to release"
    assert _patches(rx) == [] and api.node == before


def test_an_older_versions_taint_stays_and_holds_the_cordon(kube):
    """It names no job, so it may be another team's older monitor's quarantine: this job's
    quarantine and release leave it, and with it the cordon and the condition, as they leave
    another job's."""
    api, rx, sink = kube
    api.node["spec"]["taints"] = [OTHER, LEGACY]
    assert sink.quarantine(EVENT).ok
    rx.requests.clear()
    res = sink.release(RELEASE)
    assert res.ok and res.detail == "node node-1: taint removed; still quarantined by " \
        "lightkeeper.io/quarantined", res.detail
    assert api.node["spec"]["taints"] == [OTHER, LEGACY]
    assert api.node["spec"]["unschedulable"] is True
    assert _patches(rx) == ["/api/v1/nodes/node-1"]  # no Released condition


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
    (cond,) = json.loads(rx.requests[1]["body"])["status"]["conditions"]
    assert (cond["status"], cond["reason"]) == ("False", "Released")
    assert api.node["spec"]["taints"] == [OTHER] and api.node["spec"]["unschedulable"] is False
    rx.requests.clear()  # done: a release by hand after it finds nothing of the job's
    assert "nothing to release" in sink.release(RELEASE).detail and _patches(rx) == []
