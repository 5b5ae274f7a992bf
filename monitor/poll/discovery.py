"""Which ranks the monitor polls: static ``--targets``, a Prometheus ``file_sd`` file and
``POST /v1/targets`` registrations (docs/monitor.md). Thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from http_serving import host_for_url, redact_entry, redact_url

from ..config import ConfigError
from ..locks import LockHeld, file_id, pid_lock
from .torch_target import PREFIX

log = logging.getLogger(__name__)


class BadTarget(ValueError):
    """A target address or registration body the monitor cannot use."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_url(message))  # it names the address: never its password


class TooManyTargets(Exception):
    """The monitor already knows ``max_targets`` targets."""


class OtherJob(Exception):
    """A rank of another training job: its metrics and groups would be labelled as this one's."""


MAX_URL = 2048
MAX_LABEL = 256  # a job name in a registration


def normalize_url(address: str) -> str:
    """``host:port`` or ``http://host:port[/prefix][/]`` -> ``http://host:port[/prefix]``
    (``torch+http://...`` keeps its ``torch+``); raises BadTarget."""
    address = address.strip()
    if not address:
        raise BadTarget("empty target address")
    if address.startswith(PREFIX):
        url = normalize_url(address[len(PREFIX):])
        if not url.startswith("http://"):
            raise BadTarget(f"target {redact_url(address)!r}: torch's debug server speaks "
                            "http only")
        return PREFIX + url
    if "://" not in address:
        address = "http://" + address
    shown = redact_url(address)  # each refusal quotes it: a secret in it is not repeated
    netloc = address.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
    if not netloc.startswith("[") and netloc.count(":") > 1:
        raise BadTarget(f"target {shown!r}: an IPv6 address needs brackets, "
                        "e.g. http://[::1]:9500")
    try:
        parts = urlsplit(address)
    except ValueError as e:  # e.g. an unbalanced or invalid bracketed host
        raise BadTarget(f"target {shown!r} is not http://host:port: {e}") from None
    if parts.scheme == "https":  # accepted, it would be refused at every poll: never watched
        raise BadTarget(f"target {shown!r}: https is not supported (ranks are polled over "
                        "plain http): give the rank's http:// address, terminate TLS elsewhere")
    # torch+http:// is a rank on torch's own server (monitor/poll/torch_target.py)
    if parts.scheme not in ("http", PREFIX + "http") or not parts.hostname:
        raise BadTarget(f"target {shown!r} is not http://host:port or "
                        f"{PREFIX}http://host:port (a rank on torch's server)")
    try:
        port = parts.port
    except ValueError:
        raise BadTarget(f"target {shown!r} has a bad port") from None
    if port is None:
        raise BadTarget(f"target {shown!r} has no port")
    host = host_for_url(unquote(parts.hostname))  # an IPv6 literal back in its brackets
    if parts.query or parts.fragment:
        raise BadTarget(f"target {shown!r} has a query or fragment")
    return f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"


def _opt_int(value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise BadTarget(f"expected an integer, got {value!r}") from None


def _read_file_sd(path: str, ours: bool = False) -> tuple[dict[str, Target], list[str]]:
    """The targets of a ``file_sd`` file and why each entry left out was; raises OSError,
    ValueError or BadTarget. ``ours``: this monitor's file, labelled with each one's source."""
    with open(path) as f:
        groups = json.load(f)
    if not isinstance(groups, list):
        raise BadTarget("file_sd content must be a JSON list of target groups")
    out: dict[str, Target] = {}
    skipped: list[str] = []
    for i, g in enumerate(groups):
        labels = (g.get("labels") or {}) if isinstance(g, dict) else None
        if not isinstance(labels, dict) or not isinstance(g.get("targets"), list):
            skipped.append(f'group {i}: not {{"targets": [...], "labels": {{...}}}}')
            continue
        # Prometheus' spelling of a scheme and a path prefix (as write_file_sd writes them)
        scheme = labels.get("__scheme__", "http")
        path = str(labels.get("__metrics_path__", ""))
        prefix = path[:-len("/metrics")] if path.endswith("/metrics") else ""
        for address in g["targets"]:
            try:
                if not isinstance(address, str):
                    raise BadTarget(f"target {address!r} is not a string")
                url = normalize_url(address if "://" in address
                                    else f"{scheme}://{address}{prefix}")
                out[url] = Target(url, str(labels.get("lightkeeper_source", "registered"))
                                  if ours else "file_sd", job=labels.get("job"),
                                  replica_group=_opt_int(labels.get("replica_group")),
                                  rank=_opt_int(labels.get("rank")))
            except BadTarget as e:
                skipped.append(f"group {i}: {e}"[:300])
    return out, skipped


def check_sd_out(path: str) -> None:
    """Raise ConfigError when ``path`` is a folder, or exists and is not file_sd JSON (a list of
    target groups; another program's file, or a monitor's --state): never replaced. Missing,
    empty or zeros (a power loss before an older version's unsynced write): fine."""
    if os.path.isdir(path):
        raise ConfigError(f"--sd-out {path} is a folder: name the file_sd file to write (its "
                          "default: beside --state)")
    try:
        with open(path, "rb") as f:
            if isinstance(json.loads(f.read().strip(b"\0 \t\r\n") or b"[]"), list):
                return
    except OSError:
        return
    except ValueError:  # UnicodeDecodeError is one
        pass
    raise ConfigError(f"--sd-out {path} exists and is not a file_sd JSON file (another "
                      "program's, or a monitor's --state?): not replaced; name another "
                      "path (its default: beside --state), or remove it")


def _skipped(skipped: list[str]) -> str:
    """The entries _read_file_sd left out, in one line: how many, the first few and why."""
    return f"{len(skipped)} left out: " + "; ".join(skipped[:5]) + "; ..." * (len(skipped) > 5)


@dataclass
class Target:
    url: str
    source: str  # "static", "file_sd", "registered" or "torch_store"
    job: str | None = None
    replica_group: int | None = None  # hints; /v1/state is the truth
    rank: int | None = None
    last_registered: float | None = None
    registered_as: str | None = None  # the URL as registered, when polled at a checked address
    # the --job its /v1/state must name: file_sd and registrations may list other jobs' ranks
    expect_job: str | None = None


def _same_claim(a: Target, b: Target) -> bool:
    """The same registration again: the same hints under the same registered URL."""
    return (a.job, a.replica_group, a.rank, a.registered_as) == \
        (b.job, b.replica_group, b.rank, b.registered_as)


def _identity(rank: Any) -> tuple | None:
    """The process a reachable rank's /v1/state says it is, with the rank it claims; None
    without host, pid or started_at (no telling two processes apart)."""
    if rank is None or not rank.reachable or not rank.state:
        return None
    s = rank.state
    key = (s.get("host"), s.get("pid"), s.get("started_at"), s.get("replica_group"),
           s.get("rank"))
    return key if None not in key else None


def _file_sd_groups(targets: list[Target], job: str | None, left_out: Collection[str]
                    ) -> list[dict[str, Any]]:
    """``targets`` as Prometheus file_sd groups; torch's server has no GET /metrics, and the
    ``left_out`` (ended, or another job's: scraped under this job's label) are down."""
    out = []
    for t in targets:
        if t.url.startswith(PREFIX) or t.url in left_out:
            continue
        labels = {"lightkeeper_source": t.source}
        if t.job or job:
            labels["job"] = t.job or job
        if t.replica_group is not None:
            labels["replica_group"] = str(t.replica_group)
        if t.rank is not None:
            labels["rank"] = str(t.rank)
        # Prometheus takes host:port only ("not a valid hostname" else): the rest in labels
        address, _, path = t.url.partition("://")[2].partition("/")
        if path:
            labels["__metrics_path__"] = f"/{path}/metrics"
        out.append({"targets": [address], "labels": labels})
    return out


def _replace(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file renamed over it)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".lightkeeper-sd-", dir=directory)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600: Prometheus often runs as another user
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # else a power loss may leave the new name full of NULs
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


OTHER_JOBS_SAID = 20  # jobs whose refused ranks are logged (once each)


class Discovery:
    def __init__(self, static: list[str] | None = None, targets_file: str | None = None,
                 forget_after_s: float = 30.0, job: str | None = None,
                 max_targets: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._static = {u: Target(u, "static", job=job) for u in map(normalize_url, static or [])}
        self._file: dict[str, Target] = {}
        self._registered: dict[str, Target] = {}
        self._torch: dict[str, Target] = {}  # torch-only ranks found in the groups' stores
        self._restored: dict[str, float] = {}  # registered targets adopted from --sd-out: when
        # store-found URL -> identity of a process that also answers registered: polled as that
        self._shadowed: dict[str, tuple] = {}
        self._claimed: dict[str, Target] = {}  # static and file_sd targets that registered too
        # registered URL -> [listed URL, identity, newest registration] (fold_same_process)
        self._aliases: dict[str, list] = {}
        self.targets_file = targets_file
        self._file_sig: tuple[float, int] | None = None
        self.file_error: str | None = None
        self._skipped_said: str | None = None  # the file's unusable entries, as last said
        self.forget_after_s = forget_after_s
        self.job = job
        self._other_jobs: set[str] = set()  # registrations of these jobs refused: said
        self._other_jobs_answered: set[str] = set()  # targets answering as these jobs: said
        self.max_targets = max_targets
        self._written: str | None = None
        self._sd_lock: tuple[int, tuple | None] | None = None  # --sd-out's lock: (fd, file id)
        self._written_for: list[Target] | None = None  # the known set that text is of
        self._ended: set[str] = set()  # static and file_sd ranks that said they stopped: not in sd
        self._other_job: set[str] = set()  # answered as another job's rank: not in sd either
        # kept until a source changes: the view and the schedule tell unchanged targets by identity
        self._sorted: list[Target] | None = None
        self.version = 0  # counts the changes of the known set (or of a target's hints)
        self.has_torch = False  # a torch+http:// target among them (as of targets())

    def register(self, body: Any, now: float | None = None,
                 admit: Callable[[str], str] | None = None) -> Target:
        """A WorkerServer's self-registration. ``admit(url)`` returns the URL to poll or raises.
        Raises BadTarget on a malformed body, TooManyTargets past ``max_targets``."""
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise BadTarget('registration body must be a JSON object with "url" (sent with '
                            'Content-Type: application/json)')
        if len(body["url"]) > MAX_URL:
            raise BadTarget(f"url longer than {MAX_URL} characters")
        job = body.get("job")
        if job is not None and (not isinstance(job, str) or len(job) > MAX_LABEL):
            raise BadTarget(f"job must be a string of at most {MAX_LABEL} characters")
        if job is not None and self.job is not None and job != self.job:
            # said once a job, for the first few: registrations must not grow the set or the log
            if job not in self._other_jobs and len(self._other_jobs) < OTHER_JOBS_SAID:
                self._other_jobs.add(job)
                log.warning("refusing ranks of job %r (this monitor's --job is %r), e.g. %r%s",
                            job, self.job, redact_entry(str(body["url"])),
                            "; other jobs' ranks are refused unsaid from now"
                            if len(self._other_jobs) == OTHER_JOBS_SAID else "")
            raise OtherJob(f"this monitor watches job {self.job!r} (its --job); the rank is of "
                           f"job {job!r}: start a monitor for it, or give both the same job")
        replica_group, rank = _opt_int(body.get("replica_group")), _opt_int(body.get("rank"))
        registered_as = normalize_url(body["url"])
        now = time.time() if now is None else now
        # a listed rank (--targets, file_sd) that registers too stays one target, polled as
        # listed: two URLs of one process would each claim its rank. Matched before any DNS
        hints = (job, replica_group, rank)
        if self._listed(registered_as):
            return self._annotate(registered_as, registered_as, hints, now)
        url = admit(registered_as) if admit is not None else registered_as
        if self._listed(url):
            return self._annotate(url, registered_as, hints, now)
        target = self._registration(url, registered_as, hints, now)
        # the alias read under the lock the target is added under: a concurrent fold is not undone
        with self._lock:
            listed = self._alias_of(url, target)
            if listed is None:
                old = self._registered.get(url)
                if old is not None and _same_claim(old, target):
                    old.last_registered = now
                    return old
                if old is None and url not in self._static and url not in self._file \
                        and self._count() >= self.max_targets:
                    raise TooManyTargets(f"the monitor already knows {self._count()} targets "
                                         f"(--max-targets {self.max_targets}); {url} not added")
                self._registered[url] = target
                self._invalidate()
                return target
        return self._annotate(listed, registered_as, hints, now)

    def _listed(self, url: str) -> bool:
        with self._lock:
            return url in self._static or url in self._file

    def _registration(self, url: str, registered_as: str, hints: tuple, now: float) -> Target:
        job, replica_group, rank = hints
        return Target(url, "registered", job, replica_group, rank, now,
                      registered_as if registered_as != url else None, expect_job=self.job)

    def _annotate(self, url: str, registered_as: str, hints: tuple, now: float) -> Target:
        """Put a registration's hints (where the listing gives none) on the listed ``url``."""
        job, replica_group, rank = hints
        with self._lock:
            base = self._static.get(url) or self._file.get(url)
            if base is None:  # gone with a new file_sd content meanwhile: registered instead
                self._registered[url] = self._registration(url, registered_as, hints, now)
                self._invalidate()
                return self._registered[url]
            t = Target(url, base.source, job=base.job if base.job is not None else job,
                       replica_group=base.replica_group if base.replica_group is not None
                       else replica_group,
                       rank=base.rank if base.rank is not None else rank, last_registered=now,
                       registered_as=registered_as if registered_as != url else None,
                       expect_job=base.expect_job)
            old = self._claimed.get(url)
            if old is not None and _same_claim(old, t):
                old.last_registered = now
                return old
            self._claimed[url] = t
            # a copy registered (or restored from --sd-out) under the other spelling goes
            self._registered.pop(url, None)
            self._registered.pop(registered_as, None)
            self._invalidate()
            return t

    def _alias_of(self, url: str, target: Target) -> str | None:  # under self._lock
        """The listed URL the registered ``url`` was found to be (fold_same_process), while
        still listed; ``target`` (this registration) kept, to poll again if the alias ends."""
        alias = self._aliases.get(url)
        if alias is None:
            return None
        if alias[0] not in self._static and alias[0] not in self._file:
            del self._aliases[url]  # gone from --targets-file: polled as registered
            return None
        alias[2] = target
        return alias[0]

    def fold_same_process(self, ranks: Mapping[str, Any], now: float) -> None:
        """Fold each registered target that answered as the same process as a listed one into
        it (``ranks``: URL -> the sweep's RankView). The alias ends when the listed one answers
        as another process or not at all, goes, or the registrations stop; the registered URL
        is polled again at once if the listed one missed a poll (else a live rank looks dead)."""
        self.shadow_torch(ranks)
        if not self._aliases and not (self._registered and (self._static or self._file)):
            return  # the usual jobs: all listed or all registered
        found: list[tuple[str, Target]] = []
        with self._lock:
            listed: dict[tuple, str] = {}  # identity -> the first listed target of it
            for url in (*self._static, *self._file):
                key = _identity(ranks.get(url))
                if key is not None:
                    listed.setdefault(key, url)
            if not listed and not self._aliases:
                return
            for reg, (url, key, t) in list(self._aliases.items()):
                fresh = now - (t.last_registered or now) <= self.forget_after_s
                if listed.get(key) == url and fresh:
                    continue
                del self._aliases[reg]
                claim = self._claimed.get(url)
                if claim is not None and claim.registered_as == (t.registered_as or t.url):
                    del self._claimed[url]  # the hints were this process's
                view = ranks.get(url)
                if fresh and (view is None or not view.reachable) and reg not in self._registered:
                    self._registered[reg] = t
                self._invalidate()
            for reg, t in list(self._registered.items()):
                key = _identity(ranks.get(reg))
                url = listed.get(key) if key is not None else None
                if url is not None:
                    del self._registered[reg]  # polled as listed from now
                    self._aliases[reg] = [url, key, t]
                    self._invalidate()
                    found.append((url, t))
        for url, t in found:
            self._annotate(url, t.registered_as or t.url, (t.job, t.replica_group, t.rank),
                           t.last_registered or now)

    def shadow_torch(self, ranks: Mapping[str, Any]) -> None:
        """Leave out a store-found rank while a registered URL answers as the same process
        (torch's server carrying Lightkeeper's handlers); poll it again once that stops."""
        if not (self._torch or self._shadowed):
            return
        with self._lock:
            answering = {k for u in self._registered
                         if (k := _identity(ranks.get(u))) is not None}
            shadowed = {}
            for url in self._torch:
                key = _identity(ranks.get(url)) or self._shadowed.get(url)
                if key is not None and key in answering:
                    shadowed[url] = key
            if shadowed != self._shadowed:
                self._shadowed = shadowed
                self._invalidate()

    def _invalidate(self) -> None:  # under self._lock
        self._sorted = None
        self.version += 1

    def _count(self) -> int:
        return len(self._registered.keys() | self._file.keys() | self._static.keys())

    def set_torch(self, found: dict[str, tuple[int, int]]) -> None:
        """Replace the torch-only ranks found in the groups' TCPStores: URL -> (group, rank)."""
        with self._lock:
            if {u: (t.replica_group, t.rank) for u, t in self._torch.items()} == found:
                return
            self._torch = {u: Target(u, "torch_store", job=self.job, replica_group=g, rank=r)
                           for u, (g, r) in found.items()}
            self._invalidate()

    def restore(self, path: str) -> None:
        """Re-adopt the registered targets a previous run wrote (:meth:`write_file_sd`), not
        another ``--job``'s; a missing, empty or broken file restores nothing. Holds ``path``
        first: raises ConfigError when another monitor writes it, or it is not file_sd at all."""
        self._hold(path)
        check_sd_out(path)
        try:
            parsed, skipped = _read_file_sd(path, ours=True)
        except (OSError, ValueError):  # BadTarget is a ValueError
            return
        if skipped:
            log.warning("--sd-out %s: %s (not restored; the others are)", path, _skipped(skipped))
        now = time.time()
        with self._lock:
            for url, t in parsed.items():
                if url in self._registered or t.source in ("static", "file_sd") \
                        or t.job not in (None, self.job):
                    continue
                if self._count() >= self.max_targets:
                    break
                t.source, t.last_registered, t.expect_job = "registered", now, self.job
                self._registered[url] = t
                self._restored[url] = now
                self._invalidate()

    def _hold(self, path: str) -> None:
        """Lock ``<path>.lock`` (POSIX: this process may take it again): two monitors writing
        one file would each replace the other's targets."""
        lock = f"{os.path.realpath(path)}.lock"
        try:
            os.makedirs(os.path.dirname(lock), exist_ok=True)
            fd = pid_lock(lock, posix=True)  # held until the process exits
        except LockHeld as e:
            raise ConfigError(f"--sd-out {path} is written by another monitor (PID {e.holder}); "
                              "give each monitor a file of its own (its default: beside --state)") from None
        except OSError:
            return  # writing the file itself fails too, and is warned about then
        if self._sd_lock is not None:
            os.close(self._sd_lock[0])
        self._sd_lock = fd, file_id(lock)

    def refresh(self) -> str | None:
        """Re-read the file_sd input if it changed; returns an error message or None."""
        path = self.targets_file
        if not path:
            return None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self.file_error = f"targets file {path} does not exist"
            self._file_sig = None  # moved back unchanged (same mtime and size): read again
            return self.file_error
        if (sig := (st.st_mtime, st.st_size)) == self._file_sig:
            return self.file_error
        try:
            parsed, skipped = _read_file_sd(path)
            if skipped and not parsed:  # nothing usable: the last good targets are kept
                raise BadTarget(_skipped(skipped))
        except (OSError, ValueError) as e:
            self.file_error = f"targets file {path}: {e}"
            self._file_sig = sig  # do not re-parse the same broken content every sweep
            return self.file_error
        said, self._skipped_said = self._skipped_said, (_skipped(skipped) if skipped else None)
        if self._skipped_said not in (None, said):  # not again each time a generator rewrites it
            log.warning("targets file %s: %s (the others are watched)", path, self._skipped_said)
        other = {str(t.job) for t in parsed.values() if t.job not in (None, self.job)}
        if other and self.job is not None:  # refused as their registrations are (409)
            log.warning("targets file %s: leaving out the targets of job(s) %s (this monitor's "
                        "--job is %r)", path, ", ".join(sorted(other)), self.job)
            parsed = {u: t for u, t in parsed.items() if t.job in (None, self.job)}
        for t in parsed.values():  # unlabelled ones too: a generic file may list other jobs'
            t.expect_job = self.job
        with self._lock:
            self._file = parsed
            # their hints may have changed: annotated again at their next registration
            self._claimed = {u: t for u, t in self._claimed.items() if u in self._static}
            self._invalidate()
        self._file_sig, self.file_error = sig, None
        return None

    def targets(self) -> list[Target]:
        """All known targets, static first, then file_sd, then registered (one per URL)."""
        return list(self._current())

    def _current(self) -> list[Target]:
        """The sorted known set, one list object until a source changes (not to be modified)."""
        with self._lock:
            if self._sorted is None:
                torch = {u: t for u, t in self._torch.items() if u not in self._shadowed}
                merged = {**torch, **self._registered, **self._file, **self._static,
                          **self._claimed}
                self._sorted = sorted(merged.values(), key=lambda t: (
                    t.rank if t.rank is not None else 1 << 62, t.url))
                self.has_torch = any(t.url.startswith(PREFIX) for t in self._sorted)
            return self._sorted

    def forget_unreachable(self, unreachable_since: dict[str, float],
                           now: float | None = None, ended: Collection[str] = ()) -> list[str]:
        """Drop and return the registered targets unreachable (URL -> since when) for
        ``forget_after_s`` and not registered since, or at once when ``ended``. Static and
        file_sd ones stay; those ``ended`` are left out of :meth:`write_file_sd` (no alert)."""
        now = time.time() if now is None else now
        forgotten, ended = [], set(ended)
        if ended != self._ended:
            self._ended, self._written_for = ended, None
        with self._lock:
            for url, t in list(self._registered.items()):
                since = unreachable_since.get(url)
                if since is None:
                    continue
                restored = self._restored.get(url)
                if restored is not None and t.last_registered == restored:
                    # adopted from --sd-out and silent since: dark from this run's start at most
                    since = max(since, restored)
                elif t.last_registered is not None and t.last_registered > since:
                    continue  # it registered again after it went dark: keep trying
                if now - since < self.forget_after_s and url not in ended:
                    continue
                del self._registered[url]
                self._restored.pop(url, None)
                self._invalidate()
                forgotten.append(url)
        return forgotten

    def answered_other_job(self, jobs: Mapping[str, str]) -> None:
        """The targets whose last answer was another job's rank (URL -> that job): left out of
        :meth:`write_file_sd` until they answer as this job's; logged once a job, for a few."""
        other = set(jobs)
        if other == self._other_job:
            return
        said = self._other_jobs_answered
        for url in other - self._other_job:
            job, shown = jobs[url][:MAX_LABEL], redact_url(url)
            with self._lock:  # a --targets entry (the operator's) is not said
                where = f"targets file {self.targets_file}: {shown}" if url in self._file \
                    else f"registered rank {shown}" if url in self._registered else None
            if where is not None and job not in said and len(said) < OTHER_JOBS_SAID:
                said.add(job)
                log.warning("%s answers as job %s, not --job %r: not watched%s", where, job,
                            self.job, "; ranks of further jobs go unsaid"
                            if len(said) == OTHER_JOBS_SAID else "")
        self._other_job, self._written_for = other, None

    def write_file_sd(self, path: str) -> bool:
        """Atomically write the known set to ``path`` as Prometheus ``file_sd`` target groups
        when it changed; True if written. Raises OSError when the write fails."""
        current = self._current()
        if current is self._written_for and os.path.exists(path):
            return False
        left_out = self._ended | self._other_job
        text = json.dumps(_file_sd_groups(current, self.job, left_out), sort_keys=True)  # C encoder
        if text == self._written and os.path.exists(path):
            self._written_for = current
            return False
        if self._sd_lock is not None and \
                file_id(f"{os.path.realpath(path)}.lock") != self._sd_lock[1]:
            try:  # deleted with its folder: held again, as the state's (monitor.store)
                self._hold(path)
            except ConfigError as e:
                raise OSError(str(e)) from None
        _replace(path, text)
        self._written, self._written_for = text, current
        return True
