"""Kubernetes sink: cordon and taint the quarantined node, say why in a node condition, and
delete the job's pods on it so their controller reschedules them elsewhere. A node that runs no
pod of the job is left alone: the node is what a rank claims.

Needs ``lightkeeper[kubernetes]`` (lightkube) and a cluster configuration; RBAC in
``deploy/kubernetes/quarantine/``. Each step is idempotent, the first failure ends the attempt;
release acts only on a node with the job's taint and uncordons only a node the quarantine
cordoned. 400, 401, 403, 404 and 422 are not retried; a 404 in release is done (node gone).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from typing import Any

from .base import ActionResult, SinkConfigError, event_shard, one_node

log = logging.getLogger(__name__)

TAINT_KEY = "lightkeeper.io/quarantined"  # an older version's names no job: lifted by hand
SHARD_TAINT = re.compile(re.escape(TAINT_KEY) + r"\.shard([0-9]+)-.*")
CORDONED = "lightkeeper.io/cordoned"  # annotation: the cordon is ours to undo
CONDITION = "LightkeeperQuarantined"
DEFAULT_POD_SELECTOR = "app.kubernetes.io/component=training"
JOB_LABEL = "lightkeeper/job"  # the job's name on its pods (deploy/kubernetes/overlays)
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# every request this sink makes as RBAC rules, (resource, verbs) (tests/test_hosts_deploy.py)
RBAC_CLUSTER = {"nodes": ("get", "patch"), "nodes/status": ("patch",)}
RBAC_NAMESPACE = {"pods": ("list", "delete")}


def taint_value(kind: str) -> str:
    """A label-value-safe form of the finding kind (taint values follow label value rules)."""
    v = re.sub(r"[^A-Za-z0-9_.-]", "_", kind or "quarantined")[:63].strip("_.-")
    return v or "quarantined"


def taint_key(job: str, shard: str = "") -> str:
    """The job's own taint key, ``lightkeeper.io/quarantined-<job>``, so two jobs quarantine a
    node each on its own; shard I's (``--shard I/N``) is ``quarantined.shard<I>-<job>``, which no
    job's name can make. A name changed to fit ends in a hash of the whole name."""
    tag = f".shard{shard}" if shard else ""
    room = 51 - len(tag)  # a key's name is at most 63 characters
    part = taint_value(job)[:room].rstrip("_.-")
    if job and part != job:
        part = f"{part[:room - 9]}-{hashlib.sha256(job.encode()).hexdigest()[:8]}"
    return f"{TAINT_KEY}{tag}-{part}"


class KubernetesSink:
    name = "k8s"
    per_job = True

    def __init__(self, client: Any, namespace: str, pod_selector: str | None = None) -> None:
        self.client = client
        self.namespace = namespace
        self._labels = _selector(pod_selector or DEFAULT_POD_SELECTOR)  # bad: fails at start-up
        self._by_job = not pod_selector  # the default selects the event's job's pods only

    @classmethod
    def from_env(cls, namespace: str | None = None, pod_selector: str | None = None,
                 timeout_s: float = 10.0) -> KubernetesSink:
        try:
            import lightkube
            from lightkube.config.kubeconfig import KubeConfig
        except ImportError:
            raise SinkConfigError("--action k8s needs lightkube: pip install "
                                  "'lightkeeper[kubernetes]'") from None
        try:
            config = KubeConfig.from_env()
        except Exception as e:  # no service account, no kubeconfig
            raise SinkConfigError(f"--action k8s: no Kubernetes configuration "
                                  f"(in-cluster, KUBECONFIG or ~/.kube/config): {e}") from None
        client = lightkube.Client(config=config, timeout=timeout_s,
                                  field_manager="lightkeeper-monitor")
        if not namespace:
            try:
                with open(SA_NAMESPACE) as f:
                    namespace = f.read().strip()
            except OSError:
                namespace = os.environ.get("POD_NAMESPACE") or client.namespace
        return cls(client, namespace, pod_selector)

    def quarantine(self, event: dict[str, Any]) -> ActionResult:
        try:
            node = one_node(event)  # a name with a '/' would patch another path
        except ValueError as e:
            return ActionResult(False, str(e), retry=False)
        kind, job = str(event.get("kind") or "quarantined"), str(event.get("job") or "")
        done: list[str] = []
        try:
            # the node is the rank's own claim: act only where the job has a pod, or any pod
            # could get another team's node cordoned
            if not self._job_pods(node, job):
                return ActionResult(False, f"node {node} runs no pod of job {job or '?'}: "
                                    "claim not verified", retry=False)
            self._patch_node(node, self._get_node(node), taint_key(job, event_shard(event)),
                             taint_value(kind))
            done.append("cordoned and tainted")
            self._set_condition(node, True, _reason(kind), str(event.get("reason") or kind))
            done.append(f"condition {CONDITION}=True")
            deleted = self._delete_pods(node, job)
            done.append(f"deleted {len(deleted)} pod(s) on the node"
                        + (f" ({', '.join(deleted)})" if deleted else ""))
        except Exception as e:
            return self._failure(node, done, e)
        return ActionResult(True, f"node {node}: " + "; ".join(done))

    def release(self, event: dict[str, Any]) -> ActionResult:
        try:
            node = one_node(event)  # a name with a '/' would patch another path
        except ValueError as e:
            return ActionResult(False, str(e), retry=False)
        job, shard = str(event.get("job") or ""), event_shard(event)
        key = taint_key(job, shard)
        done: list[str] = []
        try:
            obj = self._get_node(node)
            # an older version's taint for the whole job is a shard's to lift while its own is not
            if shard and key not in (keys := _quarantine_keys(obj)) and taint_key(job) in keys:
                key = taint_key(job)
            # the job's taint is its only mark (the cordon and the condition are every job's):
            # without it the quarantine never happened (a claim not verified: maybe another
            # team's node) or this release is done, and nothing on the node is this job's
            if key not in (t.get("key") for t in _taints(obj)):
                detail = f"node {node}: no {key} taint, nothing to release"
                if TAINT_KEY in _quarantine_keys(obj):  # perhaps this job's, before an upgrade
                    # said, not failed: another team's would fail every release for good
                    log.warning("node %s: an older version's %s taint holds it; no release "
                                "lifts it: lift it by hand (docs/quarantine.md)", node, TAINT_KEY)
                    detail += (f"; an older version's {TAINT_KEY} holds it: lift it by hand "
                               "(see docs/quarantine.md)")
                # the job's taint of another shard index: another shard's, or one an older
                # version set under a --shard since changed (it kept no shard with the host)
                if shards := sorted(k for k in _quarantine_keys(obj) if (
                        m := SHARD_TAINT.fullmatch(k)) and k == taint_key(job, m[1])):
                    log.warning("node %s: job %s's %s, set under another --shard, holds it: "
                                "only that shard's release lifts it; if no monitor runs it, "
                                "lift it by hand (docs/quarantine.md)", node, job,
                                ", ".join(shards))
                    detail += (f"; job {job}'s {', '.join(shards)}, set under another --shard, "
                               "holds it: only that shard's release lifts it (see "
                               "docs/quarantine.md)")
                return ActionResult(True, detail)
            released = not [k for k in _quarantine_keys(obj) if k != key]
            if released:
                # the condition before the taint: a retry after a failure finds the taint
                self._set_condition(node, False, "Released",
                                    str(event.get("reason") or "released"))
                done.append(f"condition {CONDITION}=False")
                # read again: the status write made a new version, and the patch names its own
                obj = self._get_node(node)
            if others := [k for k in _quarantine_keys(obj) if k != key]:
                # another quarantine stays (or came meanwhile): its condition, not this job's,
                # before the taint goes, so a retry after a failure still finds the taint
                self._set_condition(node, True, "Quarantined",
                                    f"still quarantined by {', '.join(others)}")
                obj = self._get_node(node)
                if not [k for k in _quarantine_keys(obj) if k != key]:
                    # they left meanwhile: the True just written is stale; the retry releases
                    return ActionResult(False, f"node {node}: the node changed meanwhile")
                self._patch_node(node, obj, key, None)
                done.append(f"taint removed; still quarantined by {', '.join(others)}")
            else:
                self._patch_node(node, obj, key, None)
                done.append("taint removed")
        except Exception as e:
            if _status(e) == 404:  # the node is gone (replaced): nothing left to release
                return ActionResult(True, f"node {node}: gone, nothing to release")
            return self._failure(node, done, e)
        return ActionResult(True, f"node {node}: " + "; ".join(done))

    def _get_node(self, node: str) -> Any:
        from lightkube.resources.core_v1 import Node

        return self.client.get(Node, node)

    def _patch_node(self, node: str, obj: Any, key: str, taint: str | None) -> None:
        """Set (``taint``) or remove (None) the job's taint ``key`` on ``obj``, the node as read,
        and cordon, or uncordon once no quarantine taint is left."""
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        taints = [t for t in _taints(obj) if t.get("key") != key]
        if taint is not None:
            taints.append({"key": key, "value": taint, "effect": "NoSchedule"})
        cordon = any(str(t.get("key")).startswith(TAINT_KEY) for t in taints)
        spec: dict[str, Any] = {"taints": taints}
        meta: dict[str, Any] = {"resourceVersion": obj.metadata.resourceVersion}
        # only undo our own cordon: one an operator made before stays
        if cordon and not (obj.spec and obj.spec.unschedulable):
            spec["unschedulable"], meta["annotations"] = True, {CORDONED: "true"}
        elif not cordon and (obj.metadata.annotations or {}).get(CORDONED):
            spec["unschedulable"], meta["annotations"] = False, {CORDONED: None}
        body = {"metadata": meta, "spec": spec}
        self.client.patch(Node, node, body, patch_type=PatchType.STRATEGIC)

    def _set_condition(self, node: str, on: bool, reason: str, message: str) -> None:
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # RFC 3339
        cond = {"type": CONDITION, "status": "True" if on else "False", "reason": reason,
                "message": message[:1000], "lastHeartbeatTime": now, "lastTransitionTime": now}
        self.client.patch(Node.Status, node, {"status": {"conditions": [cond]}},
                          patch_type=PatchType.STRATEGIC)

    def _job_pods(self, node: str, job: str) -> list[str]:
        """The names of the job's pods (the pod selector) bound to ``node``."""
        from lightkube.resources.core_v1 import Pod

        labels = {**self._labels, JOB_LABEL: job} if self._by_job else self._labels
        return [p.metadata.name for p in self.client.list(
            Pod, namespace=self.namespace, labels=labels, fields={"spec.nodeName": node})]

    def _delete_pods(self, node: str, job: str) -> list[str]:
        from lightkube.resources.core_v1 import Pod

        deleted = []
        for name in self._job_pods(node, job):  # listed again: the cordon keeps new ones out
            try:
                self.client.delete(Pod, name, namespace=self.namespace)
                deleted.append(name)
            except Exception as e:
                if _status(e) != 404:  # gone already: fine
                    raise
        return deleted

    @staticmethod
    def _failure(node: str, done: list[str], e: Exception) -> ActionResult:
        code = _status(e)
        what = f"HTTP {code}: {e}" if code else f"{type(e).__name__}: {e}"
        prefix = f"node {node}: " + ("; ".join(done) + "; then " if done else "")
        return ActionResult(False, prefix + what, retry=code not in (400, 401, 403, 404, 422))


def _taints(obj: Any) -> list[dict[str, Any]]:
    return [t.to_dict() if hasattr(t, "to_dict") else dict(t)
            for t in (obj.spec.taints or [])] if obj.spec else []


def _quarantine_keys(obj: Any) -> list[str]:
    """The node's quarantine taints, every job's and an older version's."""
    return [k for k in (str(t.get("key")) for t in _taints(obj)) if k.startswith(TAINT_KEY)]


def _reason(kind: str) -> str:
    """A condition reason is CamelCase by convention: ``dead_rank`` -> ``DeadRank``."""
    return "".join(p.capitalize() for p in re.split(r"[^A-Za-z0-9]+", kind) if p) or "Quarantined"


def _selector(text: str) -> dict[str, str]:
    """``a=b,c=d`` -> {"a": "b", "c": "d"} (equality selectors only)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep or not k.strip():
            raise SinkConfigError(f"pod selector {text!r}: expected key=value[,key=value]")
        out[k.strip()] = v.strip().lstrip("=")
    return out


def _status(e: Exception) -> int | None:
    resp = getattr(e, "response", None)
    return getattr(resp, "status_code", None)
