"""The command and HTTP sinks: an exec hook (``exec:CMD``, the event's JSON on stdin), Slurm
(``scontrol update``, one argv entry per word, no shell) and a signed webhook (``webhook:URL``,
HMAC-SHA256 of the body). Contract and retries: docs/quarantine.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests

from http_serving import redact_url

from ...config import url_host_port
from .base import ActionResult, SinkConfigError, event_shard, one_node, sink_name

SIGNATURE_HEADER = "X-Lightkeeper-Signature"
MONITOR_SECRETS = ("LIGHTKEEPER_TOKEN", "LIGHTKEEPER_REGISTER_TOKEN", "LIGHTKEEPER_EXIT_TOKEN",
                   "LIGHTKEEPER_WEBHOOK_SECRET")
# the URLs whose password a deployment keeps in the environment (docs/monitor.md, Trust model)
MONITOR_URLS = ("TORCHFT_LIGHTHOUSE", "LIGHTKEEPER_ETCD")
EVENT_HEADER = "X-Lightkeeper-Event"
SCONTROL, SQUEUE = "scontrol", "squeue"
# a requeued job waits on no node, and may run on its old one again (str.startswith: REQUEUED,
# REQUEUE_HOLD, REQUEUE_FED); SPECIAL_EXIT is requeued and held too
REQUEUED = ("PENDING", "CONFIGURING", "REQUEUE", "SPECIAL_EXIT")

log = logging.getLogger(__name__)


def event_bytes(event: dict[str, Any]) -> bytes:
    return json.dumps(event, sort_keys=True, default=str).encode()


def sign(secret: str, body: bytes) -> str:
    """The signature header's value for ``body``: ``sha256=<hex>``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def signature_matches(secret: str, body: bytes, header: str | None) -> bool:
    """For receivers: constant-time check of a signature header."""
    return bool(header) and hmac.compare_digest(sign(secret, body), header)


# secrets a hook's stderr (curl -v, set -x) or a receiver's answer may echo, also JSON-escaped
_BEARER = re.compile(r"\b(Bearer)(\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
# every repeat bounded and the name anchored: unbounded ones backtracked for seconds on a long
# word, holding the GIL
_SECRET_FIELD = re.compile(
    r"""((?:\\?["'])?(?<![\w.-])[\w.-]{0,64}?"""
    r"""(?:token|secret|passw(?:or)?d|api[_-]?key|authorization)[\w.-]{0,64}"""
    r"""(?:\\?["'])?\s{0,16}[:=]\s{0,16})((?:Bearer|Basic|Token)\s+)?"""
    r"""(\\"(?:(?!\\").){0,1024}(?:\\"|$)|"[^"]{0,1024}(?:"|$)|'[^']{0,1024}(?:'|$)"""
    r"""|[^\s"',;&}\\]{1,1024})""",
    re.IGNORECASE)  # a value cut short (an answer's first 200 bytes) ends at the end


def _field(m: re.Match) -> str:
    quote = re.match(r"""\\?["']|""", m[3])[0]  # kept: a quoted value stays quoted
    return f"{m[1]}{m[2] or ''}{quote}***{quote if m[3].endswith(quote) else ''}"


def redact_shown(text: str) -> str:
    """``text`` from outside (a hook's stderr, a webhook's answer) as /v1/hosts and the log
    show it: URL passwords, ``Bearer <token>`` and the values of fields named for a secret
    (``token=``, ``"password": ...``) as ``***``."""
    text = redact_url(text) or ""
    return _SECRET_FIELD.sub(_field, _BEARER.sub(r"\1\2***", text))


def run_command(argv: list[str], shown: str, timeout_s: float, stdin: bytes | None = None,
                env: dict[str, str] | None = None) -> tuple[ActionResult, str]:
    """One run of ``argv`` (no shell) in a session of its own, killed with all it started after
    ``timeout_s``; ``shown``: how the detail names it. Returns the result and the command's
    stderr tail; never raises."""
    # files, not pipes: a child the command leaves running (``sleep 30 &``) keeps a pipe open,
    # and waiting for its EOF would judge a hook that exited 0 by a process it did not wait for
    with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as ferr:
        fin.write(stdin or b"")
        fin.seek(0)
        try:
            p = subprocess.Popen(argv, stdin=fin, stdout=subprocess.DEVNULL, stderr=ferr,
                                 env=env, start_new_session=True)
        except FileNotFoundError:
            return ActionResult(False, f"{argv[0]} not found", retry=False), ""
        except OSError as e:  # a file that is not executable: retrying cannot help
            return ActionResult(False, f"cannot run {argv[0]!r}: {e}",
                                retry=not isinstance(e, PermissionError)), ""
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:  # a hook's children too: none acts after its failure
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return ActionResult(False, f"{shown} did not finish within {timeout_s:g}s "
                                       "(killed)"), ""
        ferr.seek(max(0, ferr.seek(0, os.SEEK_END) - 4096))
        raw = ferr.read()
    # shown on /v1/hosts and in the log: a password or token in a hook's error is not
    err = redact_shown(raw.decode(errors="replace")).strip()[-300:]
    if p.returncode == 0:
        return ActionResult(True, f"{shown} exited 0"), err
    return ActionResult(False, f"{shown} exited {p.returncode}: {err}"), err


class ExecSink:
    per_job = False

    def __init__(self, command: str, timeout_s: float = 10.0) -> None:
        self.argv = shlex.split(command)  # not empty: validate_action said so
        # two hooks of one program are two sinks; its arguments may hold a secret: not shown
        self.name = sink_name("exec", command, self.argv[0] if len(self.argv) > 1 else command)
        self.timeout_s = timeout_s

    def run(self, event: dict[str, Any]) -> ActionResult:
        # the monitor's own secrets stay with it: a hook acts on a host, not on the monitor
        env = {**{k: redact_url(v) if k in MONITOR_URLS else v for k, v in os.environ.items()
                  if k not in MONITOR_SECRETS},
               "LIGHTKEEPER_EVENT": str(event.get("event")),
               "LIGHTKEEPER_HOST": str(event.get("host")),
               "LIGHTKEEPER_NODE": str(event.get("node") or event.get("host"))}
        return run_command(self.argv, self.argv[0], self.timeout_s, event_bytes(event), env)[0]

    quarantine = release = run


class SlurmSink:
    """Drain the node on quarantine, undrain it on release, but never touch a node drained with
    another reason; needs ``scontrol`` on PATH and a Slurm user allowed to update nodes. The
    reason names the jobs whose monitors drained the node: it is undrained once none is left."""

    name = "slurm"
    per_job = True

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s

    def quarantine(self, event: dict[str, Any]) -> ActionResult:
        f = event.get("finding") or {}
        what = f"finding {f['id']}" if f.get("id") is not None else ""
        if f.get("replica_group") is not None:
            what = f"{what} replica_group {f['replica_group']}".strip()
        return self._run(event, f"{event.get('kind')} {what}".strip())

    def release(self, event: dict[str, Any]) -> ActionResult:
        # UNDRAIN lifts only the drain: a node set DOWN stays down, one resumed already is fine
        return self._run(event, None)

    def _run(self, event: dict[str, Any], what: str | None) -> ActionResult:
        try:
            node = one_node(event)  # a hostlist or ALL would drain many nodes past the cap
        except ValueError as e:
            return ActionResult(False, str(e), retry=False)
        found = self._find(node)
        if found is None and what is None:
            found = self._alias(node, str(event.get("job") or ""), event.get("undoes"))
        if isinstance(found, ActionResult):
            return found
        if found is None:  # known by neither name
            if what is None:  # nothing drained there, as for k8s's release of a deleted node
                return ActionResult(True, f"node {node} unknown to Slurm, nothing to release")
            # no update: Slurm takes a NodeHostname there, draining a node no read-back finds
            return ActionResult(False, f"node {node} unknown to Slurm by that name or its first "
                                       "label; give the ranks NODE_NAME=$SLURMD_NODENAME",
                                retry=False)
        node, held, reason = found
        m = DRAINED_BY.fullmatch(reason or "")
        if held is not None and (held == "failed" or m is None):
            # an operator's drain, DOWN or FAIL is theirs to lift: neither overwritten (their
            # reason is their note) nor resumed
            return ActionResult(True, f"node {node} left {held} by someone else: "
                                      f"{reason or '(no reason given)'}")
        if what is not None:  # a release only lifts this job's own entry: no claim to check
            unverified = self._runs_job(node, event.get("slurm_jobs") or [])
            if unverified is not None:
                return unverified
        raw = str(event.get("job") or "")
        job, folded = slurm_job(raw), _fold(raw)
        # shards of one job hold their own quarantines: each lists its own entry, so one's
        # release leaves another's drain
        shard = event_shard(event)
        keyed = f"{job}/shard{shard}" if shard else job
        jobs = _jobs(m)
        quarantine = what is not None
        if quarantine:
            mine = keyed
            jobs.add(keyed)
        else:  # another job's quarantine of the node stays, named without this job's finding
            # an older version wrote the job alone, unsharded, or its fold alone (``team_a``
            # for ``team/a``): that entry is this job's only while its own is absent (with it,
            # the fold is job team_a's)
            mine = next((j for j in (keyed, job) if j in jobs), folded)
            if jobs and mine not in jobs:  # released already, or never this job's drain
                detail = (f"node {node} drained by {','.join(sorted(jobs))}, not by job "
                          f"{raw}{f' shard {shard}' if shard else ''}: left as it is")
                shards = sorted(j for j in jobs if re.fullmatch(rf"{re.escape(job)}/shard\d+", j))
                if shards:  # another shard's, or an older version's under a changed --shard
                    log.warning("node %s: job %s's %s, listed under another --shard, keeps it "
                                "drained: only that shard's release lifts it; if no monitor "
                                "runs it, lift it by hand (docs/quarantine.md)", node, raw,
                                ",".join(shards))
                    detail += (f"; {','.join(shards)}, job {raw}'s under another --shard, is "
                               "only that shard's release to lift (see docs/quarantine.md)")
                return ActionResult(True, detail)
            jobs.discard(mine)
            what = f"still quarantined by {','.join(sorted(jobs))}" if jobs else None
        args = ["State=UNDRAIN"] if what is None else \
            ["State=DRAIN", f"Reason=lightkeeper({','.join(sorted(jobs))}): {what}"]
        argv = [SCONTROL, "update", f"NodeName={node}", *args]
        res, err = run_command(argv, " ".join(argv), self.timeout_s)
        res.retry = res.retry and not _for_good(err)
        if not res.ok:
            return res
        # show then update is no transaction: another job's monitor may have written its own
        # list meanwhile, dropping this job or keeping it; the retry merges again
        after = self._find(node)
        if isinstance(after, ActionResult):
            return after
        now = after[2] if after else None
        if (mine in _jobs(DRAINED_BY.fullmatch(now or ""))) != quarantine:
            return ActionResult(False, f"node {node} changed meanwhile, its reason now: "
                                       f"{now or '(none)'}")
        if what is None and _down_as_ours(self._show(node)):
            # Slurm set it DOWN while drained (the host dropped off) and kept the drain's
            # reason, and ReturnToService=1 returns only "Not responding": its own reason is
            # unknown (a reboot would keep it DOWN), so it is said, not resumed
            log.warning("node %s undrained but still DOWN with Lightkeeper's reason: resume it "
                        "once healthy (docs/quarantine.md)", node)
            res.detail += (f"; node {node} still DOWN with this reason, which Slurm's "
                           "ReturnToService=1 never returns: once it is healthy, scontrol "
                           f"update NodeName={node} State=RESUME")
        return res

    def _runs_job(self, node: str, ids: list) -> ActionResult | None:
        """None when Slurm lists one of the ranks' jobs ``ids`` on ``node``, else the failed
        attempt: a rank's claim (a misset NODE_NAME, a stale one, a first label naming another
        cluster's node) must not drain another user's node. As k8s checks for a pod. Retried
        while one of them waits requeued, on no node yet: it may come back there."""
        ids = {str(i) for i in ids}
        on = self._squeue("-w", node)
        if isinstance(on, ActionResult):
            return on
        if any(ids & keys for keys, _, _ in on):
            return None
        asked = sorted(i for i in ids if re.fullmatch(r"[0-9]{1,20}", i))  # argv: numbers only
        known = self._squeue(f"--jobs={','.join(asked)}") if asked else []
        if isinstance(known, ActionResult):
            return known
        seen = [(state, shown) for keys, state, shown in known if ids & keys]
        named = ",".join(sorted(ids)) or "(none reported)"
        said = f", Slurm shows job {'; '.join(s for _, s in seen)}" if seen else \
            ", unknown to Slurm" if ids else ""
        if any(state.startswith(REQUEUED) for state, _ in seen):
            return ActionResult(False, f"node {node} runs no job {named} of this job now{said}: "
                                       "retried while it waits", retry=True)
        p = self._show(node)
        flags, why = ([], "") if isinstance(p, ActionResult) or p.returncode else \
            _state(p.stdout)
        down = f" (DOWN: {why or 'no reason given'})" if "DOWN" in flags else ""
        # a job that left a failed node reads as a misclaim: its operator tells them apart
        hint = "; if the job ran there, drain it by hand" if seen or down else ""
        return ActionResult(False, f"node {node}{down} runs no job {named} of this job{said}: "
                                   f"claim not verified{hint}", retry=False)

    def _squeue(self, *which: str) -> list[tuple[set[str], str, str]] | ActionResult:
        """Slurm's jobs ``which`` selects in any state (one that ended, its rank dead or its node
        failed, is listed for MinJobAge): the ids a rank may report for each (a heterogeneous
        job's part ``15`` is ``14+1``, its ranks' SLURM_JOB_ID ``14``), its state, and how the
        detail shows it; or the failed attempt."""
        argv = [SQUEUE, "-h", "-t", "all", *which, "-o", "%A %i %T %N"]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, errors="replace",
                               timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return ActionResult(False, f"cannot read the node's jobs: {' '.join(argv)} did not "
                                       f"finish within {self.timeout_s:g}s (killed)")
        except (OSError, subprocess.SubprocessError) as e:
            return ActionResult(False, f"cannot read the node's jobs: {e}",
                                retry=not isinstance(e, (PermissionError, FileNotFoundError)))
        if "Invalid job id" in p.stderr:  # -j with one id, unknown to Slurm, exits 1
            return []
        if p.returncode:
            err = redact_shown(p.stderr.strip() or p.stdout).strip()[-300:]
            return ActionResult(False, f"cannot read the node's jobs: {' '.join(argv)} exited "
                                       f"{p.returncode}: {err}",
                                retry=not _for_good(f"{p.stdout}\n{p.stderr}"))
        rows = [w + [""] * (4 - len(w)) for w in map(str.split, p.stdout.splitlines()) if w]
        return [({w[0], w[1].partition("+")[0]} - {""}, w[2], f"{w[1] or w[0]} {w[2]} on "
                 f"{w[3] or 'no node'}") for w in rows]

    def _find(self, node: str) -> tuple[str, str | None, str | None] | ActionResult | None:
        """(Slurm's name of ``node``, possibly its FQDN's first label; how it is held:
        ``failed``/``drained``/``down``/None; the reason it is held with), None for a node
        Slurm knows by neither name, or the failed attempt when the state cannot be read: an
        update on an unread state could lift or overwrite someone else's drain."""
        for name in dict.fromkeys((node, node.split(".")[0])):
            p = self._show(name)
            if isinstance(p, ActionResult):
                return p
            if f"NodeName={name} " not in p.stdout:
                said = f"{p.stdout}\n{p.stderr}"  # Slurm 22.05 says "not found" on stdout
                if p.returncode == 0 or f"Node {name} not found" in said \
                        or "Invalid node name" in said:
                    continue  # no such node: its first label next, or the update says why
                return _unread(p)
            return (name, *_held(p.stdout))
        return None

    def _alias(self, node: str, raw: str, undoes: dict | None
               ) -> tuple[str, str | None, str | None] | ActionResult | None:
        """For a release: the node an older version drained through ``node``, its NodeHostName
        (``update`` takes that, ``show`` does not; a NodeAddr neither), as ``_find`` says it,
        if its reason is a Lightkeeper drain listing this job or no job; else None. Where
        several nodes carry that name, or the quarantine the release undoes (``undoes``, the
        event's) was not done, the release done with nothing updated."""
        p = self._show()
        if isinstance(p, ActionResult):
            return p
        if p.returncode:
            return _unread(p)
        carry, found = [], None
        for out in p.stdout.split("\n\n"):
            names = dict(re.findall(r"\b(NodeName|NodeHostName)=(\S+)",
                                    out.partition("Reason=")[0]))
            if names.get("NodeHostName") != node:
                continue
            carry.append(names["NodeName"])
            held, reason = _held(out)
            m = DRAINED_BY.fullmatch(reason or "")
            if m and (m[1] is None or _jobs(m) & {slurm_job(raw), _fold(raw)}):
                found = names["NodeName"], held, reason
        status = (undoes or {}).get("status")
        if found and (len(carry) > 1 or status != "done"):
            # which one the update drained is unknown, or no update was sent (this version's
            # quarantine of such a name fails unsent): the drain found may be a node's own
            # quarantine, still held. Done, not failed: failed, it stays so while that holds
            nodes = ",".join(carry)
            why = f"is ambiguous: the NodeHostName of {nodes}" if len(carry) > 1 else \
                f"is the NodeHostName of {nodes} and its quarantine here was not done " \
                f"({status or 'none tried'})"
            log.warning("node %s is the NodeHostName of %s: an older version's drain through "
                        "it, if any, is left to the operator: scontrol show node <n>; lift a "
                        "lightkeeper(...) reason of job %s by hand (docs/quarantine.md)",
                        node, nodes, slurm_job(raw))
            return ActionResult(True, f"node {node} {why}; nothing done: an older version's "
                                      "drain, if any, is left to lift by hand (see "
                                      "docs/quarantine.md)")
        return found

    def _show(self, *names: str) -> subprocess.CompletedProcess | ActionResult:
        """``scontrol show node [names]``, or the failed attempt when it could not run."""
        argv = [SCONTROL, "show", "node", *names]
        try:
            return subprocess.run(argv, capture_output=True, text=True, errors="replace",
                                  timeout=self.timeout_s)
        except FileNotFoundError:
            return ActionResult(False, f"{SCONTROL} not found", retry=False)
        except subprocess.TimeoutExpired:
            return ActionResult(False, f"cannot read node state: {' '.join(argv)} did not "
                                       f"finish within {self.timeout_s:g}s (killed)")
        except (OSError, subprocess.SubprocessError) as e:
            return ActionResult(False, f"cannot read node state: {e}",
                                retry=not isinstance(e, PermissionError))


def _unread(p: subprocess.CompletedProcess) -> ActionResult:
    said = f"{p.stdout}\n{p.stderr}"
    err = redact_shown(p.stderr.strip() or p.stdout).strip()[-300:]
    return ActionResult(False, f"cannot read node state: {' '.join(p.args)} exited "
                               f"{p.returncode}: {err}", retry=not _for_good(said))


def _held(out: str) -> tuple[str | None, str | None]:
    """How the node ``scontrol show node`` printed in ``out`` is held
    (``failed``/``drained``/``down``/None), and the reason it is held with."""
    flags, reason = _state(out)
    # DOWN with no reason or Slurm's own "Not responding" is no one's: drained, so it
    # stays out when it answers again; an operator's reason is still theirs
    down = "DOWN" in flags and not (
        not reason or reason.startswith("Not responding") or DRAINED_BY.fullmatch(reason))
    held = ("failed" if any(f.startswith("FAIL") for f in flags) else
            "drained" if any(f.startswith("DRAIN") for f in flags) else
            "down" if down else None)
    return held, reason if held else None


def _down_as_ours(p: subprocess.CompletedProcess | ActionResult) -> bool:
    """``scontrol show node`` says the node is DOWN with a Lightkeeper reason."""
    if isinstance(p, ActionResult) or p.returncode:
        return False
    flags, reason = _state(p.stdout)
    return "DOWN" in flags and bool(DRAINED_BY.fullmatch(reason))


def _state(out: str) -> tuple[list[str], str]:
    """The flags of the node ``scontrol show node`` printed in ``out`` (``DOWN*`` as
    ``DOWN``) and its reason, without who set it when."""
    # IDLE+DRAIN, DOWN+DRAIN+NOT_RESPONDING, FAIL, MIXED+FAIL, DRAINING: word by word,
    # as POWERED_DOWN (a cloud node asleep) is no DOWN
    flags = "".join(out.partition("State=")[2].split(maxsplit=1)[:1]).split("+")
    reason = out.partition("Reason=")[2].split("\n")[0].rsplit(" [", 1)[0].strip()
    return [f.rstrip("*") for f in flags], reason


def _jobs(m: re.Match | None) -> set[str]:
    """The jobs a drain's reason (matched by DRAINED_BY) lists."""
    return set(filter(None, (m[1] or "").split(","))) if m else set()


def _for_good(err: str) -> bool:
    """An unknown node stays unknown, a Slurm user not allowed to read or update nodes
    (``PrivateData=nodes``) stays so: no retry mends them."""
    return any(e in err for e in ("Invalid node name", "Invalid user id", "permission denied",
                                  "Access/permission denied"))


def _fold(job: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", job)


def slurm_job(job: str) -> str:
    """The job's name in a drain's reason, ``lightkeeper(<name>,...)``: folded to
    ``[A-Za-z0-9_.-]`` and, where that changed it (``team/a``), suffixed with a hash."""
    folded = _fold(job)
    return folded if folded == job else \
        f"{folded}-{hashlib.sha256(job.encode()).hexdigest()[:8]}"


# a drain's reason as the slurm sink writes it: the jobs that drained the node, then why
DRAINED_BY = re.compile(r"lightkeeper(?:\(([^)]*)\))?: ?(.*)", re.S)


class WebhookSink:
    per_job = False

    def __init__(self, url: str, secret: str | None, timeout_s: float = 10.0) -> None:
        if not secret:
            raise SinkConfigError("webhook: a signing secret is required (--webhook-secret or "
                                  "LIGHTKEEPER_WEBHOOK_SECRET)")
        self.url = url
        # scheme and host are shown, a path (often the secret) is not
        self.name = sink_name("webhook", url, f"{urlsplit(url).scheme}://{url_host_port(url)}")
        self._secret = secret
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def post(self, event: dict[str, Any]) -> ActionResult:
        body = event_bytes(event)
        headers = {"Content-Type": "application/json", EVENT_HEADER: str(event.get("event")),
                   SIGNATURE_HEADER: sign(self._secret, body)}
        deadline = time.monotonic() + self.timeout_s
        try:
            # streamed: a receiver dribbling its answer must not hold the one action thread;
            # no redirect: a 302 would become an empty GET, a 307 re-send the signed body
            with self._session.post(self.url, data=body, headers=headers, stream=True,
                                    timeout=self.timeout_s, allow_redirects=False) as r:
                if 200 <= r.status_code < 300:
                    return ActionResult(True, f"HTTP {r.status_code}")
                if 300 <= r.status_code < 400:
                    return ActionResult(False, f"HTTP {r.status_code}: "
                                               f"{self._redirect(r.headers.get('Location'))}",
                                        retry=False)
                text = b""
                for chunk in r.iter_content(64):
                    text += chunk
                    if len(text) >= 200 or time.monotonic() >= deadline:
                        break
        except requests.Timeout:
            return ActionResult(False, f"no answer within {self.timeout_s:g}s")
        except requests.RequestException as e:
            return ActionResult(False, f"unreachable: {type(e).__name__}")
        retry = r.status_code >= 500 or r.status_code in (408, 429)
        shown = redact_shown(text[:200].decode("utf-8", "replace"))
        return ActionResult(False, f"HTTP {r.status_code}: {shown}", retry=retry)

    def _redirect(self, location: str | None) -> str:
        try:
            to = urlsplit(urljoin(self.url, location or ""))
        except ValueError:  # a Location that is no URL (``http://[x``)
            location = None
        if not location:
            return "a redirect, not followed; give the final URL"
        # shown like the sink's name: a path (an http -> https redirect keeps a Slack-style
        # URL's secret path) and credentials are not
        path = "/..." if to.path not in ("", "/") else ""
        return (f"redirected to {to.scheme}://{url_host_port(to.geturl())}{path}, not "
                "followed; give the final URL")

    quarantine = release = post
