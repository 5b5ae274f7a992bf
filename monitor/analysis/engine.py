"""Cross-rank Flight Recorder analysis: mismatches, hangs and stragglers (docs/analyze.md).
Ranks are matched per process group and ``collective_seq_id``, never by ``record_id``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

from rank_wire.recorders import is_torchft_pg_name

from .columnar import normalize
from .findings import AnalysisResult, Finding, HangFinding, MismatchFinding
from .model import COMPLETED, DumpFormatError, GroupKey, GroupTrace, RankTrace, Signature
from .steps import has_step_pattern, step_pattern_departures
from .stragglers import StragglerConfig, StragglerEvidence

# Why a group got no straggler check: no two of its ranks' clocks can be compared.
UNCHECKED = {
    "no_host": "their dumps name no host and carry no NCCL durations, so no two ranks' clocks "
               "can be compared (--same-host if they come from one host)",
    "own_hosts": "every rank is on a host of its own and the dumps carry no NCCL durations "
                 "(TORCH_NCCL_ENABLE_TIMING), so no two ranks' clocks can be compared",
    "missing": "some of their members left no dump, and a rank is judged against every member",
    "rolled": "some members' dumps hold none of its collectives (their ring buffers rolled "
              "past them? TORCH_FR_BUFFER_SIZE), and a rank is judged against every member",
}
# Dumps that loaded but hold no entry (Flight Recorder's buffer size 0: older torch's default).
NOTHING_RECORDED = ("no collective recorded in any dump: Flight Recorder off? set TORCH_FR_BUFFER_SIZE "
                    "(older torch: TORCH_NCCL_TRACE_BUFFER_SIZE) to the entries to keep, e.g. 2000; "
                    "nothing was compared")
# Dumps that hold no entry though their pg_status counts collectives enqueued.
NOTHING_KEPT = ("no collective entry in any dump, though their pg_status counts collectives enqueued: dumped "
                "with onlyActive (unfinished collectives only) or includeCollectives=False? nothing was "
                "compared")
# Dumps that declare no world (gloo): a job's last ranks without a dump leave no gap to see.
WORLD_INFERRED = "taken from the highest rank read, as no dump declares it (gloo's do not)"
# A gloo collective younger than this when its rank was dumped is in flight, not hung.
MIN_PENDING_S = 1.0


def analyze(dumps: Mapping[int, Mapping[str, Any] | RankTrace], *, blame_missing: bool = False,
            same_host: bool = False, world_size: int | None = None,
            straggler: StragglerConfig | None = None) -> AnalysisResult:
    """The findings over every rank's dump (global rank -> dump dict or :class:`RankTrace`); a dump
    that is not one is an ``errors`` entry. ``same_host``: ranks without ``host`` share a clock."""
    config = straggler or StragglerConfig()
    traces, errors = normalize_dumps(dumps)
    signatures = _share_signatures(traces)
    members, inferred_world = _members(traces, world_size)
    current = _current_groups(members)

    findings: list[Finding] = []
    last_seq: dict[GroupKey, dict[int, int]] = {}
    unknown: set[int] = set()
    evidence = StragglerEvidence(traces)
    full = any(COMPLETED in g.states for t in traces.values() for g in t.groups.values())
    rows_of = {key: {r: traces[r].groups[key] for r in group_members if r in traces and key in traces[r].groups}
               for key, group_members in members.items()}
    # every group's first: a rank's own history spans the incarnations of its group
    disagreements = {key: _disagreements(rows.values()) for key, rows in rows_of.items() if len(rows) >= 2}
    for key in sorted(members, key=GroupKey.order):
        group_members = members[key]
        rows = rows_of[key]
        unknown.update(r for r in group_members if r not in traces)
        if len(rows) >= 2:
            mismatch = _first_mismatch(key, rows, disagreements, traces, signatures)
            if mismatch is not None:
                findings.append(mismatch)
        if key in current:
            testimony = {r: _testimony(traces.get(r), key) for r in group_members}
            last_seq[key] = {r: s for r, s in testimony.items() if s is not None}
            hang = _hang(key, group_members, testimony, rows, traces, signatures, blame_missing, full)
            if hang is not None:
                findings.append(hang)
        if len(rows) == len(group_members) >= 2:
            evidence.add(key, group_members, rows, same_host, config)
        elif len(rows) >= 2 and key in current:
            missing = any(r not in traces for r in group_members)
            evidence.unchecked["missing" if missing else "rolled"].append(key)
    _unblame_blocked([f for f in findings if isinstance(f, HangFinding)], traces)
    stragglers, lags = evidence.findings(config)
    findings.extend(stragglers)
    findings.sort(key=lambda f: f.sort_key())
    lags.sort(key=lambda f: f.sort_key())
    notes = []
    if inferred_world is not None:  # the last ranks without a dump leave no gap to see
        notes.append(f"the job's size, {inferred_world} rank(s), is {WORLD_INFERRED}: pass "
                     "--world-size if it had more")
    if nothing_recorded(traces):
        notes.append(NOTHING_KEPT if any(t.status_enqueued for t in traces.values()) else NOTHING_RECORDED)
    for why, groups in evidence.unchecked.items():
        if groups:
            groups = sorted(groups, key=GroupKey.order)
            notes.append(f"no straggler check in {len(groups)} group(s) ({', '.join(g.label() for g in groups[:5])}"
                         f"{', ...' if len(groups) > 5 else ''}): " + UNCHECKED[why])
    return AnalysisResult(ranks=sorted(traces), unknown_ranks=sorted(unknown), findings=findings,
                          errors=errors, last_seq=last_seq, lags=lags, notes=notes,
                          compared=evidence.compared, compared_across=evidence.compared_across)


def nothing_recorded(traces: Mapping[int, RankTrace]) -> bool:
    """Traces there are, and not one entry in any of them: nothing to compare."""
    return bool(traces) and all(t.last_entry is None for t in traces.values())


def normalize_dumps(dumps: Mapping[int, Mapping[str, Any] | RankTrace]) -> tuple[dict[int, RankTrace], list[dict[str, Any]]]:
    """``(traces by rank, errors)``: a :class:`RankTrace` taken as it is, a dump that is not a
    Flight Recorder dump an ``{"rank": .., "error": ..}`` entry."""
    traces: dict[int, RankTrace] = {}
    errors: list[dict[str, Any]] = []
    for rank, dump in dumps.items():
        if isinstance(dump, RankTrace):
            trace = dump
        else:
            try:
                trace = normalize(dump, rank)
            except DumpFormatError as exc:
                errors.append({"rank": rank, "error": str(exc)})
                continue
        trace.rank = rank
        traces[rank] = trace
    return traces, errors


def _share_signatures(traces: Mapping[int, RankTrace]) -> list[Signature]:
    """Every trace's signature ids renumbered into one shared table (returned)."""
    table: list[Signature] = []
    ids: dict[Any, int] = {}
    for trace in traces.values():
        remap: dict[int | None, int | None] = {None: None}
        known: dict[int, int] = {}  # id() of a signature of this trace -> its shared id
        for local, sig in enumerate(trace.signatures):
            remap[local] = _shared_id(sig, table, ids, known)
        if any(k != v for k, v in remap.items()):
            get = remap.__getitem__
            for group in trace.groups.values():
                group.sigs = list(map(get, group.sigs))
        trace.signatures = table
    return table


def _shared_id(sig: Signature, table: list[Signature], ids: dict[Any, int],
               known: dict[int, int]) -> int:
    # a coalesced one by its parts' ids: a long run's shapes are not hashed a second time
    key: Any = sig
    if sig.parts:
        parts = tuple(map(known.get, map(id, sig.parts)))
        if None in parts:  # a part met first here
            parts = tuple(_shared_id(p, table, ids, known) for p in sig.parts)
        key = ("coalesced", parts)
    gid = ids.get(key)
    if gid is None:
        gid = ids[key] = len(table)
        table.append(sig)
    known[id(sig)] = gid
    return gid


_MAX_WORLD = 1 << 20  # members of "0" told by rank numbers alone, at most (a corrupt dump's 10**9)


def _members(traces: Mapping[int, RankTrace],
             world_size: int | None) -> tuple[dict[GroupKey, list[int]], int | None]:
    """Each group's members: declared (pg_config, incarnations) plus ranks seen in it; and the
    world's size where only the rank numbers read tell it (gloo declares none)."""
    found: dict[GroupKey, set[int]] = defaultdict(set)
    declared: dict[GroupKey, tuple[int, ...]] = {}  # the last list added per group
    for rank, trace in traces.items():
        for key, ranks in trace.members.items():
            if key.pg == "" and not trace.incarnations and key not in trace.groups:
                # gloo's pg_config keeps one "" entry: the ranks of the last group it built
                # (entries say "0" for the default group), so members of the world, not all
                found[GroupKey("0", key.replica_group)].update(ranks)
                continue
            if declared.get(key) != ranks:  # every member declares the same list: add it once
                found[key].update(ranks)
                declared[key] = ranks
        for key in trace.groups:
            found[key].add(rank)
    # the default group "0" spans the world: gloo does not say so, but rank numbers do
    default = GroupKey("0")
    inferred = None
    if default in found and default not in declared:
        size = min(world_size or max(traces) + 1, _MAX_WORLD)
        inferred = None if world_size else size
        found[default].update(range(size))
    return {key: sorted(ranks) for key, ranks in found.items()}, inferred


def _slot(key: GroupKey) -> tuple:
    """What the incarnations of one torchft group share: torchft names its NCCL group per quorum
    (``torchft_quorum_<q>_rank_<r>``), so the name does not, beyond being one of torchft's."""
    if key.quorum_id is not None and is_torchft_pg_name(key.pg):
        return (True, key.pg == "", key.replica_group, key.group_rank)
    return (False, key.pg, key.replica_group, key.group_rank)


def _current_groups(members: Mapping[GroupKey, list[int]]) -> set[GroupKey]:
    """Every group but torchft incarnations older than the latest for their group rank."""
    latest: dict[tuple, int] = {}
    for key in members:
        if key.quorum_id is not None:
            slot = _slot(key)
            latest[slot] = max(latest.get(slot, key.quorum_id), key.quorum_id)
    return {key for key in members if key.quorum_id is None or key.quorum_id == latest[_slot(key)]}


def _first_mismatch(key: GroupKey, rows: Mapping[int, GroupTrace], disagreements: Mapping[GroupKey, set[int]],
                    traces: Mapping[int, RankTrace], signatures: list[Signature]) -> MismatchFinding | None:
    bad = disagreements.get(key)
    if not bad:
        return None
    seq = min(bad)
    at: dict[int, int] = {}  # rank -> what it enqueued at seq
    for rank, t in rows.items():
        i = seq - t.first_seq
        if 0 <= i < len(t.sigs) and t.sigs[i] is not None:
            at[rank] = t.sigs[i]
    counts = Counter(at.values())
    ranked = counts.most_common()
    has_majority = len(ranked) == 1 or ranked[0][1] > ranked[1][1]
    variants = [{"ranks": sorted(r for r, s in at.items() if s == sig_id), **signatures[sig_id].to_dict()}
                for sig_id, _ in ranked]
    departs: list[int] = []
    pattern: list[int] = []
    if has_majority:
        majority = ranked[0][0]
        culprits = sorted(r for r, s in at.items() if s != majority)
        reference = signatures[majority]
        kind = _worst(_difference(reference, signatures[s]) for s in counts if s != majority)
        op = reference.op
        odd = signatures[at[culprits[0]]]
        detail = (
            f"group {key.label()} seq {seq}: rank(s) {_ranks(culprits)} enqueued "
            f"{_describe(odd)} while {ranked[0][1]} rank(s) enqueued "
            f"{_describe(reference)} ({kind} mismatch){_first_part_apart(odd, reference)}"
        )
    else:
        culprits = sorted(at)
        kind = _worst(_difference(signatures[a], signatures[b]) for a in counts for b in counts if a != b)
        op = signatures[ranked[0][0]].op
        detail = (
            f"group {key.label()} seq {seq}: ranks disagree ({kind} mismatch) and no variant has a "
            "majority: " + "; ".join(f"{_ranks(v['ranks'])}: {_describe(signatures[s])}"
                                    f"{_first_part_apart(signatures[s], signatures[ranked[0][0]])}"
                                    for v, (s, _) in zip(variants, ranked, strict=True))
        )
        pattern = step_pattern_departures(traces, key, seq, at)
        if pattern:
            detail += f"; rank(s) {_ranks(pattern)} break their own per-step pattern"
        departs = _departs_from_history(key, seq, at, disagreements, traces, signatures)
        if departs:
            detail += f"; rank(s) {_ranks(departs)} depart from their own history of that collective"
    return MismatchFinding(kind="mismatch", group=key, seq=seq, op=op, culprit_ranks=culprits, detail=detail,
                           mismatch=kind, has_majority=has_majority, variants=variants,
                           later_mismatches=len(bad) - 1, departs_from_history=departs,
                           departs_from_step_pattern=pattern)


def _disagreements(rows: Any) -> set[int]:
    """The sequence ids at which some row differs from the rows' consensus."""
    distinct = _distinct_rows(rows)
    # rows whose ids do not meet are judged apart: ids far apart (a rank restarted, a corrupt
    # dump) must not cost a list as long as the distance between them
    spans = sorted((t.first_seq, t.last_seq, i) for i, t in enumerate(distinct))
    parts: list[list[int]] = []
    end = None
    for first, last, i in spans:
        if end is None or first > end:
            parts.append([])
            end = last
        parts[-1].append(i)
        end = max(end, last)
    if len(parts) > 1:
        return set().union(*(_disagreements([distinct[i] for i in sorted(p)]) for p in parts))
    lo = min(t.first_seq for t in distinct)
    hi = max(t.last_seq for t in distinct)
    consensus: list[int | None] = [None] * (hi - lo + 1)
    # fill from the rows that cover most; only disagreeing rows are walked element by element
    for t in sorted(distinct, key=lambda t: -len(t.sigs)):
        a = t.first_seq - lo
        b = a + len(t.sigs)
        seg = consensus[a:b]
        if seg.count(None) == len(seg):
            consensus[a:b] = t.sigs
        elif None in seg:
            consensus[a:b] = [c if c is not None else s for c, s in zip(seg, t.sigs, strict=True)]
    bad: set[int] = set()
    for t in distinct:
        a = t.first_seq - lo
        seg = consensus[a : a + len(t.sigs)]
        if seg != t.sigs:
            for i, (c, s) in enumerate(zip(seg, t.sigs, strict=True)):
                if c != s and s is not None:
                    bad.add(lo + a + i)
    return bad


_MAX_DISTINCT = 8  # rows compared with each new one; beyond, rows are kept without comparing


def _distinct_rows(rows: Any) -> list[GroupTrace]:
    """The rows not equal to an earlier one (in a healthy job, one)."""
    out: list[GroupTrace] = []
    for t in rows:
        for seen in out[:_MAX_DISTINCT]:
            if seen.first_seq == t.first_seq and seen.sigs == t.sigs:
                break
        else:
            out.append(t)
    return out


def _departs_from_history(key: GroupKey, seq: int, at: Mapping[int, int],
                          disagreements: Mapping[GroupKey, set[int]],
                          traces: Mapping[int, RankTrace], signatures: list[Signature]) -> list[int]:
    """Ranks whose collective at the mismatch is a variant of that op they never enqueued in the
    group's collectives its ranks agree on (every torchft incarnation), though every variant of
    that op they enqueued there they enqueued more than once, in whole steps: a tie-breaker. Not
    "the variant they enqueue most often": FSDP gathers several sizes per step, so a rank's
    correct but rarer variant would "depart" too."""
    slot = _slot(key)
    out = []
    for rank, sig_id in at.items():
        counts: Counter[int | None] = Counter()
        # whole steps: another incarnation (quorums change between steps) or a repeating pattern;
        # inside a first step a variant new to the rank may be the step's next collective
        whole = has_step_pattern(traces[rank].groups.get(key), seq)
        for k, row in traces[rank].groups.items():
            if _slot(k) != slot:
                continue
            counts.update(row.sigs)
            whole = whole or (k != key and any(s is not None for s in row.sigs))
            # each incarnation's disagreements are not its history: a culprit may repeat its fault
            for bad in disagreements.get(k, ()):
                i = bad - row.first_seq
                if 0 <= i < len(row.sigs):
                    counts[row.sigs[i]] -= 1
        op = signatures[sig_id].op
        known = [n for s, n in counts.items() if s is not None and n > 0 and signatures[s].op == op]
        # a variant seen once may be the first of a step not yet seen whole: one or two
        # collectives of history do not show which variants a rank issues
        if whole and counts[sig_id] <= 0 and known and min(known) >= 2:
            out.append(rank)
    return sorted(out)


_SEVERITY = {"op": 3, "size": 2, "dtype": 1}


def _worst(kinds: Any) -> str:
    return max(kinds, key=lambda k: _SEVERITY[k], default="op")


def _difference(a: Signature, b: Signature) -> str:
    if a.op != b.op or len(a.parts) != len(b.parts):
        return "op"
    if a.parts:
        # the parts that differ: an equal pair would read as "size"
        return _worst(_difference(x, y) for x, y in zip(a.parts, b.parts, strict=True) if x != y)
    if a.input_sizes != b.input_sizes or a.output_sizes != b.output_sizes:
        return "size"
    if a.input_dtypes != b.input_dtypes or a.output_dtypes != b.output_dtypes:
        return "dtype"
    return "size"


_SHOWN_PARTS = 8  # a coalesced run described by its first parts: FSDP's can have thousands


def _describe(sig: Signature) -> str:
    if sig.parts:
        shown = ", ".join(_describe(p) for p in sig.parts[:_SHOWN_PARTS])
        more = len(sig.parts) - _SHOWN_PARTS
        return f"coalesced[{shown}{f', ... {more} more' if more > 0 else ''}]"
    sizes = "" if sig.input_sizes is None else f" {[list(s) for s in sig.input_sizes]}"
    # output sizes and dtypes only where they differ from the input's: else two ranks whose
    # all_gather outputs differ, or whose dtypes swapped, read alike
    if sig.output_sizes != sig.input_sizes:
        sizes += f" -> {[list(s) for s in sig.output_sizes or ()]}"
    # str(): a bad dump's non-string dtype is described, not a crash
    ins, outs = ("/".join(sorted({str(d) for d in ds})) for ds in (sig.input_dtypes, sig.output_dtypes))
    dtypes = ins if ins == outs else f"{ins or 'none'} -> {outs or 'none'}"
    return f"{sig.op}{sizes}{' ' + dtypes if dtypes else ''}"


def _first_part_apart(a: Signature, b: Signature) -> str:
    """Where two coalesced runs first differ, when past the parts their descriptions show."""
    n = min(len(a.parts), len(b.parts))
    i = next((i for i in range(n) if a.parts[i] != b.parts[i]), n)
    if i < _SHOWN_PARTS or not (a.parts and b.parts) or a == b:
        return ""
    x, y = (_describe(s.parts[i]) if i < len(s.parts) else "nothing" for s in (a, b))
    return f"; first apart at part {i}: {x} vs {y}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _testimony(trace: RankTrace | None, key: GroupKey) -> int | None:
    """The rank's last sequence id in the group, 0 if it provably enqueued none, else None."""
    if trace is None:
        return None
    # its recorder was off: it lists no group, records nothing; its WorkerServer still lists
    # torchft's incarnations (none resolved to a group: no entry names one)
    off = trace.oldest_record_id is None and not trace.pg_listed
    group = trace.groups.get(key)
    if group is not None:
        return group.last_seq
    if key.quorum_id is not None:
        first = trace.incarnations.get(key)
        if first is not None:
            # nothing of this incarnation retained: fine if the buffer reaches back to its start
            covers = trace.oldest_record_id is None or trace.oldest_record_id <= first
            return 0 if not off and covers and _holds_all(trace, key) else None
        if trace.is_torchft:
            joined = [k.quorum_id for k in trace.incarnations
                      if _slot(k) == _slot(key) or (off and k.group_rank == key.group_rank)]
            if not joined or max(joined) < key.quorum_id:  # type: ignore[operator]
                return 0  # it has not reached this quorum yet (the tracker says so, off or not)
        return None
    if off:
        return None
    status = trace.enqueued.get(key.pg)
    if status is not None:  # NCCL's own count: its entries left out (onlyActive) or not
        return max(status, 0)
    return None if trace.wrapped or not _holds_all(trace, key) else 0


def _holds_all(trace: RankTrace, key: GroupKey) -> bool:
    """Whether the dump would hold the group's entries had the rank enqueued any since its
    oldest entry: not where a filter left the group out, nor where pg_status counts collectives
    the entries leave out (onlyActive keeps unfinished ones only; none kept at all)."""
    if trace.kept_pg is not None:
        return _kept(trace, key) and not _only_active(trace, key)
    if trace.oldest_record_id is None:  # no entry (one whose recorder was off: no testimony)
        return not trace.status_enqueued
    return not _only_active(trace, key)


def _kept(trace: RankTrace, key: GroupKey) -> bool:
    """Whether the dump keeps the group's entries: a filtered one (?pg=) only the group it names."""
    pg = trace.kept_pg
    return pg is None or key.pg == pg or (pg == "torchft" and (key.quorum_id is not None or is_torchft_pg_name(key.pg)))


def _only_active(trace: RankTrace, key: GroupKey) -> bool:
    """An onlyActive dump, of this group too, where pg_status shows collectives completed (NCCL):
    as a WorkerServer's ``filter`` says, or, without one, where no entry kept did. It keeps every
    unfinished entry of the group."""
    if not (trace.status_completed and _kept(trace, key)):
        return False
    if trace.only_active is not None:
        return trace.only_active
    return not any(COMPLETED in g.states for g in trace.groups.values())


def _hang(key: GroupKey, group_members: list[int], testimony: Mapping[int, int | None],
          rows: Mapping[int, GroupTrace], traces: Mapping[int, RankTrace], signatures: list[Signature],
          blame_missing: bool, full: bool) -> HangFinding | None:
    known = {r: s for r, s in testimony.items() if s is not None}
    if blame_missing and known:
        # a rank without a dump is assumed to have done what is known to have completed (NCCL),
        # or all but the newest collective of the slowest rank with a dump (gloo)
        done = [c for c in map(_last_completed, rows.values()) if c is not None]
        assumed = max(done) if done else min(known.values()) - 1
        known.update({r: assumed for r in group_members if r not in traces})
    # not for torchft's cross-group groups (members by replica rank), nor from a dump ?last= cut
    # (its older entries may hold the group's), nor from one of torch's own without entries while
    # others keep completed ones (taken with includeCollectives=False)
    idle = [r for r in group_members if r not in known and r in traces and key.quorum_id is None
            and not is_torchft_pg_name(key.pg) and _only_active(t := traces[r], key) and not t.cut
            and not (full and t.only_active is None and t.last_entry is None)]
    if idle and (open_seqs := [s for t in rows.values() if (s := _first_unfinished(t)) is not None]):
        # onlyActive dumps keep every unfinished entry: a member holding none of the group never
        # enqueued the oldest one another member holds unfinished
        known.update(dict.fromkeys(idle, min(open_seqs) - 1))
    unknown = sorted(r for r in group_members if r not in known)
    if len(known) < 2:
        return None
    newest = max(known.values())
    behind = min(known.values())
    if behind == newest:
        return None
    seq = behind + 1
    culprits = sorted(r for r, s in known.items() if s == behind)
    waiting = sorted(r for r, s in known.items() if s >= seq and r not in idle)
    if all(r in traces and r not in rows for r in waiting):
        # only pg_status counts put them past seq: read at other moments than the laggards',
        # and a rank waiting in seq keeps it among its entries, even in an onlyActive dump
        return None
    op = None
    held = False  # some waiting rank's dump holds seq
    seen = [r for r in waiting if r in rows]  # --blame-missing: a rank without a dump has none
    for r in seen:
        t = rows[r]
        i = seq - t.first_seq
        # seq or a later one completed, so everyone enqueued seq (NCCL completes them in order):
        # the laggards' dumps are older, or theirs is another group of that name (a restart)
        if (done := _last_completed(t)) is not None and done >= seq:
            return None
        if 0 <= i < len(t.sigs):
            held = True
            if op is None and t.sigs[i] is not None:
                op = signatures[t.sigs[i]].op
    if not held and all(r not in rows and r in traces and key.quorum_id is None
                        and traces[r].enqueued.get(key.pg) is not None for r in culprits):
        # a pg_status count alone, with no dump holding the collective after it, blames
        # nobody: NCCL counts a group's send/recv there too when its last work was one
        # (seqP2P), so the number may not be a collective's at all
        return None
    ages = [_pending_for(traces.get(r), rows[r], seq) for r in seen]
    if ages and all(a is not None for a in ages) and max(ages) < MIN_PENDING_S:
        return None  # enqueued just before the dumps were taken: in flight, not (yet) hung
    activity = {r: (traces[r].last_entry if r in traces else None) for r in known}
    if held:
        detail = (
            f"group {key.label()}: rank(s) {_ranks(culprits)} never enqueued collective seq {seq}"
            f"{' (' + op + ')' if op else ''} that rank(s) {_ranks(waiting)} enqueued and wait in"
        )
    else:  # what the others wait in, if anything, is not in their dumps
        detail = (
            f"group {key.label()}: rank(s) {_ranks(culprits)} stopped at collective seq {behind} while "
            f"rank(s) {_ranks(waiting)} went on to seq {newest}; no dump holds seq {seq}, so what they "
            "wait in (if anything) is not shown"
        )
    if inferred := [r for r in culprits if r in idle]:
        detail += f"; rank(s) {_ranks(inferred)} hold no unfinished entry of the group (onlyActive)"
    if unknown:
        detail += f"; no evidence from rank(s) {_ranks(unknown)}"
    if assumed := [r for r in known if r not in traces]:
        detail += f"; rank(s) {_ranks(sorted(assumed))} have no dump: taken as at seq {known[assumed[0]]} (--blame-missing)"
    return HangFinding(kind="hang", group=key, seq=seq, op=op, culprit_ranks=culprits, detail=detail,
                       waiting_ranks=waiting, unknown_ranks=unknown,
                       last_seq_by_rank={r: s for r, s in known.items() if r in traces},
                       last_activity=activity)


def _unblame_blocked(hangs: list[HangFinding], traces: Mapping[int, RankTrace]) -> None:
    """A culprit whose newest entry is unfinished in another hang's group, at its seq or past it
    (NCCL's CPU runs ahead), is blocked by that hang, not a culprit of this one; unless the
    hangs only block each other."""
    waits_in: dict[int, HangFinding] = {}
    for h in hangs:
        for r in h.waiting_ranks:
            e = traces[r].last_entry if r in traces else None
            if e and e["state"] != "completed" and (e["pg"], e.get("quorum_id")) == \
                    (h.group.pg, h.group.quorum_id) and isinstance(e["seq"], int) and e["seq"] >= h.seq:
                waits_in[r] = h

    def free(h: HangFinding, seen: set[int]) -> bool:  # some culprit down the chain is not blocked
        seen.add(id(h))
        return any(c not in waits_in or (id(waits_in[c]) not in seen and free(waits_in[c], seen))
                   for c in h.culprit_ranks)

    blocked = [{c: waits_in[c] for c in h.culprit_ranks if c in waits_in and free(waits_in[c], set())}
               for h in hangs]
    for h, by in zip(hangs, blocked, strict=True):
        if by:
            h.culprit_ranks = [c for c in h.culprit_ranks if c not in by]
            h.blocked_by = {c: {**b.group._asdict(), "seq": b.seq} for c, b in by.items()}
            h.detail += "; " + "; ".join(f"rank {c} is blocked in group {b.group.label()} seq {b.seq} (a hang "
                                         "of its own), not a culprit here" for c, b in by.items())


def _pending_for(trace: RankTrace | None, row: GroupTrace, seq: int) -> float | None:
    # seconds between the rank enqueuing seq and its dump being taken, its own clock
    i = seq - row.first_seq
    if trace is None or trace.dump_time_ns is None or not 0 <= i < len(row.created_ns):
        return None
    created = row.created_ns[i]
    # dumped "before" it was enqueued: the rank's wall clock was set back between, no age
    return (trace.dump_time_ns - created) / 1e9 if 0 < created <= trace.dump_time_ns else None


def _first_unfinished(trace: GroupTrace) -> int | None:
    done = _last_completed(trace)
    first = trace.first_seq if done is None else done + 1
    return first if first <= trace.last_seq else None


def _last_completed(trace: GroupTrace) -> int | None:
    states = trace.states
    for i in range(len(states) - 1, -1, -1):
        if states[i] == COMPLETED:
            return trace.first_seq + i
    return None
