"""An incident bundle's layout, and reading one for ``lightkeeper analyze``: one
``<id>.tar.gz`` (monitor/act/bundles.py writes it) whose ``<id>/`` folder holds :data:`MANIFEST`
and the ranks' ``fr/rank<N>.json`` dumps this module hands to the analysis, among others
(docs/monitor.md, Incident bundles).
"""

from __future__ import annotations

import gzip
import json
import re
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .stragglers import StragglerConfig

FORMAT = "lightkeeper-incident-bundle"
VERSION = 1
MANIFEST, FINDINGS = "manifest.json", "findings.json"
FR_DIR, STACKS_DIR = "fr", "stacks"
SUFFIX = ".tar.gz"
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # also a safe file name
_DUMP_RE = re.compile(r"^[^/]+/fr/rank(\d+)\.json$")  # a rank's dump in FR_DIR
# the members read, in all: a small archive can unpack to a thousand times its size
MAX_READ_BYTES = 1 << 30
_BROKEN = (OSError, tarfile.TarError, EOFError, zlib.error)  # a cut short or corrupt archive
# the finding kinds a Flight Recorder dump can show: the others (a network fault, a group gone)
# leave every rank's dump alike, so the monitor's evidence in the bundle is all there is
FR_KINDS = ("hang", "mismatch", "straggler")


class BundleError(ValueError):
    """Not a readable incident bundle."""


def rank_file(folder: str, rank: int, ext: str = "json") -> str:
    """The name of a rank's file inside the bundle's top folder (``fr/rank3.json``)."""
    return f"{folder}/rank{int(rank)}.{ext}"


@dataclass
class OpenedBundle:
    """A bundle's manifest and its Flight Recorder dumps, unpacked into ``fr_dir``; ``finding``:
    the monitor's finding it was kept for (None when unreadable)."""

    manifest: dict[str, Any]
    fr_dir: str
    finding: dict[str, Any] | None = None
    source: str = ""  # the PATH it was read from
    error: str | None = None  # the archive broke past its manifest: what came before is kept
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def is_bundle(path: str | Path) -> bool:
    """A ``.tar.gz`` or gzip file, or a folder unpacked from one: its manifest beside an ``fr/`` folder,
    or a manifest of this format (another tool's ``manifest.json`` beside dumps is no bundle)."""
    p = Path(path)
    if p.is_dir():
        if not (p / MANIFEST).is_file():
            return False
        if (p / FR_DIR).is_dir():
            return True
        try:
            _manifest(json.loads((p / MANIFEST).read_bytes()))
        except (OSError, ValueError):  # BundleError is a ValueError
            return False
        return True
    if not p.is_file():  # a FIFO or a device: opening it may block for ever
        return False
    if p.name.endswith(SUFFIX):
        return True
    try:  # saved under another name (curl -O names it "bundle"): a gzipped tar, not a
        # gzipped dump (the loader says to gunzip that one)
        with gzip.open(p, "rb") as f:
            return f.read(512)[257:262] == b"ustar"
    except (OSError, EOFError, zlib.error):
        return False


def open_bundle(path: str | Path) -> OpenedBundle:
    """The manifest and the dumps of a bundle (a ``.tar.gz`` or an unpacked folder); raises
    :class:`BundleError`. Only ``<top>/manifest.json`` and ``<top>/fr/rank<N>.json`` members are
    read, each into a fresh temporary folder under its own name: a member's path never becomes
    a path on this machine."""
    p = Path(path)
    if p.is_dir():
        try:
            manifest = _manifest(json.loads((p / MANIFEST).read_bytes()))
            finding = _finding((p / FINDINGS).read_bytes()) if (p / FINDINGS).is_file() else None
        except (OSError, ValueError) as e:
            raise e if isinstance(e, BundleError) else BundleError(f"{MANIFEST}: {e}") from None
        return OpenedBundle(manifest, str(p / FR_DIR), finding, str(p))
    tmp = tempfile.TemporaryDirectory(prefix="lightkeeper-bundle-")
    manifest = finding = cut = None
    read = 0
    try:
        with tarfile.open(p, "r:gz") as tar:
            try:
                for m in tar:
                    parts = m.name.split("/")
                    top = parts[1] if len(parts) == 2 else None
                    match = _DUMP_RE.match(m.name)
                    if not m.isfile() or not (top in (MANIFEST, FINDINGS) or match):
                        continue
                    read += m.size
                    if read > MAX_READ_BYTES:
                        raise BundleError(f"over {MAX_READ_BYTES} bytes unpacked")
                    if top == MANIFEST:
                        manifest = _manifest(json.loads(_read(tar, m)))
                    elif top == FINDINGS:
                        finding = _finding(_read(tar, m))
                    else:
                        Path(tmp.name, f"rank{int(match.group(1))}.json").write_bytes(_read(tar, m))
            except (*_BROKEN, BundleError) as e:  # a download cut short: its first dumps are
                if manifest is None:  # the culprit's
                    raise
                cut = f"archive broken after its manifest, the rest not read: {e}"
        if manifest is None:
            raise BundleError(f"not an incident bundle (no {MANIFEST} in the archive): unpack it "
                              "and give the folder")
        return OpenedBundle(manifest, tmp.name, finding, str(p), cut, tmp)
    except (*_BROKEN, ValueError) as e:
        tmp.cleanup()
        if isinstance(e, BundleError):
            raise
        raise BundleError(f"not an incident bundle: {e}") from None


def _read(tar: tarfile.TarFile, m: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(m)
    if f is None:
        raise BundleError(f"cannot read {m.name}")
    return f.read()


def _manifest(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BundleError(f"{MANIFEST} is not a {FORMAT} manifest")
    # the fields the report reads: a hand-edited or foreign manifest is refused, not a traceback
    shapes = {"culprit_ranks": int, "ranks": dict, "left_out": dict}
    for key, kind in shapes.items():
        v = doc.get(key) or []
        if not isinstance(v, list) or not all(isinstance(x, kind) and not isinstance(x, bool)
                                               for x in v):
            raise BundleError(f"{MANIFEST}: {key} is not a list of {kind.__name__}")
    if not isinstance(doc.get("decision") or {}, dict):
        raise BundleError(f"{MANIFEST}: decision is not an object")
    for key in ("id", "trigger", "kind", "replica_id"):
        if not isinstance(doc.get(key), str | None):
            raise BundleError(f"{MANIFEST}: {key} is not a string")
    return doc


def _finding(data: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    f = doc.get("finding") if isinstance(doc, dict) else None
    return f if isinstance(f, dict) else None


def monitor_verdict(manifest: dict[str, Any], findings: list[dict[str, Any]],
                    finding: dict[str, Any] | None = None, analyzed: bool = True,
                    compared: set[int] | None = None, lags: list[dict[str, Any]] | None = None,
                    read: set[int] | None = None,
                    across: set[int] | None = None) -> dict[str, Any]:
    """What the monitor named, as ``lightkeeper analyze`` reports it beside its own ``findings``.
    ``analysis_agrees``: the named ranks are some finding's culprits (:func:`_named`), or all
    findings' together (a cross-group hang is one finding per torchft group), or a named
    straggler some ``lags`` entry's; None when none are named, no dump was ``analyzed``, the kind
    does not show in a dump (``flight_recorder_shows``), or the dumps cannot check it
    (``unchecked``, ``unchecked_why``): a named rank's dump not ``read``, none of a hang's waiting
    ranks' either, a mismatch with no other rank's dump, a quorum-level hang where no hang shows, a
    named straggler not ``compared`` with a peer over enough collectives, or the monitor's own
    (late at the cross-group step) not compared ``across`` groups."""
    decision = manifest.get("decision") or {}
    named = sorted(manifest.get("culprit_ranks") or [])
    kind = manifest.get("kind")
    shows = kind in FR_KINDS
    # a lag says who enqueued later, not who is off pace: enough to back the monitor's straggler
    culprits = [set(_named(f)) for f in [*findings, *(lags or [] if kind == "straggler" else [])]]
    agrees = set(named) in [*culprits, set().union(*culprits)] if named and shows and analyzed \
        else None
    hung = any(f.get("kind") == "hang" for f in findings)
    why = _unchecked(kind, named, finding, compared, read, hung, across) if agrees is False \
        else None
    if why:  # neither confirmed nor denied
        agrees = None
    ev = (finding or {}).get("evidence")
    summary = ev.get("summary") if isinstance(ev, dict) else None
    return {"id": manifest.get("id"), "trigger": manifest.get("trigger"),
            "kind": kind, "replica_group": manifest.get("replica_group"),
            "replica_id": manifest.get("replica_id"), "culprit_ranks": named,
            "culprit_hosts": [h for h in manifest.get("culprit_hosts") or [] if isinstance(h, str)],
            "decision": decision.get("decision"), "decision_id": decision.get("id"),
            "not_fetched": [r for r in manifest.get("ranks") or []
                            if r.get("fr_trace") != "ok" or r.get("stacks") != "ok"],
            "left_out": manifest.get("left_out") or [], "analysis_agrees": agrees,
            "flight_recorder_shows": shows, "unchecked": bool(why), "unchecked_why": why,
            "summary": summary[:500] if isinstance(summary, str) else None}


def onset_ns(manifest: dict[str, Any], finding: dict[str, Any] | None) -> int | None:
    """A straggler finding's onset, ns since the epoch: its ``first_seen``, the start of its first
    late step (monitor/detect/straggler.py); None for other kinds or where the bundle lacks it."""
    first = (finding or {}).get("first_seen")
    if manifest.get("kind") != "straggler" or isinstance(first, bool) or not isinstance(first, int | float) \
            or not 0 < first < 1e11:
        return None
    return int(first * 1e9)


def _unchecked(kind: Any, named: list[int], finding: dict[str, Any] | None, compared: set[int] | None,
               read: set[int] | None, hung: bool, across: set[int] | None = None) -> str | None:
    """Why the dumps cannot check what the monitor named, or None when they can."""
    spans = ", ".join(map(str, named))
    if read is not None and not set(named) <= read:
        return f"no readable dump of rank(s) {', '.join(str(r) for r in named if r not in read)}"
    if kind == "mismatch" and read is not None and read <= set(named):  # nothing to compare with
        return f"no other rank's dump to compare rank(s) {spans} with"
    ev = (finding or {}).get("evidence")
    # nothing pending, so nothing to check; yet a hang the dumps show names its own culprits
    if kind == "hang" and not hung and isinstance(ev, dict) and ev.get("level") == "quorum":
        return f"rank(s) {spans} never asked for the quorum: no collective is pending, which a dump could show"
    waited = ev.get("waiting_ranks") if isinstance(ev, dict) else None
    if kind == "hang" and read is not None and isinstance(waited, list) and waited \
            and not set(waited) & read:  # those the hang shows in: a cut download has the culprit's
        return f"no readable dump of any rank that waited for them ({', '.join(map(str, waited))})"
    if kind == "straggler" and compared is not None and not set(named) <= compared:
        since = onset_ns({"kind": kind}, finding) is not None
        # which one fell short the engine does not say: a pair needs both
        return f"no other rank could be timed against rank(s) {spans}" + (
            f" since the finding's onset: fewer than {StragglerConfig.min_collectives} collectives (a group "
            f"judged per position in its step: whole steps), or (two ranks compared) fewer than "
            f"{StragglerConfig.pair_windows} whole steps" if since else "")
    # the monitor's own straggler is late at the cross-group step: an in-group check clears nothing
    if kind == "straggler" and across is not None and not set(named) <= across \
            and not (isinstance(ev, dict) and ev.get("source") == "flight_recorder"):
        return (f"the monitor timed rank(s) {spans} late at the cross-group step, and no "
                f"cross-group collective of theirs could be timed against another group's (the "
                f"notes say why)")
    return None


def not_come(manifest: dict[str, Any]) -> list[int | None]:
    """The ranks whose dump the manifest lists as not come: its ``fr_trace`` failed (a timeout,
    gone), or left out over the size cap."""
    out = [r.get("rank") for r in manifest.get("ranks") or [] if r.get("fr_trace") != "ok"]
    return out + [int(m.group(1)) for x in manifest.get("left_out") or []
                  if (m := re.fullmatch(rf"{FR_DIR}/rank(\d+)\.json", str(x.get("what"))))]


def _named(finding: dict[str, Any]) -> list[int]:
    """The ranks a finding singles out: a mismatch without a majority blames every participant,
    so its pick is the monitor's, in the monitor's order: those breaking their per-step pattern,
    else those departing from their own history."""
    if finding.get("kind") == "mismatch" and finding.get("has_majority") is False:
        return (finding.get("departs_from_step_pattern") or finding.get("departs_from_history")
                or finding.get("culprit_ranks") or [])
    return finding.get("culprit_ranks") or []
