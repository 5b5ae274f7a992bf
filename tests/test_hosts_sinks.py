"""The quarantine sinks against what they talk to: a real exec hook (a shell script), a webhook
receiver in the test that checks the HMAC signature, a stand-in ``scontrol`` on PATH (a fake:
the failure paths; a real controller on loopback checks the commands themselves) and a FAKE Kubernetes API server (no API
server can run here): a tiny HTTP server on 127.0.0.1 that records every request and answers
like the API does, so the exact patch bodies, content types, the status subresource, the pod
deletes by label and the 403/404/409 paths are checked."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lightkeeper.processes import free_port
from monitor.act.sinks import SinkConfigError, build_sink
from monitor.act.sinks.hooks import SIGNATURE_HEADER, SlurmSink, signature_matches
from monitor.config import QuarantineConfig
from tests.conftest import require_binary
from tests.support.http_stub import HttpStub

# the Slurm job the ranks run in, as the slurm sink checks a claim against: the module's
# cluster job (the ``slurm`` fixture sets it in place, so every copy of EVENT sees it), "1"
# for a stand-in scontrol/squeue
SLURM_JOBS = ["1"]
EVENT = {"event": "quarantine", "host": "h1", "node": "node-1", "devices": ["cuda:1 GPU-x"],
         "kind": "dead_rank", "reason": "1 dead_rank finding(s)", "job": "j", "at": 1.0,
         "slurm_jobs": SLURM_JOBS,
         "finding": {"id": 7, "kind": "dead_rank", "replica_group": 2}, "action_id": 1,
         "attempt": 1}


def test_exec_hook_gets_json_on_stdin_and_a_failure_is_reported(tmp_path):
    out = tmp_path / "got.json"
    script = tmp_path / "hook.sh"
    script.write_text(f'#!/bin/sh\ncat > {out}\necho "$LIGHTKEEPER_EVENT $LIGHTKEEPER_NODE" '
                      f'"[$LIGHTKEEPER_TOKEN$LIGHTKEEPER_WEBHOOK_SECRET]" "$HOOK_VAR" >> {out}.env\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    sink = build_sink(f"exec:{script}")
    with pytest.MonkeyPatch.context() as mp:  # the monitor's secrets are not the hook's
        mp.setenv("LIGHTKEEPER_TOKEN", "admin-secret")
        mp.setenv("LIGHTKEEPER_WEBHOOK_SECRET", "hmac-secret")
        mp.setenv("HOOK_VAR", "kept")
        res = sink.quarantine(EVENT)
    assert res.ok, res.detail
    assert json.loads(out.read_text()) == EVENT
    assert (tmp_path / "got.json.env").read_text().strip() == "quarantine node-1 [] kept"
    bad = build_sink("exec:sh -c 'echo disk full >&2; exit 3'").release(EVENT)
    assert not bad.ok and bad.retry and "exited 3: disk full" in bad.detail
    for absent in (f"exec:{tmp_path}/no-such-hook", f"exec:{out}"):  # missing, not executable
        with pytest.raises(SinkConfigError, match="not an executable on PATH"):
            build_sink(absent)  # said at start-up, not at the first quarantine
    script.unlink()  # gone after start-up: the attempt fails, and retrying cannot help
    missing = sink.quarantine(EVENT)
    assert not missing.ok and not missing.retry
    slow = build_sink("exec:sleep 5", QuarantineConfig(action_timeout_s=0.3)).quarantine(EVENT)
    assert not slow.ok and "did not finish within 0.3s" in slow.detail



def test_a_hook_that_hangs_is_killed_with_the_children_it_started(tmp_path):
    """--action-timeout ends the whole hook: a child it started (a curl, a kubectl) does not go
    on acting after the attempt was reported failed and retried."""
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "hook.sh"
    script.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pidfile}\nwait\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    started = time.monotonic()
    res = build_sink(f"exec:{script}", QuarantineConfig(action_timeout_s=0.5)).quarantine(EVENT)
    assert not res.ok and res.retry and "did not finish within 0.5s (killed)" in res.detail
    assert time.monotonic() - started < 5
    child = int(pidfile.read_text())
    try:
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the hook's child outlived the timeout"
    finally:
        if _alive(child):
            os.kill(child, 9)


def test_a_hook_that_leaves_a_child_running_is_judged_by_its_own_exit(tmp_path):
    """A hook that starts a background child (``sleep 30 &``) and exits 0 is done at once: the
    child held its stderr open, and the attempt waited for that EOF, was reported "did not
    finish (killed)" and retried for ever."""
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "hook.sh"
    script.write_text(f"#!/bin/sh\nsleep 30 &\necho $! > {pidfile}\necho queued >&2\nexit 0\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    started = time.monotonic()
    try:
        res = build_sink(f"exec:{script}", QuarantineConfig(action_timeout_s=3)).quarantine(EVENT)
        took = time.monotonic() - started
        assert res.ok, res.detail
        assert took < 1.5, took
        assert _alive(int(pidfile.read_text()))  # the hook's to manage: not killed
    finally:
        if pidfile.exists() and _alive(child := int(pidfile.read_text())):
            os.kill(child, 9)


def test_a_hooks_error_and_a_webhooks_answer_show_no_token(tmp_path):
    """What a hook prints (curl -v, set -x) and what a receiver answers is the attempt's detail,
    on GET /v1/hosts and in the log: only URL passwords were hidden."""
    said = ('> Authorization: Bearer tok-b1 token=tok-q2&x=1 {"secret": "tok-j3", '
            '"password":"tok-j4"} api_key: tok-k5 http://u:tok-u6@h/')
    script = tmp_path / "hook.sh"
    script.write_text(f"#!/bin/sh\ncat <<'EOF' >&2\n{said}\nEOF\nexit 2\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    hook = build_sink(f"exec:{script}").quarantine(EVENT)
    rx = HttpStub(lambda req: (403, {"error": said[:150]}))
    try:
        answer = build_sink(f"webhook:{rx.url}/h", QuarantineConfig(webhook_secret="k")
                            ).quarantine(EVENT)
    finally:
        rx.close()
    assert not hook.ok and "exited 2: > Authorization: Bearer *** token=***&x=1" in hook.detail
    assert not answer.ok and answer.detail.startswith("HTTP 403: "), answer.detail
    for secret in ("tok-b1", "tok-q2", "tok-j3", "tok-j4", "tok-k5", "tok-u6"):
        assert secret not in hook.detail, hook.detail
        assert secret not in answer.detail, answer.detail
    assert '"secret\\": \\"***\\"' in answer.detail, answer.detail  # quoted: still JSON-ish


@pytest.mark.parametrize("said", ["token" * 819, "a" * 4096, "ab" * 2048, "token " * 682])
def test_redacting_a_long_hook_error_never_stalls_the_monitor(said):
    """The redaction runs on up to 4 KiB of a hook's stderr under the GIL: unbounded repeats
    backtracked for minutes on a long word ("token" x 819: ~150 s), stopping every thread of
    the monitor. The bound is a hang guard, not a speed target (it runs in ~1 ms)."""
    from monitor.act.sinks.hooks import redact_shown

    started = time.monotonic()
    redact_shown(said + " token=tok-z9")
    assert time.monotonic() - started < 2.0
    assert "tok-z9" not in redact_shown(said[:100] + " token=tok-z9")


def _alive(pid: int) -> bool:
    """Running (a zombie was killed, only not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False

def test_webhook_signature_checked_by_the_receiver_and_errors():
    secret = "s3cret"
    status = {"code": 204}

    def respond(req):
        ok = signature_matches(secret, req.body, req.headers.get(SIGNATURE_HEADER))
        return (status["code"] if ok else 401), {}

    rx = HttpStub(respond)
    try:
        sink = build_sink(f"webhook:{rx.url}/hook", QuarantineConfig(webhook_secret=secret))
        res = sink.quarantine(EVENT)
        assert res.ok, res.detail
        req = rx.requests[-1]
        assert req.method == "POST" and req.path == "/hook"
        assert req.headers["Content-Type"] == "application/json"
        assert req.headers["X-Lightkeeper-Event"] == "quarantine"
        assert json.loads(req.body) == EVENT
        wrong = build_sink(f"webhook:{rx.url}/hook",
                           QuarantineConfig(webhook_secret="other")).quarantine(EVENT)
        assert not wrong.ok and not wrong.retry and "HTTP 401" in wrong.detail
        status["code"] = 503
        down = sink.release(EVENT)
        assert not down.ok and down.retry and "HTTP 503" in down.detail
    finally:
        rx.close()
    gone = sink.quarantine(EVENT)
    assert not gone.ok and gone.retry and "unreachable" in gone.detail
    with pytest.raises(SinkConfigError, match="secret"):
        build_sink("webhook:http://127.0.0.1:1/", QuarantineConfig())


@pytest.mark.parametrize("code", [302, 307])
def test_a_webhook_redirect_is_a_failure_never_followed(code):
    """A 302 was followed as an empty GET whose 200 made the action done; a 307 re-sent the
    signed body to wherever it pointed. Neither is followed; retrying cannot help."""
    def redirect(req):  # to here again: a followed one is seen
        return (200 if req.path.startswith("/final") else code, b"",
                {"Location": f"http://u:pw@127.0.0.1:{server.port}/final/s3cr3t?k=v"})

    with HttpStub(redirect) as server:
        url = server.url
        res = build_sink(f"webhook:{url}/hook", QuarantineConfig(webhook_secret="s")
                         ).quarantine(EVENT)
    got = [(r.method, r.target) for r in server.requests]
    assert not res.ok and not res.retry, res
    # the path (maybe the secret, as the sink's name has it), query and credentials not shown
    assert res.detail == (f"HTTP {code}: redirected to {url}/..., not followed; give the final "
                          "URL"), res.detail
    assert got == [("POST", "/hook")]


def test_a_webhook_answer_dribbled_out_is_cut_at_the_timeout():
    """A receiver that answers 500 and then sends its body a byte a second: each read kept
    within --action-timeout, so the attempt held the one action thread (every sink's) for the
    whole body. The body is read until the timeout; the attempt fails, retried."""
    class Dribble(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(500)
            self.send_header("Content-Length", "30")
            self.end_headers()
            try:
                for _ in range(30):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.5)  # the receiver's pace: what is measured is the sink's
            except OSError:
                pass  # the sink hung up

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Dribble)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        sink = build_sink(f"webhook:http://127.0.0.1:{server.server_address[1]}/hook",
                          QuarantineConfig(webhook_secret="s", action_timeout_s=1.0))
        t0 = time.monotonic()
        res = sink.quarantine(EVENT)
        took = time.monotonic() - t0
        assert not res.ok and res.retry and res.detail.startswith("HTTP 500: x"), res.detail
        assert took < 5.0, took  # the whole body: 15 s
    finally:
        server.shutdown()
        server.server_close()


def _fake_scontrol(d, state: str, reason: str = ""):
    """A stand-in ``scontrol`` on PATH keeping node-1's state as Slurm would (``show node``
    prints it, ``update`` changes it); returns the calls made, each its argv."""
    (d / "state").write_text(state)
    (d / "reason").write_text(reason)
    log = d / "argv"
    fake = d / "scontrol"
    fake.write_text(f'''#!/bin/sh
D={d}
for a in "$@"; do echo "$a"; done >> {log}; echo --- >> {log}
case "$*" in *bad-node*) echo "Invalid node name specified" >&2; exit 1;; esac
if [ "$1" = show ]; then
  printf 'NodeName=node-1 Arch=x86_64\\n   State=%s ThreadsPerCore=1\\n   Reason=%s\\n' \\
    "$(cat $D/state)" "$(cat $D/reason)"
fi
case "$3" in
  State=DRAIN) echo "$(cat $D/state)+DRAIN" > $D/state; printf %s "${{4#Reason=}}" > $D/reason;;
  State=UNDRAIN) echo IDLE > $D/state; : > $D/reason;;
esac
''')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    fake_squeue(d)
    return lambda: [c.strip().splitlines() for c in log.read_text().split("---") if c.strip()]


def fake_squeue(d) -> None:
    """A stand-in ``squeue`` in ``d``: every node runs the ranks' job."""
    fake = d / "squeue"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' {' '.join(SLURM_JOBS)}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)


def test_slurm_drain_and_resume_commands(tmp_path, monkeypatch):
    calls = _fake_scontrol(tmp_path, "IDLE")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    sink = SlurmSink()
    assert sink.quarantine(EVENT).ok
    assert sink.release(EVENT).ok
    # each update asks the node's drain first and reads it again after
    assert [c for c in calls() if c[0] != "show"] == [
        ["update", "NodeName=node-1", "State=DRAIN",
         "Reason=lightkeeper(j): dead_rank finding 7 replica_group 2"],
        ["update", "NodeName=node-1", "State=UNDRAIN"]]
    res = sink.quarantine({**EVENT, "node": "bad-node"})
    assert not res.ok and "unknown to Slurm" in res.detail
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    res = sink.quarantine(EVENT)
    assert not res.ok and not res.retry and "not found" in res.detail


@pytest.mark.parametrize("state,reason,drained", [
    ("DOWN+NOT_RESPONDING", "Not responding [slurm@2026-11-28T09:00:00]", True),
    ("DOWN", "bad PSU [root@2026-11-28T09:00:00]", False),
    # the operator's DOWN kept when Slurm marks the powered-off node not responding too
    ("DOWN+NOT_RESPONDING", "RMA 4711: bad DIMM [root@2026-11-28T09:00:00]", False),
    ("DOWN*", "RMA 4711: bad DIMM [root@2026-11-28T09:00:00]", False),
    ("DOWN*", "Not responding [slurm@2026-11-28T09:00:00]", True),
    ("IDLE+FAIL", "RMA 1234 [root@2026-11-28T09:00:00]", False),
    ("IDLE+POWERED_DOWN", "", True),
])
def test_slurm_drains_a_node_slurm_marked_down_but_not_an_operators(tmp_path, monkeypatch,
                                                                    state, reason, drained):
    """A stand-in scontrol answering ``show node`` as Slurm does: a node DOWN because slurmd
    stopped answering is drained (it stays out when it answers again); one an operator set
    DOWN or FAIL is left, its reason kept; a cloud node asleep (POWERED_DOWN) is no DOWN."""
    calls = _fake_scontrol(tmp_path, state, reason)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    res = SlurmSink().quarantine(EVENT)
    updates = [c for c in calls() if c[0] == "update"]
    assert res.ok and bool(updates) == drained, (res.detail, updates)
    if not drained:
        assert "by someone else" in res.detail and reason.split(" [")[0] in res.detail


class FakeKubeAPI:
    """The FAKE API server's state and answers: one node, pods listed by their labels (equality
    selectors) and ``spec.nodeName``."""

    JOB_POD = {"app.kubernetes.io/component": "training", "lightkeeper/job": "j"}

    def __init__(self):
        self.pods = {f"training-{i}": ("node-1", self.JOB_POD) for i in (1, 2)}  # name: (node, labels)
        self.node = {"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": "node-1", "resourceVersion": "41"},
                     "spec": {"taints": [{"key": "other", "value": "x",
                                          "effect": "NoExecute"}]}}
        self.fail: dict[tuple[str, str], int] = {}  # (method, path) -> status
        self.on_status = None  # called at a status write: another writer acting meanwhile

    def respond(self, req):
        key = (req.method, req.path)
        if key in self.fail:
            code = self.fail[key]
            return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "message": f"fake {code}", "reason": "Fake", "code": code}
        meta = self.node["metadata"]
        if req.path == "/api/v1/nodes/node-1":
            if req.method == "PATCH":  # strategic merge: null deletes an annotation
                body = json.loads(req.body)
                sent = body["metadata"].get("resourceVersion")
                if sent is not None and sent != meta["resourceVersion"]:  # optimistic lock
                    return 409, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "message": "the object has been modified", "reason": "Conflict",
                                 "code": 409}
                meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
                self.node["spec"].update(body["spec"])
                notes = self.node["metadata"].setdefault("annotations", {})
                for k, v in (body["metadata"].get("annotations") or {}).items():
                    notes.pop(k) if v is None else notes.update({k: v})
            return 200, self.node
        if req.path == "/api/v1/nodes/node-1/status":
            if req.method == "PATCH":  # a status write is a new version of the node too
                meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
                conds = self.node.setdefault("status", {}).setdefault("conditions", [])
                for c in json.loads(req.body)["status"]["conditions"]:  # merged by type
                    conds[:] = [x for x in conds if x["type"] != c["type"]] + [c]
                if self.on_status is not None:
                    self.on_status(self)
            return 200, self.node
        if req.path == "/api/v1/namespaces/train/pods" and req.method == "GET":
            want = dict(kv.split("=", 1) for q in ("labelSelector", "fieldSelector")
                        for kv in req.query.get(q, [""])[0].split(",") if kv)
            items = [{"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": name, "namespace": "train", "labels": labels},
                      "spec": {"nodeName": node, "containers": []}}
                     for name, (node, labels) in self.pods.items()
                     if {**labels, "spec.nodeName": node}.items() >= want.items()]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {},
                         "items": items}
        if req.path.startswith("/api/v1/namespaces/train/pods/"):
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                     "message": "not found", "reason": "NotFound"}


@pytest.fixture
def kube(tmp_path, monkeypatch):
    pytest.importorskip("lightkube")
    api = FakeKubeAPI()
    rx = HttpStub(api.respond)
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": rx.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u",
                                                  "namespace": "train"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    sink = build_sink("k8s", QuarantineConfig(k8s_namespace="train", action_timeout_s=5))
    yield api, rx, sink
    rx.close()


def test_k8s_quarantine_exact_requests(kube):
    api, rx, sink = kube
    res = sink.quarantine(EVENT)
    assert res.ok, res.detail
    assert "deleted 2 pod(s)" in res.detail
    reqs = [(r.method, r.path) for r in rx.requests]
    assert reqs == [("GET", "/api/v1/namespaces/train/pods"),  # the claim checked first
                    ("GET", "/api/v1/nodes/node-1"), ("PATCH", "/api/v1/nodes/node-1"),
                    ("PATCH", "/api/v1/nodes/node-1/status"),
                    ("GET", "/api/v1/namespaces/train/pods"),
                    ("DELETE", "/api/v1/namespaces/train/pods/training-1"),
                    ("DELETE", "/api/v1/namespaces/train/pods/training-2")]
    check, patch, status, pods = rx.requests[0], rx.requests[2], rx.requests[3], rx.requests[4]
    assert check.query == pods.query
    assert patch.headers["Content-Type"] == "application/strategic-merge-patch+json"
    assert json.loads(patch.body) == {
        "metadata": {"resourceVersion": "41",
                     "annotations": {"lightkeeper.io/cordoned": "true"}},
        "spec": {"unschedulable": True, "taints": [
            {"key": "other", "value": "x", "effect": "NoExecute"},
            {"key": "lightkeeper.io/quarantined-j", "value": "dead_rank",
             "effect": "NoSchedule"}]}}
    assert status.headers["Content-Type"] == "application/strategic-merge-patch+json"
    (cond,) = json.loads(status.body)["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("LightkeeperQuarantined", "True",
                                                              "DeadRank")
    assert cond["message"] == EVENT["reason"]
    assert pods.query["labelSelector"] == ["app.kubernetes.io/component=training,"
                                           "lightkeeper/job=j"]
    assert pods.query["fieldSelector"] == ["spec.nodeName=node-1"]
    assert all(r.headers.get("Authorization") == "Bearer t" for r in rx.requests)

    rx.requests.clear()
    assert sink.release({**EVENT, "event": "release"}).ok
    assert [(r.method, r.path) for r in rx.requests] == [  # the taint last: see release
        ("GET", "/api/v1/nodes/node-1"), ("PATCH", "/api/v1/nodes/node-1/status"),
        ("GET", "/api/v1/nodes/node-1"),  # read again: the status write made a new version
        ("PATCH", "/api/v1/nodes/node-1")]
    body = json.loads(rx.requests[3].body)
    assert body["spec"] == {"unschedulable": False,
                            "taints": [{"key": "other", "value": "x", "effect": "NoExecute"}]}
    assert body["metadata"]["annotations"] == {"lightkeeper.io/cordoned": None}
    (cond,) = json.loads(rx.requests[1].body)["status"]["conditions"]
    assert (cond["status"], cond["reason"]) == ("False", "Released")



def test_k8s_release_racing_another_jobs_quarantine_leaves_the_node_quarantined(kube):
    """Another job's monitor quarantines the node between this release's reads (its taint lands
    with the condition write): the cordon stays and the condition says quarantined again."""
    api, rx, sink = kube
    assert sink.quarantine(EVENT).ok

    def other_job(fake):
        fake.on_status = None
        fake.node["spec"]["taints"].append({"key": "lightkeeper.io/quarantined-other",
                                            "value": "hang", "effect": "NoSchedule"})
        fake.node["metadata"]["resourceVersion"] = str(
            int(fake.node["metadata"]["resourceVersion"]) + 1)

    api.on_status = other_job
    rx.requests.clear()
    res = sink.release({**EVENT, "event": "release"})
    assert res.ok and "still quarantined by lightkeeper.io/quarantined-other" in res.detail
    assert api.node["spec"]["unschedulable"] is True
    assert [t["key"] for t in api.node["spec"]["taints"]] == [
        "other", "lightkeeper.io/quarantined-other"]
    last_status = [r for r in rx.requests if r.path.endswith("/status")][-1]
    (cond,) = json.loads(last_status.body)["status"]["conditions"]
    assert cond["status"] == "True"


def test_k8s_release_whose_condition_fix_failed_is_put_right_by_its_retry(kube):
    """As above, and the write putting the condition back to quarantined fails: the retry
    finds this job's taint still there and sets the condition before it removes the taint."""
    api, rx, sink = kube
    assert sink.quarantine(EVENT).ok
    status = ("PATCH", "/api/v1/nodes/node-1/status")

    def other_job(fake):
        fake.on_status = None
        fake.node["spec"]["taints"].append({"key": "lightkeeper.io/quarantined-other",
                                            "value": "hang", "effect": "NoSchedule"})
        fake.fail[status] = 503  # the next status write fails

    api.on_status = other_job
    assert not sink.release({**EVENT, "event": "release"}).ok
    assert "lightkeeper.io/quarantined-j" in [t["key"] for t in api.node["spec"]["taints"]]
    del api.fail[status]
    rx.requests.clear()
    res = sink.release({**EVENT, "event": "release"})
    assert res.ok and "still quarantined by lightkeeper.io/quarantined-other" in res.detail
    assert [t["key"] for t in api.node["spec"]["taints"]] == [
        "other", "lightkeeper.io/quarantined-other"]
    (cond,) = json.loads([r for r in rx.requests if r.path.endswith("/status")][-1].body)[
        "status"]["conditions"]
    assert cond["status"] == "True"


def test_k8s_release_leaves_an_operators_cordon(kube):
    """A node an operator cordoned before the quarantine stays cordoned after its release: the
    sink uncordons only what it cordoned (the FAKE API server keeps the node's state)."""
    api, rx, sink = kube
    api.node["spec"]["unschedulable"] = True
    assert sink.quarantine(EVENT).ok
    assert sink.release({**EVENT, "event": "release"}).ok
    assert api.node["spec"]["unschedulable"] is True
    assert api.node["spec"]["taints"] == [{"key": "other", "value": "x", "effect": "NoExecute"}]
    assert not api.node["metadata"].get("annotations")

def test_k8s_quarantines_only_a_node_that_runs_a_pod_of_the_job(kube):
    """The node is the rank's claim (its NODE_NAME): a pod could name any node, another team's.
    A node with no pod of the job (none at all, or only another job's) is not patched, and the
    refusal is final; one with a pod of the job is cordoned. The FAKE API server filters pods by
    label and ``spec.nodeName`` as the real one does."""
    api, rx, sink = kube
    api.pods = {"training-1": ("node-2", FakeKubeAPI.JOB_POD),
                "other-1": ("node-1", {**FakeKubeAPI.JOB_POD, "lightkeeper/job": "other"})}
    res = sink.quarantine(EVENT)
    assert not res.ok and not res.retry, res.detail
    assert res.detail == "node node-1 runs no pod of job j: claim not verified"
    assert [(r.method, r.path) for r in rx.requests] == [
        ("GET", "/api/v1/namespaces/train/pods")]
    assert not api.node["spec"].get("unschedulable") and len(api.node["spec"]["taints"]) == 1

    api.pods["training-2"] = ("node-1", FakeKubeAPI.JOB_POD)
    res = sink.quarantine(EVENT)
    assert res.ok and "deleted 1 pod(s) on the node (training-2)" in res.detail, res.detail
    assert api.node["spec"]["unschedulable"] is True
    assert ("PATCH", "/api/v1/nodes/node-1") in [(r.method, r.path) for r in rx.requests]


def test_k8s_release_needs_no_pod_of_the_job(kube):
    """Release reads the node's own marks, not the claim: a node this sink cordoned is
    uncordoned after the job's pods are gone (deleted by the quarantine, the job ended)."""
    api, rx, sink = kube
    assert sink.quarantine(EVENT).ok
    api.pods = {}
    res = sink.release({**EVENT, "event": "release"})
    assert res.ok, res.detail
    assert api.node["spec"]["unschedulable"] is False
    assert api.node["spec"]["taints"] == [{"key": "other", "value": "x", "effect": "NoExecute"}]


def test_k8s_release_of_a_node_that_is_gone_is_done(kube):
    """The node was replaced (an autoscaler) while quarantined: nothing is left to uncordon,
    and a failed release would keep its alert firing for good."""
    api, rx, sink = kube
    api.fail[("GET", "/api/v1/nodes/node-1")] = 404
    res = sink.release({**EVENT, "event": "release"})
    assert res.ok and "gone, nothing to release" in res.detail, res.detail
    assert [(r.method, r.path) for r in rx.requests] == [("GET", "/api/v1/nodes/node-1")]


@pytest.mark.parametrize("code,retry", [(400, False), (403, False), (404, False), (409, True)])
def test_k8s_error_paths(kube, code, retry):
    api, rx, sink = kube
    api.fail[("PATCH", "/api/v1/nodes/node-1")] = code
    res = sink.quarantine(EVENT)
    assert not res.ok and res.retry is retry and f"HTTP {code}" in res.detail
    assert [r.method for r in rx.requests] == ["GET", "GET", "PATCH"]  # stopped there
    api.fail.clear()
    api.fail[("DELETE", "/api/v1/namespaces/train/pods/training-1")] = 404  # gone already
    api.fail[("DELETE", "/api/v1/namespaces/train/pods/training-2")] = code
    res = sink.quarantine(EVENT)
    assert (res.ok if code == 404 else not res.ok), res.detail
    if code != 404:
        assert "condition LightkeeperQuarantined=True; then HTTP" in res.detail


def _sbin(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") \
        or require_binary(name)


SLURM_NODES = ("n1", "n2")


@pytest.fixture(scope="module")
def slurm_cluster():
    """A real Slurm controller and two slurmd (nodes ``n1``, ``n2``) on loopback, with their own
    munged (Debian's slurmctld, slurmd, slurm-client, munge: bin/bootstrap --system), one per
    module: tests get it through ``slurm``. Root only. Its directory is traversable by
    ``nobody`` (pytest's own is 0700 under root): an unprivileged ``scontrol`` reaches munged's
    socket and slurm.conf there. Yields (environment, slurm.conf's text)."""
    binaries = {n: _sbin(n) for n in ("munged", "mungekey", "slurmctld", "slurmd")}
    require_binary("scontrol")
    if os.geteuid() != 0:
        pytest.skip("the loopback Slurm cluster runs as root (SlurmUser=root)")
    d = Path(tempfile.mkdtemp(prefix="lk-slurm-"))
    d.chmod(0o755)
    (d / "state").mkdir()
    for n in SLURM_NODES:
        (d / f"spool-{n}").mkdir()
    key, sock = d / "munge.key", d / "munge.sock"
    subprocess.run([binaries["mungekey"], "-c", "-k", str(key), "-b", "1024", "-f"],
                   check=True, capture_output=True)
    key.chmod(0o600)
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=lk
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmctldPort={free_port()}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/ctld.pid
SlurmdPidFile={d}/d-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile={d}/ctld.log
SlurmdLogFile={d}/slurmd-%n.log
""" + "".join(f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname=localhost Port={free_port()} "
              "CPUs=1 State=UNKNOWN\n" for n in SLURM_NODES)
                    + "PartitionName=p Nodes=n1,n2 Default=YES State=UP\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = [subprocess.Popen([binaries["munged"], "-F", "-f", f"--key-file={key}",
                               f"--socket={sock}", f"--pid-file={d}/munged.pid",
                               f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 15
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the socket, with a deadline
        procs.append(subprocess.Popen([binaries["slurmctld"], "-D", "-i", "-f", str(conf)],
                                      env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        for n in SLURM_NODES:
            procs.append(subprocess.Popen([binaries["slurmd"], "-D", "-N", n, "-f", str(conf)],
                                          env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        # until both slurmd registered (IDLE): a node in UNKNOWN cannot resume
        _until_nodes_idle(env, deadline, "the loopback Slurm cluster did not come up")
        yield env, conf.read_text()
    finally:
        # a job's slurmstepd outlives slurmd: cancelled, and waited for, first
        subprocess.run(["scancel", *_jobs(env)], env=env, capture_output=True)
        deadline = time.monotonic() + 15
        while procs[1:] and _jobs(env) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the controller, with a deadline
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(d, ignore_errors=True)


def _nodes(env) -> dict[str, str]:
    """Each node's ``State=`` as ``scontrol -o show node`` says, `` (reason)`` after it if it
    has one; what scontrol said instead if the controller does not answer."""
    r = subprocess.run(["scontrol", "-o", "show", "node"], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        return {"scontrol": r.stderr[-300:]}
    return {line.split()[0].split("=", 1)[1]: line.split(" State=")[1].split()[0]
            + (" (reason)" if " Reason=" in line else "") for line in r.stdout.splitlines()}


def _jobs(env) -> dict[str, str]:
    """The controller's jobs: id -> ``STATE NODES``."""
    r = subprocess.run(["squeue", "-h", "-o", "%A %T %N"], env=env, capture_output=True,
                       text=True)
    return {w[0]: " ".join(w[1:]) for w in map(str.split, r.stdout.splitlines())}


def _until_nodes_idle(env, deadline: float, why: str, state: str = "IDLE") -> None:
    while (shown := _nodes(env)) != dict.fromkeys(SLURM_NODES, state):
        if time.monotonic() > deadline:
            log = Path(env["SLURM_CONF"]).parent / "ctld.log"
            pytest.fail(f"{why} within 15 s: {shown} "
                        + (log.read_text(errors="replace")[-800:] if log.exists() else ""))
        time.sleep(0.1)  # polling the controller, with a deadline


@pytest.fixture
def slurm(slurm_cluster):
    """The module's Slurm cluster as a fresh one is: its slurm.conf as written, its nodes'
    NodeHostname localhost, and both nodes ALLOCATED to the ranks' job (``SLURM_JOBS``) with no
    reason (a drain, DOWN or FAIL an earlier test left is resumed). Its env."""
    env, text = slurm_cluster
    conf = Path(env["SLURM_CONF"])
    if conf.read_text() != text:
        conf.write_text(text)
        subprocess.run(["scontrol", "reconfigure"], env=env, check=True, capture_output=True)
    for node in SLURM_NODES:  # the controller keeps a NodeHostname a test updated
        subprocess.run(["scontrol", "update", f"NodeName={node}", "NodeHostname=localhost"],
                       env=env, capture_output=True)
    for node, state in _nodes(env).items():
        # (one still registering refuses it, and is waited for below)
        if node in SLURM_NODES and state not in ("IDLE", "ALLOCATED"):
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env,
                           capture_output=True)
    # the ranks' Slurm job on both nodes (a DOWN node killed the last one): a quarantine
    # drains only a node that runs it
    jobs = _jobs(env)
    if jobs.get(SLURM_JOBS[0]) != "RUNNING n[1-2]":
        subprocess.run(["scancel", *jobs], env=env, capture_output=True)
        _until_nodes_idle(env, time.monotonic() + 15, "the Slurm nodes were not IDLE again")
        r = subprocess.run(["sbatch", "--parsable", "-N2", "-w", "n1,n2", "-t", "15", "-D", "/",
                            "-o", "/dev/null", "--wrap", "exec sleep 900"], env=env,
                           capture_output=True, text=True, check=True)
        SLURM_JOBS[:] = [r.stdout.strip().split(";")[0]]
    _until_nodes_idle(env, time.monotonic() + 15, "the Slurm job did not run on both nodes",
                      "ALLOCATED")
    return env


def test_slurm_sink_against_a_real_controller(slurm, monkeypatch):
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)

    def node() -> str:
        return subprocess.run(["scontrol", "show", "node", "n1"], capture_output=True,
                              text=True, check=True).stdout

    sink = SlurmSink()
    res = sink.quarantine({**EVENT, "node": "n1"})
    assert res.ok, res.detail
    shown = node()
    assert "DRAIN" in shown.split("State=")[1].split()[0]
    assert "Reason=lightkeeper(j): dead_rank finding 7 replica_group 2" in shown
    rel = sink.release({**EVENT, "node": "n1"})
    assert rel.ok, (rel.detail, shown)
    assert "DRAIN" not in node().split("State=")[1].split()[0]
    bad = sink.quarantine({**EVENT, "node": "no-such-node"})
    assert not bad.ok and not bad.retry and "unknown to Slurm" in bad.detail


def test_slurm_sink_drains_one_node_never_a_hostlist_or_all(slurm, monkeypatch):
    """A node name is a rank's claim: ``ALL``, ``n[1-2]`` or ``n1,n2`` would drain every node
    past --max-quarantined; refused (not retried), and the real controller shows none drained."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    sink = SlurmSink()
    for node in ("ALL", "all", "n[1-2]", "n1,n2", "n1 n2", "-h"):
        res = sink.quarantine({**EVENT, "node": node})
        assert not res.ok and not res.retry and "not one node name" in res.detail, res.detail
    shown = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %T"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert shown == ["n1", "allocated", "n2", "allocated"]


def test_k8s_sink_sends_nothing_for_a_node_name_that_is_a_path(kube):
    """A rank's claimed node ending up in the URL: ``../namespaces/...`` would patch another
    resource; refused before any request to the (fake) API server."""
    api, rx, sink = kube
    for node in ("../namespaces/train/pods/training-1", "node-1/status", "node-1?x=y"):
        for op in (sink.quarantine, sink.release):
            res = op({**EVENT, "node": node})
            assert not res.ok and not res.retry and "not one node name" in res.detail
    assert rx.requests == []


def test_slurm_sink_leaves_an_operators_drain_alone(slurm, monkeypatch):
    """A node drained by an operator (their own reason) is neither re-labelled by a quarantine
    nor resumed by its release or TTL expiry; one the operator re-drains after ours stays too,
    and so does one the operator set FAIL."""
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)

    def node(name: str) -> tuple[bool, str]:
        out = subprocess.run(["scontrol", "show", "node", name], capture_output=True,
                             text=True, check=True).stdout
        return ("DRAIN" in out.split("State=")[1].split()[0],
                out.split("Reason=")[1].splitlines()[0].rsplit(" [", 1)[0]
                if "Reason=" in out else "")

    def state(name: str) -> str:
        out = subprocess.run(["scontrol", "show", "node", name], capture_output=True,
                             text=True, check=True).stdout
        return out.split("State=")[1].split()[0].replace("+NOT_RESPONDING", "")

    def drain(name: str, reason: str) -> None:
        subprocess.run(["scontrol", "update", f"NodeName={name}", "State=DRAIN",
                        f"Reason={reason}"], check=True)

    sink = SlurmSink()
    drain("n1", "RMA: bad DIMM")
    assert sink.quarantine({**EVENT, "node": "n1"}).ok
    assert node("n1") == (True, "RMA: bad DIMM")
    res = sink.release({**EVENT, "node": "n1"})
    assert res.ok and "left drained by someone else: RMA: bad DIMM" in res.detail
    assert node("n1") == (True, "RMA: bad DIMM")
    assert sink.quarantine({**EVENT, "node": "n2"}).ok
    drain("n2", "swap the NIC")  # after ours: the operator's now
    assert sink.release({**EVENT, "node": "n2"}).ok and node("n2") == (True, "swap the NIC")
    # FAIL (no DRAIN in its state) is the operator's too: it was drained over, its note
    # replaced, and the release UNDRAINed it back into service
    failed = "operator: failing PSU, RMA 1234"
    subprocess.run(["scontrol", "update", "NodeName=n1", "State=RESUME"], check=True)
    subprocess.run(["scontrol", "update", "NodeName=n1", "State=FAIL", f"Reason={failed}"],
                   check=True)
    before = state("n1")
    assert "FAIL" in before and "DRAIN" not in before, before
    for op in (sink.quarantine, sink.release):
        res = op({**EVENT, "node": "n1"})
        assert res.ok and f"node n1 left failed by someone else: {failed}" == res.detail, res
        assert (state("n1"), node("n1")[1]) == (before, failed)


def test_a_webhook_or_a_hook_is_named_without_its_secret_part():
    """The sink's name is shown in /v1/hosts, the metrics' ``sink`` label and the logs: a
    webhook's path (a Slack-style URL is its own secret) and a hook's arguments are not."""
    cfg = QuarantineConfig(webhook_secret="k")
    slack = build_sink("webhook:https://hooks.example.com/services/T0/B0/s3cr3t", cfg)
    assert slack.name.startswith("webhook:https://hooks.example.com...#"), slack.name
    assert "s3cr3t" not in slack.name and "services" not in slack.name
    other = build_sink("webhook:https://hooks.example.com/services/T0/B0/other", cfg)
    assert other.name != slack.name  # two URLs, two sinks
    assert build_sink("webhook:http://127.0.0.1:9/", cfg).name.startswith(
        "webhook:http://127.0.0.1:9...#")
    hook = build_sink("exec:/bin/echo --token s3cr3t")
    assert hook.name.startswith("exec:/bin/echo...#") and "s3cr3t" not in hook.name
    assert build_sink("exec:/bin/true").name == "exec:/bin/true"
