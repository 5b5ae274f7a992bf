"""``lightkeeper analyze PATH [PATH ...]``: cross-rank findings from Flight Recorder dumps.
A PATH may also be a monitor's incident bundle (monitor/analysis/bundle.py: its dumps are read,
and what the monitor named is said beside the findings) or torchft's per-quorum dump folders
(monitor/analysis/torchft_dumps.py: one quorum's). Exit status: 0 no findings, 1 findings, 2
nothing loadable, nothing recorded to compare, no findings while an input could not be read (a
torchft quorum chosen over one holding more dumps among them), or a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from http_serving import printable

from .bundle import (
    FR_DIR,
    FR_KINDS,
    BundleError,
    OpenedBundle,
    is_bundle,
    monitor_verdict,
    not_come,
    onset_ns,
    open_bundle,
)
from .torchft_dumps import SeveralJobs, holdings, listed, pick, quorum_folders


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="per-rank dump files or directories of them (JSON or pickle), a monitor's incident bundle "
                        "(<id>.tar.gz), or torchft's per-quorum dump folders (TORCH_FR_DUMP_TEMP_FILE's value or their parent)")
    parser.add_argument("--quorum", type=int, default=None, metavar="ID",
                        help="of torchft's per-quorum folders, read this quorum's (default: the one whose dumps are the newest)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.add_argument("--blame-missing", action="store_true",
                        help="count group members without a dump as never having arrived (default: report them as unknown)")
    parser.add_argument("--same-host", action="store_true",
                        help="dumps without a 'host' key come from one host: their enqueue times may be compared")
    parser.add_argument("--world-size", type=int, default=None, help="ranks in the job, when the dumps do not say (gloo)")
    parser.add_argument("--prefix", default=None,
                        help="of a directory's files, read those whose names start with PREFIX (needed where it holds several jobs' dumps)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="worker processes loading the dumps (default: the cores available; 1: none; at most 2 per "
                        "core). Small inputs are loaded without workers anyway")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from .engine import analyze, nothing_recorded
    from .loader import load_paths
    from .pool import JOBS_PER_CORE, available_cores, max_workers
    from .stragglers import StragglerConfig

    out = out or sys.stdout
    for flag, value in (("--world-size", args.world_size), ("--jobs", args.jobs)):
        if value is not None and value < 1:
            print(f"lightkeeper analyze: {flag} must be positive", file=sys.stderr)
            return 2
    inputs = expand(args.paths, args.quorum)
    try:
        if len(inputs.bundles) > 1:  # each its own incident: one's dumps would judge another's
            print(f"lightkeeper analyze: {len(inputs.bundles)} incident bundles given; analyze "
                  "one at a time", file=sys.stderr)
            return 2
        if inputs.bundles and len(args.paths) > 1:  # other dumps' ranks would mix with its own
            print(f"lightkeeper analyze: an incident bundle is analyzed alone: {inputs.bundles[0].source} "
                  f"given with {len(args.paths) - 1} other PATH(s)", file=sys.stderr)
            return 2
        loaded = load_paths(inputs.paths, jobs=args.jobs, prefix=args.prefix)
        # judged while a bundle's dumps are still unpacked
        strays = [(e, s) for e in loaded.errors if (s := _stray(e["path"], loaded.traces.keys()))]
    finally:
        for b in inputs.bundles:
            b.close()  # the traces are in memory: the unpacked dumps can go
    for b in inputs.bundles:
        # a bundle without dumps is its own entry (broken, or none kept), not its temp folder's
        loaded.errors = [e for e in loaded.errors if Path(e.get("path", "")) != Path(b.fr_dir)]
        for e in loaded.errors:  # a dump's error names it in the bundle, not a deleted folder
            if Path(e.get("path", "")).parent == Path(b.fr_dir):
                e["path"] = f"{b.source}: {FR_DIR}/{Path(e['path']).name}"
            e["error"] = e["error"].replace(str(Path(b.fr_dir)) + "/", f"{b.source}: {FR_DIR}/")
    # a bundle's straggler is judged from its onset: the healthy steps before would outvote it
    since = next((onset_ns(b.manifest, b.finding) for b in inputs.bundles), None)
    result = analyze(loaded.traces, blame_missing=args.blame_missing, same_host=args.same_host, world_size=args.world_size,
                     straggler=StragglerConfig(since_ns=since))
    result.errors = inputs.errors + loaded.errors + result.errors
    # an archive may hold the dump of a rank the groups name and no dump read gave
    # a name's rank hides a dump only inside the groups' ranks, or one past them (gloo declares
    # no world: its last rank's dump missing leaves no gap); ``slurm-12345.out`` hides none
    world = set(result.ranks) | set(result.unknown_ranks)
    inputs.read_anyway += [e for e, s in strays if s is True or s == "archive" and not result.unknown_ranks
                           or isinstance(s, tuple) and s[1] not in world and s[1] > max(world, default=-1) + 1]
    notes = inputs.notes + loaded.notes
    if since is not None:
        notes.append(f"stragglers judged over the collectives enqueued since the monitor's finding began "
                     f"({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(since / 1e9))}, its first_seen)")
    missed: list[Any] = [e for e in result.errors if not e["error"].startswith(READ_ANYWAY) and e not in inputs.read_anyway]
    for b in inputs.bundles:  # a dump the bundle lists that did not come may be the culprit's
        if b.manifest.get("kind") in FR_KINDS:
            missed += [r for r in not_come(b.manifest) if r not in result.ranks]
    if args.jobs is not None and args.jobs > max_workers():  # more only add start-up and memory
        notes.append(f"--jobs {args.jobs}: at most {max_workers()} worker processes start "
                     f"({JOBS_PER_CORE} per available core, of {available_cores()})")
    if result.unknown_ranks and not args.blame_missing and not any(f.kind == "hang" for f in result.findings):
        # the rank that never arrived may be the one whose dump is missing: no hang shows then
        notes.append("ranks without a dump are not blamed, yet a rank that never arrived may be "
                     "one: --blame-missing counts them as not having arrived")
    if missed and not result.findings and result.ranks:
        notes.append(f"{len(missed)} {INCOMPLETE}")
    result.notes = notes + result.notes
    report = result.to_dict()
    report["pickle_reader"] = loaded.pickle_reader
    if inputs.quorums:
        report["torchft_quorums"] = inputs.quorums
    if inputs.bundles:
        # dumps that recorded nothing (recorder off, no collective yet) can check nothing
        checked = bool(result.ranks) and not nothing_recorded(loaded.traces)
        report["bundles"] = [monitor_verdict(b.manifest, report["findings"], b.finding, checked,
                                             result.compared, report["lags"], set(result.ranks),
                                             result.compared_across)
                             for b in inputs.bundles]
    if args.format == "json":
        json.dump(report, out, indent=2)
        out.write("\n")
    else:
        out.write(format_text(report))
    if not result.ranks or nothing_recorded(loaded.traces):  # nothing compared: not "healthy"
        if args.format == "text":
            print(f"lightkeeper analyze: {'no usable dump' if not result.ranks else 'no collective recorded in any dump'}",
                  file=sys.stderr)
        return 2
    if inputs.fuller and not result.findings:  # a stray dump's quorum read: not "healthy" either
        if args.format == "text":
            print("lightkeeper analyze: no findings in the torchft quorum read, but another holds more dumps "
                  f"(--quorum {inputs.fuller[0]})", file=sys.stderr)
        return 2
    if missed and not result.findings:  # the culprit's dump may be the one missed: not "healthy"
        if args.format == "text":
            print(f"lightkeeper analyze: no findings, but {len(missed)} input(s) could not be read: incomplete",
                  file=sys.stderr)
        return 2
    return 1 if result.findings else 0


# an error that leaves no dump unread: a second dump of a rank (the first is read); a file that is
# no dump is judged by _stray, as its name may be a rank's not read (torch writes a dump in place)
READ_ANYWAY = ("duplicate dump of rank ",)
INCOMPLETE = ("input(s) could not be read (errors, or a bundle's dumps that did not come): a rank to blame "
              "may be among them, so no findings is no healthy verdict; nothing compared for them")


@dataclass
class Inputs:
    """What the PATHs name once bundles are unpacked and torchft's quorum folders chosen."""

    paths: list[str] = field(default_factory=list)
    bundles: list[OpenedBundle] = field(default_factory=list)
    quorums: list[dict[str, Any]] = field(default_factory=list)  # torchft folders: read and not
    errors: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # which quorum was read, where not the newest
    fuller: list[int] = field(default_factory=list)  # quorums not read holding more dumps than the one read
    read_anyway: list[dict[str, str]] = field(default_factory=list)  # errors that leave no dump asked for unread


def expand(paths: list[str], quorum: int | None = None) -> Inputs:
    """Bundles unpacked (their ``fr/`` folder read), torchft's per-quorum folders narrowed to one
    quorum; any other PATH as given. A bad bundle, a missing quorum or a PATH that cannot be
    listed is an ``errors`` entry."""
    out = Inputs()
    for raw in paths:
        try:
            _expand(raw, quorum, out)
        except OSError as exc:  # a folder this user may not list (or look into): said, not a traceback
            from .loader import unreadable

            out.errors.append(unreadable(raw, exc))
    return out


def _expand(raw: str, quorum: int | None, out: Inputs) -> None:
    """``raw`` added to ``out``: as in :func:`expand`; ``OSError`` when it cannot be looked at."""
    if is_bundle(raw):
        try:
            b = open_bundle(raw)
        except BundleError as e:
            out.errors.append({"path": raw, "error": str(e)})
            return
        out.bundles.append(b)
        out.paths.append(b.fr_dir)
        if b.error:
            out.errors.append({"path": raw, "error": b.error})
        return
    if Path(raw).is_dir() and Path(raw).name == FR_DIR and is_bundle(Path(raw).parent):
        # read alone, its straggler is judged over every step, the healthy ones outvoting it
        out.notes.append(f"{raw} is an incident bundle's {FR_DIR}/ folder: analyze the bundle "
                         f"({Path(raw).parent}, or its .tar.gz) to judge from the finding's "
                         "onset and compare with the monitor's verdict")
    try:
        folders = quorum_folders(raw) if not Path(raw).is_file() else {}
    except SeveralJobs as e:  # read as one, jobA's quorum 2 would be jobB's
        out.errors.append({"path": raw, "error": str(e)})
        return
    if not folders:
        if quorum is not None:  # read as given, but --quorum picked nothing here
            out.errors.append({"path": raw, "error": f"--quorum {quorum}: no torchft quorum folders here"})
            out.read_anyway.append(out.errors[-1])
        out.paths.append(raw)
        return
    held = holdings(folders)
    got = pick(folders, quorum, held)
    if got is None:
        out.errors.append({"path": raw, "error": f"no torchft folder of quorum {quorum} (found {sorted(folders)})"})
        return
    beside = list(listed(Path(raw))) if Path(raw).is_dir() else []
    empty = quorum is None and not held  # nothing is read
    for q in sorted(folders):
        out.quorums.append({"quorum_id": q, "path": str(folders[q]), "read": q == got[0] and not empty})
    if empty:
        out.errors.append({"path": raw, "error": f"none of its {len(folders)} torchft quorum folders (quorum "
                           f"{_span(sorted(folders))}) holds a dump file"})
    else:
        out.paths.append(str(got[1]))
        if quorum is None:
            _say_choice(raw, got[0], folders, held, out)
    if beside:
        out.errors.append({"path": raw, "error": f"{len(beside)} file(s) beside its torchft quorum folders "
                           "not read (name them to read them)"})
        out.read_anyway.append(out.errors[-1])


def _say_choice(raw: str, got: int, folders: dict[int, Path], held: dict[int, tuple[float, int]], out: Inputs) -> None:
    """Notes on the quorum read by default and the others; an ``errors`` entry where another
    holds more dump files: a stray dump of one rank may be the newest, the hang's all older."""
    others = sorted(q for q in held if q != got)
    higher = [q for q in others if q > got]
    empties = sorted(q for q in folders if q > got and q not in held)
    said = []
    if others:
        said.append(f"quorum {_span(others)} hold{'s' if len(others) == 1 else ''} older dumps (--quorum ID reads one)")
    if higher:  # the Lighthouse keeps the id in memory only; or another run's folders
        said.append(f"quorum {_span(higher)}: a higher id with older dumps (a restarted Lighthouse counts quorum ids "
                    "from 0 again)")
    if empties:
        said.append(f"the folders of quorum {_span(empties)} hold none (torchft makes one at every quorum)")
    if said:
        out.notes.append(f"{raw}: read torchft quorum {got}, whose dump files are the newest: " + "; ".join(said))
    out.fuller = sorted((q for q in others if held[q][1] > held[got][1]), key=lambda q: (-held[q][1], -q))
    if out.fuller:
        more = ", ".join(f"quorum {q}'s {held[q][1]}" for q in out.fuller)
        out.errors.append({"path": raw, "error": f"read torchft quorum {got}'s {held[got][1]} dump file(s), the newest, "
                           f"yet {more} are older: --quorum {out.fuller[0]} reads them"})


def _stray(path: str, read: Any) -> bool | str | tuple[str, int]:
    """Whether a file that failed to load can hide no rank not ``read``: False where it began as a
    dump (a pickle, JSON holding entries); ``("rank", n)`` where its name's digits name a rank not
    read (a last suffix aside: ``rank2.json.zst``), judged against the groups' ranks; ``"archive"``
    for a gzip or tar, which may hold any rank's dump (``trace.gz``), so is stray only where no rank
    is missing; else True."""
    from .loader import dump_kind, rank_from_name

    p = Path(path)
    rank = rank_from_name(p.name)
    rank = rank_from_name(p.stem) if rank is None else rank
    if not p.is_file():  # a folder: not one file's
        return False
    try:
        with open(p, "rb") as f:  # in chunks: a stray file may be a checkpoint's gigabytes
            kind, tail = dump_kind(f.read(262)), b""
            f.seek(0)
            while kind == "json" and (chunk := f.read(1 << 20)):
                if b'"entries"' in tail + chunk:
                    return False
                tail = chunk[-8:]
    except OSError:
        return False
    if kind == "pickle":
        return False
    if rank is not None and rank not in read:
        return ("rank", rank)
    return "archive" if kind in ("gzip", "tar") else True


def _span(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def format_text(report: dict[str, Any]) -> str:
    """The human-readable form of ``AnalysisResult.to_dict()``: one block per finding."""
    lines = [f"analyzed {len(report['ranks'])} rank(s): {_span(report['ranks'])}"]
    if "pickle_reader" in report:
        lines[0] += f" (pickle reader: {report['pickle_reader']})"
    for q in report.get("torchft_quorums", []):
        lines.append(f"torchft quorum {q['quorum_id']}: {q['path']}{' (read)' if q['read'] else ''}")
    for b in report.get("bundles", []):
        named = _span(b["culprit_ranks"])
        agrees = {True: "the analysis agrees", False: "the analysis does not name them", None: ""}[b["analysis_agrees"]]
        when = {"evict": "kept before the kill", "confirm": "kept when confirmed"}.get(b["trigger"], b["trigger"])
        if not b.get("flight_recorder_shows", True):
            agrees = f"a {b['kind']} fault does not show in Flight Recorder dumps"
        if b.get("unchecked"):
            agrees = f"these dumps cannot check it: {b.get('unchecked_why')}"
        hosts = ", ".join(dict.fromkeys(b.get("culprit_hosts") or []))
        named += f" on {hosts}" if hosts else ""
        lines.append(f"incident bundle {b['id']}: the monitor named rank(s) {named} of replica group {b['replica_group']} "
                     f"({b['kind']}, {when}){'; ' + agrees if agrees else ''}")
        if b.get("summary"):
            lines.append(f"  the monitor's evidence: {b['summary']}")
        for r in b["not_fetched"]:
            lines.append(f"  not fetched from rank {r.get('rank')} ({r.get('url')}): stacks {r.get('stacks')}, fr_trace {r.get('fr_trace')}")
        for x in b["left_out"]:
            lines.append(f"  left out: {x.get('what')}: {x.get('why')}")
    if report["unknown_ranks"]:
        lines.append(f"no dump from rank(s): {_span(report['unknown_ranks'])}")
    for err in report["errors"]:
        where = err.get("path", f"rank {err.get('rank')}")
        lines.append(f"error: {where}: {err['error']}")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    findings = report["findings"]
    if report["ranks"]:
        from .engine import NOTHING_KEPT, NOTHING_RECORDED, WORLD_INFERRED

        # "no findings" would read as a healthy job
        notes = report.get("notes", [])
        empty = "nothing compared" if NOTHING_RECORDED in notes or NOTHING_KEPT in notes else "no findings"
        if any(n.endswith(INCOMPLETE) for n in notes):
            empty = "no findings in the dumps read: incomplete input, not a healthy verdict"
        elif any(WORLD_INFERRED in n for n in notes):
            empty = f"no findings in ranks {_span(report['ranks'])} (the job's size unknown: see note)"
        elif report["unknown_ranks"]:  # a rank that never arrived may be the one without a dump
            empty = f"no findings in the dumps read (none from rank(s) {_span(report['unknown_ranks'])})"
        if report.get("lags") and empty.startswith("no findings"):  # a bundle's straggler may be one
            empty += f"; {len(report['lags'])} lag(s) below"
        lines.append(f"{len(findings)} finding(s)" if findings else empty)
    for f in findings:
        lines.append("")
        where = f"group {f['pg']!r}"
        if f.get("quorum_id") is not None:
            where += f" (torchft quorum {f['quorum_id']}, group_rank {f['group_rank']})"
        elif f.get("replica_group") is not None:
            where += f" (replica group {f['replica_group']})"
        head = f"[{f['kind']}] {where}"
        if f["seq"] is not None:
            head += f" seq {f['seq']}"
        if f["op"]:
            head += f" {f['op']}"
        lines.append(head)
        lines.append(f"  culprits: {_span(f['culprit_ranks']) if f['culprit_ranks'] else 'none known'}")
        lines.append(f"  {f['detail']}")
        if f["kind"] == "mismatch":
            for v in f["variants"]:
                lines.append(f"  ranks {_span(v['ranks'])}: {v['op']} in={v['input_sizes']} out={v['output_sizes']} dtypes={v['input_dtypes']}")
            if f["later_mismatches"]:
                lines.append(f"  {f['later_mismatches']} later sequence id(s) of this group disagree too")
        elif f["kind"] == "hang":
            for rank, act in f["last_activity"].items():
                seq = f["last_seq_by_rank"].get(rank)
                doing = "nothing recorded" if not act else f"pg {act['pg']!r} seq {act['seq']} {act['op']} ({act['state']})"
                last = "no dump (--blame-missing)" if seq is None else f"last seq {seq} in this group"
                lines.append(f"  rank {rank}: {last}; newest entry: {doing}")
            if f["unknown_ranks"]:
                lines.append(f"  unknown: {_span(f['unknown_ranks'])}")
        elif f["kind"] == "straggler":
            lines.append(f"  score {f['score']:.2f} (chance {f['expected']:.2f}, z {f['z']:.1f}) over {f['collectives']} collectives; groups: {', '.join(f['groups'][:5])}")
    for f in report.get("lags", []):  # not findings: the exit status does not count them
        lines.append("")
        lines.append(f"[lag] rank {f['rank']} behind rank {_span(f['peers'])} (not a finding)")
        lines.append(f"  {f['detail']}")
    return "\n".join(map(printable, lines)) + "\n"
