"""deploy/kubernetes/, checked offline (no cluster runs here; docs/kubernetes.md says what is not
exercised).

- The generated PrometheusRule and dashboard ConfigMaps are current (one source: the rules and
  dashboards the dashboards package builds), the rule spec passes ``promtool check rules``.
- Every Kubernetes object validates, strictly (unknown fields fail), with ``kubernetes-validate``
  against the oldest Kubernetes the manifests need (1.28: the StatefulSet pod-index label) and
  the newest it ships; pod templates inside a LeaderWorkerSet as ``PodTemplate``.
- prometheus-operator and LeaderWorkerSet objects validate against their CRDs' schemas, vendored
  in deploy/kubernetes/schemas/ (no package ships them as a schema), with unknown fields refused
  as the API server's strict field validation does. CEL rules (``x-kubernetes-validations``) are
  not evaluated.
- The wiring holds: selectors match labels, ``$(VAR)`` references resolve, URLs name Services
  and ports that exist, tokens come from a Secret, the WorkerServer binds the pod IP on a named
  port, the job's size reaches every consumer. Checked on the files as they are, and on each
  overlay rendered by kustomize 4.5.5 or later (``kustomize build`` or ``kubectl kustomize``)
  when one is on PATH (skipped otherwise, with the reason).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from conftest import IN_CI, require_binary

try:  # the test extra: bin/bootstrap installs it (kubernetes-validate brings PyYAML, jsonschema)
    import jsonschema
    import kubernetes_validate
    import yaml
except ImportError as e:
    if IN_CI:
        raise
    pytest.skip(f"{e.name} missing: pip install -e '.[test]' (bin/bootstrap does)",
                allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
KDIR = REPO / "deploy" / "kubernetes"
SCHEMAS = KDIR / "schemas"
OVERLAYS = sorted(p.parent for p in (KDIR / "overlays").glob("*/kustomization.yaml"))
K8S_VERSIONS = ("1.28.0", "1.37.0")
# created out of band: what pods and the monitor read, and the admin token the monitor alone reads
SECRETS = {"lightkeeper": {"register-token", "exit-token"}, "lightkeeper-admin": {"token"}}
MONITOR_ONLY_SECRETS = {"lightkeeper-admin"}
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}  # set by LWS' webhook
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_v1_podmonitor.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_v1_prometheusrule.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"):
        "leaderworkerset.x-k8s.io_v1_leaderworkerset.json",
}
WORKLOADS = {"Deployment", "StatefulSet", "LeaderWorkerSet"}

sys.path.insert(0, str(KDIR))
import generate  # noqa: E402

# kubernetes-validate reads and parses its schema files (the definitions are 4 MB of JSON) on
# every call: read each once in this module.
_schema_contents = kubernetes_validate.utils.schema_contents


@pytest.fixture(autouse=True)
def _cached_schemas(monkeypatch):
    monkeypatch.setattr(kubernetes_validate.utils, "schema_contents", _cached_schema_contents)


@cache
def _cached_schema_contents(filename: str, desired_version: str):
    return _schema_contents(filename, desired_version)


# --- loading ---------------------------------------------------------------------------------

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@cache
def _parsed(path: Path) -> tuple[dict, ...]:
    return tuple(d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d)


def load_docs(path: Path) -> list[dict]:
    """The documents of a YAML file (parsed once; each caller gets its own copy)."""
    return copy.deepcopy(list(_parsed(path)))


@cache
def kustomization(directory: Path) -> dict:
    return yaml.load((directory / "kustomization.yaml").read_text(), Loader=_Loader)


def resource_files(directory: Path) -> list[Path]:
    """Manifest files of a kustomization, following directories it includes."""
    out = []
    for res in kustomization(directory).get("resources", []):
        target = (directory / res).resolve()
        out += resource_files(target) if target.is_dir() else [target]
    return out


def job_configmap(overlay: Path) -> dict:
    """The overlay's lightkeeper-job ConfigMap as kustomize generates it (from its literals)."""
    gen = next(g for g in kustomization(overlay)["configMapGenerator"]
               if g["name"] == "lightkeeper-job")
    data = dict(lit.split("=", 1) for lit in gen["literals"])
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "lightkeeper-job"}, "data": data}


def unrendered(overlay: Path) -> list[dict]:
    """The overlay's objects without kustomize: its resources as written, its generated
    ConfigMap, the replacement of the workload's replicas, and its job label on pods."""
    docs = [d for f in resource_files(overlay) for d in load_docs(f)]
    cm = job_configmap(overlay)
    job = next(lab["pairs"]["lightkeeper/job"] for lab in kustomization(overlay)["labels"])
    for d in docs:
        if d["kind"] in {"StatefulSet", "LeaderWorkerSet"}:
            d["spec"]["replicas"] = int(cm["data"]["replica_groups"])
        for _, tpl in pod_templates(d):
            tpl.setdefault("metadata", {}).setdefault("labels", {})["lightkeeper/job"] = job
    return [*docs, cm]


KUSTOMIZE_MIN = (4, 5, 5)  # the overlays' labels[].includeTemplates
NO_KUSTOMIZE = ("no kustomize >= 4.5.5 on PATH (kustomize, or kubectl >= 1.25, which bundles "
                "it)")


def _version(text: str) -> tuple[int, ...] | None:
    """``v5.5.0``, ``{Version:kustomize/v4.5.7 GitCommit:...}`` -> (5, 5, 0), (4, 5, 7)."""
    m = re.search(r"v(\d+)\.(\d+)\.(\d+)", text)
    return tuple(map(int, m.groups())) if m else None


def kustomize_command() -> list[str] | None:
    """A kustomize that renders the overlays, standalone or kubectl's, or None."""
    found = shutil.which("kustomize")
    if found:
        r = subprocess.run([found, "version"], capture_output=True, text=True, timeout=30)
        if (_version(r.stdout) or (0,)) >= KUSTOMIZE_MIN:
            return [found, "build"]
    kubectl = shutil.which("kubectl")
    if kubectl:
        r = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True,
                           text=True, timeout=30)
        try:
            version = str(json.loads(r.stdout).get("kustomizeVersion", ""))
        except ValueError:
            version = ""
        if (_version(version) or (0,)) >= KUSTOMIZE_MIN:
            return [kubectl, "kustomize"]
    return None


@cache
def rendered(overlay: Path) -> tuple[dict, ...]:
    cmd = kustomize_command()
    if cmd is None:
        pytest.skip(f"{NO_KUSTOMIZE}: the overlays are checked unrendered only")
    r = subprocess.run([*cmd, str(overlay)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{' '.join(cmd)} {overlay.name}: {r.stderr}"
    return tuple(d for d in yaml.load_all(r.stdout, Loader=_Loader) if d)


def all_manifest_docs() -> list[tuple[Path, dict]]:
    files = sorted(p for p in KDIR.rglob("*.yaml") if p.name != "kustomization.yaml")
    return [(f, d) for f in files for d in load_docs(f)]


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(path, pod template) inside a workload."""
    spec = doc.get("spec", {})
    if doc["kind"] in {"Deployment", "StatefulSet"}:
        return [("spec.template", spec["template"])]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [(f"spec.leaderWorkerTemplate.{k}", lwt[k])
                for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    return []


def by_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs, kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


# --- schemas ---------------------------------------------------------------------------------

def validate_core(doc: dict, version: str) -> None:
    """kubernetes-validate, strict; a LeaderWorkerSet's pod templates as PodTemplate objects."""
    if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
        for path, tpl in pod_templates(doc):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                       "metadata": {"name": "x"}, "template": tpl}
            try:
                kubernetes_validate.validate(wrapped, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise AssertionError(f"{doc['kind']} {path}: {e.message}") from None
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}): "
                             f"{e.message} at {list(e.path)}") from None


def strict_schema(schema):
    """The CRD schema as JSON Schema, refusing unknown fields where the API server would (an
    object with properties and no x-kubernetes-preserve-unknown-fields), int-or-string as such."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "properties":
            out[k] = {name: strict_schema(sub) for name, sub in v.items()}
        elif k in ("enum", "required"):
            out[k] = v
        else:
            out[k] = strict_schema(v)
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if schema.get("nullable"):
        out.pop("type", None)
    return out


@cache
def crd_validator(api_version: str, kind: str):
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    schema = strict_schema(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict) -> list[str]:
    v = crd_validator(doc["apiVersion"], doc["kind"])
    return [f"{doc['kind']}/{doc['metadata']['name']} at "
            f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in v.iter_errors(doc)]


# --- the wiring ------------------------------------------------------------------------------

def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def check_wiring(docs: list[dict]) -> list[str]:
    """Every cross-reference between the objects; returns the problems found."""
    problems: list[str] = []
    services = {d["metadata"]["name"]: d for d in by_kind(docs, "Service")}
    configmaps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    pvcs = {d["metadata"]["name"] for d in by_kind(docs, "PersistentVolumeClaim")}
    templates = [(d, path, tpl) for d in docs if d["kind"] in WORKLOADS
                 for path, tpl in pod_templates(d)]

    def check_url(where: str, url: str) -> None:
        m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)/?", url)
        if not m:
            problems.append(f"{where}: {url!r} is not http://<service>:<port>")
            return
        svc = services.get(m.group(1))
        if svc is None:
            problems.append(f"{where}: no Service {m.group(1)!r}")
        elif int(m.group(2)) not in [p["port"] for p in svc["spec"]["ports"]]:
            problems.append(f"{where}: Service {m.group(1)} has no port {m.group(2)}")

    for d, _path, tpl in templates:
        where = f"{d['kind']}/{d['metadata']['name']}"
        labels = tpl["metadata"]["labels"]
        if "selector" in d["spec"] and not matches(d["spec"]["selector"], labels):
            problems.append(f"{where}: selector does not match its pod template")
        if "lightkeeper/job" not in labels:
            problems.append(f"{where}: pod template without the lightkeeper/job label")
        volumes = {v["name"]: v for v in tpl["spec"].get("volumes", [])}
        for v in volumes.values():
            claim = v.get("persistentVolumeClaim", {}).get("claimName")
            if claim and claim not in pvcs:
                problems.append(f"{where}: volume {v['name']} claims missing PVC {claim}")
        for c in tpl["spec"]["containers"]:
            cw = f"{where} container {c['name']}"
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    problems.append(f"{cw}: mounts undeclared volume {m['name']}")
            declared: set[str] = set(LWS_ENV if d["kind"] == "LeaderWorkerSet" else ())
            for e in c.get("env", []):
                for ref in VAR_REF.findall(e.get("value", "")):
                    if ref not in declared:
                        problems.append(f"{cw}: env {e['name']} uses $({ref}) not set before it")
                declared.add(e["name"])
                src = e.get("valueFrom", {})
                if "secretKeyRef" in src:
                    ref = src["secretKeyRef"]
                    if ref["key"] not in SECRETS.get(ref["name"], ()):
                        problems.append(f"{cw}: env {e['name']} reads unknown secret {ref}")
                    if ref["name"] in MONITOR_ONLY_SECRETS and d["metadata"]["name"] != \
                            "lightkeeper-monitor":
                        problems.append(f"{cw}: env {e['name']} reads the monitor's admin "
                                        f"Secret {ref['name']}")
                    if ref.get("optional"):
                        problems.append(f"{cw}: env {e['name']}: the secret must not be optional")
                if "configMapKeyRef" in src:
                    ref = src["configMapKeyRef"]
                    if ref["key"] not in configmaps.get(ref["name"], {}).get("data", {}):
                        problems.append(f"{cw}: env {e['name']}: no ConfigMap key {ref}")
                if "TOKEN" in e["name"] and "value" in e:
                    problems.append(f"{cw}: env {e['name']}: a token inline, not from the Secret")
            for arg in [*c.get("command", []), *c.get("args", [])]:
                for ref in VAR_REF.findall(arg):
                    if ref not in declared:
                        problems.append(f"{cw}: {arg!r} uses $({ref}), not in its env")
            env = env_of(c)
            for name in ("TORCHFT_LIGHTHOUSE", "LIGHTKEEPER_MONITOR"):
                if name in env:
                    check_url(f"{cw} {name}", env[name]["value"])
            for arg in c.get("args", []):
                if arg.startswith("--lighthouse="):
                    check_url(f"{cw} {arg}", arg.split("=", 1)[1])
    for svc in services.values():
        sel = svc["spec"].get("selector", {})
        targets = [tpl for _, _, tpl in templates if matches({"matchLabels": sel},
                                                             tpl["metadata"]["labels"])]
        if not targets:
            problems.append(f"Service/{svc['metadata']['name']}: selects no pod template")
        ports = {p["name"] for tpl in targets for c in tpl["spec"]["containers"]
                 for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            if isinstance(p.get("targetPort"), str) and p["targetPort"] not in ports:
                problems.append(f"Service/{svc['metadata']['name']}: targetPort "
                                f"{p['targetPort']} is no container port")
    for pm in by_kind(docs, "PodMonitor"):
        if not any(matches(pm["spec"]["selector"], tpl["metadata"]["labels"])
                   for d, _, tpl in templates if d["metadata"]["name"] == "training"):
            problems.append("PodMonitor: selects no training pod")
    for sm in by_kind(docs, "ServiceMonitor"):
        hits = [s for s in services.values()
                if matches(sm["spec"]["selector"], s["metadata"].get("labels", {}))]
        if [s["metadata"]["name"] for s in hits] != ["lightkeeper-monitor"]:
            problems.append(f"ServiceMonitor: selects {[s['metadata']['name'] for s in hits]}")
        for ep in sm["spec"]["endpoints"]:
            if hits and ep["port"] not in {p["name"] for p in hits[0]["spec"]["ports"]}:
                problems.append(f"ServiceMonitor: no Service port {ep['port']}")
    return problems


def training_container(docs) -> tuple[dict, dict]:
    (workload,) = [d for d in docs if d["kind"] in {"StatefulSet", "LeaderWorkerSet"}]
    (_, tpl), *_ = pod_templates(workload)
    return workload, tpl["spec"]["containers"][0]


def monitor_container(docs) -> dict:
    return named(docs, "Deployment", "lightkeeper-monitor")["spec"]["template"]["spec"][
        "containers"][0]


def check_roles(docs: list[dict]) -> None:
    """What each part must be, as the issue asks."""
    cm = named(docs, "ConfigMap", "lightkeeper-job")["data"]
    groups, min_replicas = int(cm["replica_groups"]), int(cm["min_replicas"])
    assert 1 <= min_replicas < groups, "min_replicas must leave room for an eviction"

    workload, c = training_container(docs)
    env = env_of(c)
    assert workload["spec"]["replicas"] == groups
    assert c["command"][:3] == ["lightkeeper", "run", "--"] and "torchrun" in c["command"]
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    label = {"StatefulSet": "apps.kubernetes.io/pod-index",
             "LeaderWorkerSet": "leaderworkerset.sigs.k8s.io/group-index"}[workload["kind"]]
    assert env["REPLICA_GROUP_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        f"metadata.labels['{label}']"
    assert env["LIGHTKEEPER_WORKER_HOST"]["value"] == "$(POD_IP)"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    base = int(env["LIGHTKEEPER_WORKER_PORT"]["value"])
    assert ports["lk-worker"] == base
    nproc = int(next(a.split("=")[1] for a in c["command"] if a.startswith("--nproc-per-node=")))
    assert [ports.get("lk-worker" + (f"-{i}" if i else "")) for i in range(nproc)] == \
        [base + i for i in range(nproc)], "one named port per local rank"
    assert sum(n.startswith("lk-worker") for n in ports) == nproc, "a port no rank serves is down"
    assert all(len(n) <= 15 for n in ports), "port names are at most 15 characters"
    assert workload["spec"]["template" if workload["kind"] == "StatefulSet" else
                            "leaderWorkerTemplate"] is not None
    tspec = pod_templates(workload)[0][1]["spec"]
    assert tspec["setHostnameAsFQDN"] is True
    if workload["kind"] == "StatefulSet":
        assert workload["spec"]["podManagementPolicy"] == "Parallel"
        headless = named(docs, "Service", workload["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is True
    else:
        assert workload["spec"]["leaderWorkerTemplate"]["restartPolicy"] == \
            "RecreateGroupOnPodRestart"

    m = monitor_container(docs)
    menv = env_of(m)
    assert "--bind=0.0.0.0" in m["args"]
    assert menv["LIGHTKEEPER_TOKEN"]["valueFrom"]["secretKeyRef"] == \
        {"name": "lightkeeper-admin", "key": "token"}
    assert menv["LIGHTKEEPER_REGISTER_TOKEN"]["valueFrom"]["secretKeyRef"] == \
        {"name": "lightkeeper", "key": "register-token"}
    # a training pod holds the registration token, never the admin token (README, Trust model)
    assert env["LIGHTKEEPER_REGISTER_TOKEN"]["valueFrom"]["secretKeyRef"] == \
        {"name": "lightkeeper", "key": "register-token"}
    assert "LIGHTKEEPER_TOKEN" not in env
    assert "--min-replicas=$(LIGHTKEEPER_MIN_REPLICAS)" in m["args"]
    assert menv["LIGHTKEEPER_MIN_REPLICAS"]["valueFrom"]["configMapKeyRef"]["key"] == \
        "min_replicas"
    assert menv["LIGHTKEEPER_EXPECTED_GROUPS"]["valueFrom"]["configMapKeyRef"]["key"] == \
        "replica_groups"
    state = next(a.split("=", 1)[1] for a in m["args"] if a.startswith("--state="))
    mount = next(v["mountPath"] for v in m["volumeMounts"] if v["name"] == "state")
    assert state.startswith(mount + "/"), "the SQLite state lives on the PVC"
    mon = named(docs, "Deployment", "lightkeeper-monitor")
    assert mon["spec"]["replicas"] == 1 and mon["spec"]["strategy"]["type"] == "Recreate"

    lh = named(docs, "Deployment", "torchft-lighthouse")
    lc = lh["spec"]["template"]["spec"]["containers"][0]
    assert lc["command"] == ["torchft_lighthouse"]
    assert "--min_replicas=$(TORCHFT_MIN_REPLICAS)" in lc["args"]
    assert env_of(lc)["TORCHFT_MIN_REPLICAS"]["valueFrom"]["configMapKeyRef"]["key"] == \
        "min_replicas"
    assert {p["port"] for p in named(docs, "Service", "torchft-lighthouse")["spec"]["ports"]} \
        == {29510}
    # the Lighthouse's timeouts: one ConfigMap key each, read by the Lighthouse and the monitor
    for key, lh_flag, mon_flag in (
            ("heartbeat_timeout_ms", "--heartbeat_timeout_ms", "--lighthouse-heartbeat-timeout-ms"),
            ("join_timeout_ms", "--join_timeout_ms", "--lighthouse-join-timeout-ms")):
        assert int(cm[key]) > 0
        for cont, flag in ((lc, lh_flag), (m, mon_flag)):
            (arg,) = [a for a in cont["args"] if a.startswith(flag + "=")]
            var = VAR_REF.fullmatch(arg.split("=", 1)[1]).group(1)
            assert env_of(cont)[var]["valueFrom"]["configMapKeyRef"]["key"] == key


# --- tests -----------------------------------------------------------------------------------

def test_generated_manifests_are_current():
    assert generate.stale_files() == [], "run python deploy/kubernetes/generate.py"


def test_prometheus_rule_spec_is_rules_yml_and_dashboards_are_the_generated_json():
    (rule,) = load_docs(generate.PROMETHEUS_RULE)
    assert rule["spec"] == yaml.safe_load(generate.RULES_YML.read_text())
    cms = load_docs(generate.DASHBOARD_CONFIGMAPS)
    files = sorted(generate.DASHBOARDS_DIR.glob("*.json"))
    assert len(cms) == len(files) == 3
    for cm, f in zip(cms, files, strict=True):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["data"] == {f.name: f.read_text()}
        assert len(json.dumps(cm)) < 256 * 1024, "fits kubectl's client-side apply annotation"


def test_generate_check_names_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "prometheusrule.yaml"
    stale.write_text(generate.PROMETHEUS_RULE.read_text().replace("for: 1m", "for: 5m", 1))
    monkeypatch.setattr(generate, "PROMETHEUS_RULE", stale)
    monkeypatch.setattr(generate, "DASHBOARD_CONFIGMAPS", tmp_path / "dashboards.yaml")
    assert generate.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "stale: " in err and "prometheusrule.yaml" in err and "dashboards.yaml" in err
    assert generate.main([]) == 0 and generate.main(["--check"]) == 0
    assert stale.read_text() == generate.expected_files()[stale]


def test_generate_refuses_a_rules_file_it_cannot_read():
    with pytest.raises(generate.SourceError, match="groups:"):
        generate.prometheus_rule("# only a comment\nrules: []\n")
    with pytest.raises(generate.SourceError, match="uid"):
        generate.dashboard_configmap(generate.DASHBOARDS_DIR / "x.json", '{"title": "t"}\n')


def test_generate_names_a_source_that_is_not_utf8(tmp_path):
    bad = tmp_path / "zz.json"
    bad.write_bytes(b'\xff\xfe{"uid": 1}\n')
    with pytest.raises(generate.SourceError, match="zz.json: not UTF-8"):
        generate._read(bad)


def test_promtool_checks_the_prometheus_rule_spec(tmp_path):
    exe = require_binary("promtool")
    (rule,) = load_docs(generate.PROMETHEUS_RULE)
    spec = tmp_path / "rules.yml"
    spec.write_text(yaml.safe_dump(rule["spec"]))
    r = subprocess.run([exe, "check", "rules", str(spec)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"SUCCESS: \d+ rules found", r.stdout + r.stderr)


def test_every_manifest_is_in_a_kustomization_and_every_resource_exists():
    listed = set()
    for k in KDIR.rglob("kustomization.yaml"):
        for res in kustomization(k.parent).get("resources", []):
            target = (k.parent / res).resolve()
            assert target.exists(), f"{k.relative_to(REPO)}: {res} does not exist"
            listed.add(target)
    manifests = {p.resolve() for p in KDIR.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert manifests - listed == set()
    assert {o.name for o in OVERLAYS} == {"single-node", "multi-node"}
    for overlay in OVERLAYS:
        res = kustomization(overlay)["resources"]
        assert "../../base" in res and "../../monitoring" in res


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_objects_validate_with_kubernetes_validate(version):
    docs = all_manifest_docs()
    assert len(docs) >= 14
    for _, doc in docs:
        validate_core(doc, version)


def test_custom_resources_validate_against_the_vendored_crd_schemas():
    checked = set()
    for _, doc in all_manifest_docs():
        if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
            assert crd_errors(doc) == []
            checked.add(doc["kind"])
    assert checked == {"PodMonitor", "ServiceMonitor", "PrometheusRule", "LeaderWorkerSet"}


def test_the_schema_checks_catch_mistakes():
    """A misspelled field, a wrong type and a missing required field fail each check."""
    docs = {d["kind"]: d for _, d in all_manifest_docs()}
    pm = copy.deepcopy(docs["PodMonitor"])
    pm["spec"]["podMetricsEndpoints"][0]["honorLabel"] = True
    assert any("honorLabel" in e for e in crd_errors(pm))
    rule = copy.deepcopy(docs["PrometheusRule"])
    del rule["spec"]["groups"][0]["name"]
    assert crd_errors(rule)
    lws = copy.deepcopy(docs["LeaderWorkerSet"])
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateEverything"
    assert crd_errors(lws)
    lws = copy.deepcopy(docs["LeaderWorkerSet"])
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["portz"] = []
    with pytest.raises(AssertionError, match="portz"):
        validate_core(lws, K8S_VERSIONS[0])
    sts = copy.deepcopy(docs["StatefulSet"])
    sts["spec"]["replicas"] = "4"
    with pytest.raises(AssertionError):
        validate_core(sts, K8S_VERSIONS[0])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_wiring_unrendered(overlay):
    docs = unrendered(overlay)
    assert check_wiring(docs) == []
    check_roles(docs)


def test_the_wiring_check_catches_mistakes():
    docs = unrendered(KDIR / "overlays" / "single-node")
    broken = copy.deepcopy(docs)
    _, c = training_container(broken)
    env_of(c)["TORCHFT_LIGHTHOUSE"]["value"] = "http://lighthouse:29510"
    env_of(c)["LIGHTKEEPER_WORKER_HOST"]["value"] = "$(POD_ADDRESS)"
    m = monitor_container(broken)
    env_of(m)["LIGHTKEEPER_TOKEN"].pop("valueFrom")
    env_of(m)["LIGHTKEEPER_TOKEN"]["value"] = "s3cret"
    # a training pod given the admin token
    env_of(c)["LIGHTKEEPER_REGISTER_TOKEN"]["valueFrom"]["secretKeyRef"] = \
        {"name": "lightkeeper-admin", "key": "token"}
    problems = "\n".join(check_wiring(broken))
    assert "no Service 'lighthouse'" in problems
    assert "$(POD_ADDRESS)" in problems
    assert "LIGHTKEEPER_TOKEN: a token inline" in problems
    assert "LIGHTKEEPER_REGISTER_TOKEN reads the monitor's admin Secret" in problems


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_renders_validates_and_is_wired(overlay):
    docs = list(rendered(overlay))
    namespace = kustomization(overlay)["namespace"]
    job = next(lab["pairs"]["lightkeeper/job"] for lab in kustomization(overlay)["labels"])
    for d in docs:
        assert d["metadata"].get("namespace") == namespace, d["metadata"]["name"]
        assert d["metadata"]["labels"]["lightkeeper/job"] == job
        if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS:
            assert crd_errors(d) == []
        validate_core(d, K8S_VERSIONS[0])  # the files as written are checked at both
    assert check_wiring(docs) == []
    check_roles(docs)
    images = {c["image"] for d in docs for _, t in pod_templates(d)
              for c in t["spec"]["containers"]}
    assert images == {f"{i['newName']}:{i['newTag']}" for i in kustomization(overlay)["images"]}


# `torchft_lighthouse` is torchft's Rust main (clap) behind `from torchft._torchft import ...`,
# which imports torch first. Load the extension module alone and call the same main.
LIGHTHOUSE_MAIN = """
import importlib.util as u, sys
from pathlib import Path
so = next(Path(u.find_spec("torchft").submodule_search_locations[0]).glob("_torchft*.so"))
spec = u.spec_from_file_location("torchft._torchft", so)
m = u.module_from_spec(spec)
spec.loader.exec_module(m)
sys.exit(m.lighthouse_main())
"""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a command-line argument."""
    return VAR_REF.sub(lambda m: env[m.group(1)], text)


def container_env(c: dict, configmap: dict, extra: dict[str, str] | None = None) -> dict:
    """The values a container's env would hold (ConfigMap keys resolved, others made up)."""
    out: dict[str, str] = dict(extra or {})
    for e in c.get("env", []):
        src = e.get("valueFrom", {})
        if "configMapKeyRef" in src:
            out[e["name"]] = configmap["data"][src["configMapKeyRef"]["key"]]
        elif "value" in e:
            out[e["name"]] = expand(e["value"], out)
        else:
            out[e["name"]] = {"POD_IP": "10.0.0.7", "NODE_NAME": "node-a"}.get(e["name"], "x")
    return out


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_the_programs_accept_the_manifests_command_lines(overlay, monkeypatch, tmp_path):
    """The monitor's, the Lighthouse's and `lightkeeper run`'s own argument parsers take the
    command lines as Kubernetes would expand them (the Lighthouse: torchft's real main, which
    refuses a misspelled flag)."""
    import argparse

    from lightkeeper import run as lk_run
    from monitor import cli as monitor_cli

    docs = unrendered(overlay)
    cm = named(docs, "ConfigMap", "lightkeeper-job")

    m = monitor_container(docs)
    env = container_env(m, cm)
    monkeypatch.setenv("LIGHTKEEPER_TOKEN", env["LIGHTKEEPER_TOKEN"])
    monkeypatch.setenv("LIGHTKEEPER_REGISTER_TOKEN", env["LIGHTKEEPER_REGISTER_TOKEN"])
    p = argparse.ArgumentParser()
    monitor_cli.add_arguments(p)
    cfg = monitor_cli.config_from_args(p.parse_args([expand(a, env) for a in m["args"]]))
    assert (cfg.bind, cfg.port, cfg.token, cfg.register_token) == ("0.0.0.0", 19400, "x", "x")
    assert cfg.rails.min_replicas == int(cm["data"]["min_replicas"])
    assert cfg.expected_groups == int(cm["data"]["replica_groups"])
    assert cfg.lighthouse_heartbeat_timeout_ms == int(cm["data"]["heartbeat_timeout_ms"])

    lh = named(docs, "Deployment", "torchft-lighthouse")["spec"]["template"]["spec"][
        "containers"][0]
    args = [expand(a, container_env(lh, cm)) for a in lh["args"]]
    script = tmp_path / "torchft_lighthouse"  # a file: the Rust main drops only argv[0]
    script.write_text(LIGHTHOUSE_MAIN)
    for extra, ok in (([], True), (["--heartbeat_timeout=1000"], False)):
        r = subprocess.run([sys.executable, str(script), *args, *extra, "--help"],
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode == 0) == ok, r.stdout + r.stderr
    assert all(int(a.split("=")[1]) > 0 for a in args if not a.startswith("--bind"))

    _, t = training_container(docs)
    env = container_env(t, cm, {v: "1" for v in LWS_ENV})
    command = [expand(a, env) for a in t["command"]]
    p = argparse.ArgumentParser()
    lk_run.add_arguments(p)
    ns = p.parse_args(command[2:])
    assert ns.cmd[:2] == ["--", "torchrun"] and ns.cmd[-1] == "/app/train.py"
    # torchrun's own parser is not run: importing it imports torch (20 s and more under load)


def test_network_policies_select_the_pods_and_ports_they_name():
    """The opt-in policies: each selects pods of the deployment, each in-namespace peer matches
    pods, and the ports they open are the ports those pods serve on."""
    policies = load_docs(KDIR / "network-policy" / "network-policy.yaml")
    docs = unrendered(KDIR / "overlays" / "single-node")
    templates = [tpl for d in docs for _, tpl in pod_templates(d)]

    def selected(selector: dict) -> list[dict]:
        return [t for t in templates if matches(selector, t["metadata"]["labels"])]

    assert {p["metadata"]["name"] for p in policies} == \
        {"torchft-lighthouse", "lightkeeper-monitor", "training"}
    for pol in policies:
        pods = selected(pol["spec"]["podSelector"])
        assert pods, pol["metadata"]["name"]
        served = {p["containerPort"] for t in pods for c in t["spec"]["containers"]
                  for p in c.get("ports", [])}
        for rule in pol["spec"]["ingress"]:
            for peer in rule["from"]:
                if "namespaceSelector" not in peer:
                    assert selected(peer["podSelector"]), (pol["metadata"]["name"], peer)
            for port in rule.get("ports", []):
                opened = set(range(port["port"], port.get("endPort", port["port"]) + 1))
                assert opened <= served, (pol["metadata"]["name"], opened - served)
    _, c = training_container(docs)
    worker_ports = {p["containerPort"] for p in c["ports"] if p["name"].startswith("lk-worker")}
    training = next(p for p in policies if p["metadata"]["name"] == "training")
    scrape = training["spec"]["ingress"][1]["ports"][0]
    assert set(range(scrape["port"], scrape["endPort"] + 1)) == worker_ports


def relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus' `replace` and `keep` relabeling, as the PodMonitor's camelCase rules read
    (anchored regex, ';' separator, replacement $1). Written here to test the rules' logic:
    no Prometheus or prometheus-operator runs."""
    labels = dict(labels)
    for c in configs:
        value = c.get("separator", ";").join(labels.get(s, "") for s in c.get("sourceLabels", []))
        m = re.fullmatch(c.get("regex", "(.*)"), value)
        action = c.get("action", "replace")
        if action == "keep":
            if not m:
                return None
        elif action == "replace":
            if m:
                labels[c["targetLabel"]] = m.expand(
                    c.get("replacement", "$1").replace("$1", r"\g<1>") if m.groups()
                    else c.get("replacement", ""))
        else:
            raise AssertionError(f"relabel action {action} not emulated")
    return labels


@pytest.mark.parametrize("kustomize,kubectl,want", [
    ("v4.5.4", "v4.5.4", None),  # kubectl 1.24's: no labels[].includeTemplates
    ("{Version:kustomize/v4.5.4 GitCommit:cf3a452}", "", None),
    ("{Version:kustomize/v4.5.5 GitCommit:daa3e5e}", "", "kustomize"),
    ("v5.5.0", "v5.5.0", "kustomize"),
    ("v3.10.0", "v4.5.7", "kubectl"),  # an old standalone one, kubectl 1.25's is new enough
    (None, "v4.5.7", "kubectl"),
    (None, "", None),  # kubectl 1.20: kustomize 2, no version in the JSON
])
def test_kustomize_command_requires_4_5_5(monkeypatch, kustomize, kubectl, want):
    """Stand-in ``kustomize version`` and ``kubectl version`` answers (no binary runs)."""
    monkeypatch.setattr(shutil, "which", lambda name: f"/x/{name}" if name == "kubectl" or
                        kustomize is not None else None)

    def run(argv, **kw):
        out = kustomize if argv[0] == "/x/kustomize" else json.dumps(
            {"clientVersion": {}, **({"kustomizeVersion": kubectl} if kubectl else {})})
        return subprocess.CompletedProcess(argv, 0, out, "")
    monkeypatch.setattr(subprocess, "run", run)
    got = kustomize_command()
    assert (got[0].removeprefix("/x/") if got else None) == want, got


def test_podmonitor_relabeling_keeps_worker_ports_and_names_the_replica_group():
    (pm,) = load_docs(KDIR / "monitoring" / "podmonitor.yaml")
    rules = pm["spec"]["podMetricsEndpoints"][0]["relabelings"]
    port, pod_index, group_index = ("__meta_kubernetes_pod_container_port_name",
                                    "__meta_kubernetes_pod_label_apps_kubernetes_io_pod_index",
                                    "__meta_kubernetes_pod_label_leaderworkerset_sigs_k8s_io_"
                                    "group_index")
    ready, phase = "__meta_kubernetes_pod_ready", "__meta_kubernetes_pod_phase"
    node = {"__meta_kubernetes_pod_node_name": "gpu-17", ready: "true", phase: "Running"}
    sts = relabel({port: "lk-worker-3", pod_index: "5", **node}, rules)
    assert (sts["replica_group"], sts["lightkeeper_component"], sts["node"]) == \
        ("5", "worker", "gpu-17")
    # an LWS worker pod: its StatefulSet pod-index is its place in the group, not the group
    lws = relabel({port: "lk-worker", pod_index: "1", group_index: "2", **node}, rules)
    assert lws["replica_group"] == "2"
    assert relabel({port: "lk-worker-7", **node}, rules) is not None
    for other in ("store", "lk-workers", "metrics", ""):
        assert relabel({port: other, pod_index: "0", **node}, rules) is None, other
    # a pod still starting (Pending with an IP: pulling its image; Running with local rank 0's
    # WorkerServer not answering its readiness probe yet) is no target: no LightkeeperRankDown
    for state in ({ready: "false", phase: "Pending"}, {ready: "false", phase: "Running"}):
        assert relabel({port: "lk-worker", pod_index: "0", **node, **state}, rules) is None, state


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_two_jobs_with_quarantine_keep_their_own_cluster_scoped_rbac(overlay, tmp_path):
    """Two copies of an overlay in two namespaces, the quarantine component on: their
    ClusterRoles and ClusterRoleBindings (cluster-wide names) differ, so applying or deleting
    one job never rebinds or removes the other's; the rest stays wired. Rendered by kustomize
    only (no API server runs here)."""
    if kustomize_command() is None:
        pytest.skip(NO_KUSTOMIZE)
    cluster_scoped: dict[str, set[tuple[str, str]]] = {}
    for ns in ("job-a", "job-b"):
        copy_dir = tmp_path / ns
        shutil.copytree(KDIR, copy_dir)
        k = copy_dir / "overlays" / overlay.name / "kustomization.yaml"
        text = k.read_text()
        assert "# components:\n#   - ../../quarantine\n" in text
        k.write_text(text.replace("# components:\n#   - ../../quarantine\n",
                                  "components:\n  - ../../quarantine\n")
                     .replace("namespace: torchft-example\n", f"namespace: {ns}\n"))
        r = subprocess.run([*kustomize_command(), str(k.parent)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        docs = [d for d in yaml.load_all(r.stdout, Loader=_Loader) if d]
        assert check_wiring(docs) == []
        roles = {d["metadata"]["name"] for d in by_kind(docs, "ClusterRole")}
        for b in by_kind(docs, "ClusterRoleBinding"):
            assert b["roleRef"]["name"] in roles, "the binding names its own ClusterRole"
            assert b["subjects"][0]["namespace"] == ns
        cluster_scoped[ns] = {(d["kind"], d["metadata"]["name"]) for d in docs
                              if d["kind"] in {"ClusterRole", "ClusterRoleBinding"}}
        assert len(cluster_scoped[ns]) == 2
    assert cluster_scoped["job-a"].isdisjoint(cluster_scoped["job-b"]), cluster_scoped


def test_every_container_requests_cpu_and_memory_and_gains_no_privilege():
    """A pod without cpu and memory requests is BestEffort: the first the kubelet evicts and the
    OOM killer picks under memory pressure, the training pods included (a GPU limit does not
    count). No container may gain privileges (setuid, privileged)."""
    checked = []
    for _, d in all_manifest_docs():
        for path, tpl in pod_templates(d):
            for c in tpl["spec"]["containers"]:
                where = f"{d['kind']}/{d['metadata']['name']} {path} {c['name']}"
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get("requests", {})), where
                sc = c.get("securityContext", {})
                assert sc.get("allowPrivilegeEscalation") is False, where
                assert not sc.get("privileged"), where
                checked.append(where)
    assert len(checked) == 4, checked  # Lighthouse, monitor, StatefulSet and LWS trainers


def test_trainer_readiness_probe_asks_local_rank_0s_worker_server():
    """Without a readiness probe a trainer is Ready when its container starts, so a rolling
    update replaces group after group before any has rejoined. The probe names local rank 0's
    port, and a real WorkerServer (127.0.0.1, an ephemeral port) answers its path with 200."""
    import requests

    from worker_server import RankIdentity, RankState, WorkerServer

    paths = set()
    for overlay in OVERLAYS:
        _, c = training_container(unrendered(overlay))
        probe = c["readinessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports[probe["port"]] == int(env_of(c)["LIGHTKEEPER_WORKER_PORT"]["value"])
        paths.add(probe["path"])
    srv = WorkerServer(RankState(RankIdentity(job="probe")), host="127.0.0.1", port=0).serve()
    try:
        for path in paths:
            assert requests.get(srv.url + path, timeout=10).status_code == 200, path
    finally:
        srv.stop()
