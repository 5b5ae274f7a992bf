"""deploy/kubernetes/quarantine/ (the opt-in component for ``--action k8s``) rendered into both
example overlays with kustomize: the monitor runs as the component's ServiceAccount with its
token mounted and ``--action=k8s``, which the monitor's parser accepts; the RBAC grants exactly
the requests the Kubernetes sink makes (monitor/act/sinks/kubernetes.py), bound in the job's
namespace. Skipped without kustomize (kustomize, or kubectl >= 1.21) outside CI."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from monitor.act.sinks.kubernetes import (
    DEFAULT_POD_SELECTOR,
    JOB_LABEL,
    RBAC_CLUSTER,
    RBAC_NAMESPACE,
)
from monitor.cli import add_arguments, config_from_args
from tests.conftest import IN_CI

KDIR = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"


def _kustomize() -> list[str]:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if IN_CI:
        pytest.fail("no kustomize or kubectl on PATH")
    pytest.skip("no kustomize or kubectl on PATH")


def _rules(doc: dict) -> dict[str, tuple[str, ...]]:
    out = {}
    for rule in doc["rules"]:
        assert rule["apiGroups"] == [""]
        for res in rule["resources"]:
            out[res] = tuple(rule["verbs"])
    return out


@pytest.mark.parametrize("overlay", ["single-node", "multi-node"])
def test_quarantine_component_renders_into_the_overlays(tmp_path, overlay):
    cmd = _kustomize()
    copy = tmp_path / "kubernetes"
    shutil.copytree(KDIR, copy)
    k = copy / "overlays" / overlay / "kustomization.yaml"
    text = k.read_text()
    assert "# components:\n#   - ../../quarantine\n" in text  # offered, commented out
    k.write_text(text.replace("# components:\n#   - ../../quarantine\n",
                              "components:\n  - ../../quarantine\n"))
    r = subprocess.run([*cmd, str(k.parent)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    ns = yaml.safe_load(text)["namespace"]
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    mon = by[("Deployment", "lightkeeper-monitor")]["spec"]["template"]["spec"]
    assert mon["serviceAccountName"] == "lightkeeper-monitor"
    assert mon["automountServiceAccountToken"] is True
    args = mon["containers"][0]["args"]
    assert args[-1] == "--action=k8s"
    assert by[("ServiceAccount", "lightkeeper-monitor")]["metadata"]["namespace"] == ns
    cluster_name = f"lightkeeper-monitor-quarantine-{ns}"  # cluster-wide: one per namespace
    assert _rules(by[("ClusterRole", cluster_name)]) == RBAC_CLUSTER
    assert _rules(by[("Role", "lightkeeper-monitor-quarantine")]) == RBAC_NAMESPACE
    for kind, name in (("ClusterRoleBinding", cluster_name),
                       ("RoleBinding", "lightkeeper-monitor-quarantine")):
        b = by[(kind, name)]
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "lightkeeper-monitor",
                                  "namespace": ns}]
        assert b["roleRef"]["name"] == name
    # the sink's default selector (its --job from the monitor pod's label) finds the job's pods
    job = by[("Deployment", "lightkeeper-monitor")]["spec"]["template"]["metadata"]["labels"][
        JOB_LABEL]
    want = {**dict(p.split("=") for p in DEFAULT_POD_SELECTOR.split(",")), JOB_LABEL: job}
    pods = [t for d in docs if d["kind"] in ("StatefulSet", "LeaderWorkerSet")
            for t in (d["spec"].get("template"),
                      d["spec"].get("leaderWorkerTemplate", {}).get("workerTemplate")) if t]
    assert pods and all(want.items() <= t["metadata"]["labels"].items() for t in pods)
    # the monitor's parser takes the component's flag (the env references as Kubernetes
    # would expand them are checked by test_deploy_kubernetes; here only --action matters)
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--state", str(tmp_path / "s.sqlite"), "--action=k8s"]))
    assert cfg.quarantine.actions == ("k8s",)
