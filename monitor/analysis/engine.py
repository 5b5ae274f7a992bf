"""Cross-rank Flight Recorder analysis: mismatches, hangs and stragglers.

:func:`analyze` takes every rank's dump and returns an
:class:`~monitor.analysis.findings.AnalysisResult`. Ranks are matched per process group
(:class:`~monitor.analysis.model.GroupKey`) and ``collective_seq_id``, never by ``record_id``; a
rank whose ring buffer no longer holds a sequence id simply does not testify about it, so buffers
that wrapped at different points do not create findings.

- ``mismatch``: at one sequence id the members of a group enqueued different collectives (op,
  sizes or dtypes). The culprits are the ranks that differ from the variant most ranks enqueued;
  when no variant has more ranks than every other, every participant is named,
  ``has_majority`` is False, and ``departs_from_history`` names the participants whose
  collective differs from their own usual one for that op. One finding per group (the first
  sequence id that disagrees).
- ``hang``: in a current group (every group, but for torchft's only the latest incarnation) some
  members' last sequence id is below others'. The culprits are the members furthest behind; the
  finding names the first sequence id they never enqueued. On NCCL a sequence id that completed
  anywhere cannot be a hang (everyone joined it; the laggard's dump is just older). gloo records
  no completion, so there the rule is purely "enqueued by some, not by others": a caller polling
  live dumps should confirm a hang persists before acting.
- ``straggler``: a rank that arrives last far more often than chance, by evidence that does not
  compare hosts' clocks: on NCCL, the last rank to arrive has the shortest ``duration_ms`` (its
  peers' kernels were already waiting); otherwise enqueue times among ranks that share a host
  (dump key ``host``, or ``same_host=True``). A rank is flagged only when it was last at least
  ``min_fraction`` of the time, ``min_z`` standard deviations above chance, over at least
  ``min_collectives`` collectives, and its peers waited a median of at least ``min_wait_ms`` and
  ``min_period_fraction`` of the group's period (its median interval between collectives) for
  it, so a job where every rank is noisy but none systematically slow stays quiet.
- ``lag`` (in ``AnalysisResult.lags``, not a finding): where only two ranks are compared (a
  torchft group of two replica groups, two ranks of a group on one host), "who is late" has no
  majority to be judged against, and a heavily loaded host makes one of two processes enqueue a
  little later for long stretches. There a rank counts only when its median lag behind its peer
  reaches ``max(min_lag_ms, min_period_fraction * period)`` in each of ``pair_windows``
  consecutive windows of the collectives; it is reported as a lag, naming both ranks, and becomes
  a ``straggler`` finding only when other evidence agrees: the rank is also a straggler in a
  group of three or more, or lags behind another peer in a second pair.

A member of a group without a dump is reported in ``unknown_ranks``, not as a culprit, unless
``blame_missing=True``.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from operator import sub
from typing import Any

from .findings import AnalysisResult, Finding, HangFinding, MismatchFinding, StragglerFinding
from .model import COMPLETED, DumpFormatError, GroupKey, GroupTrace, RankTrace, Signature, normalize

# A gloo collective younger than this when its rank was dumped is in flight, not hung.
MIN_PENDING_S = 1.0

__all__ = ["analyze", "current_groups", "normalize_dumps", "StragglerConfig"]


@dataclass(frozen=True)
class StragglerConfig:
    """Thresholds for calling a rank a straggler (all must hold)."""

    min_collectives: int = 10  # collectives with evidence the rank took part in
    min_fraction: float = 0.5  # fraction of them at which it arrived last
    min_z: float = 4.0  # standard deviations above what chance gives
    min_wait_ms: float = 1.0  # median time its peers waited for it; also what counts as late
    tie_ms: float = 1e-6  # arrivals closer than this have no "last"
    # How long peers wait must matter against the group's pace: its median interval between
    # consecutive collectives (one step for torchft's one cross-group all_reduce per step).
    min_period_fraction: float = 0.1
    # Two members (no majority says what "on time" is): a rank's median lag behind its one peer
    # must reach max(min_lag_ms, min_period_fraction * period) in each of pair_windows
    # consecutive windows of the collectives; it is reported as a lag unless other evidence
    # agrees (analyze's docstring).
    min_lag_ms: float = 2.0
    pair_windows: int = 3


def analyze(
    dumps: Mapping[int, Mapping[str, Any] | RankTrace],
    *,
    blame_missing: bool = False,
    same_host: bool = False,
    world_size: int | None = None,
    straggler: StragglerConfig | None = None,
    min_pending_s: float = MIN_PENDING_S,
) -> AnalysisResult:
    """Analyze every rank's dump (rank -> raw dump dict or normalized :class:`RankTrace`).

    Keys are global ranks. A dump that is not a Flight Recorder dump becomes an ``errors`` entry;
    the others are still analyzed. ``same_host`` lets enqueue times of ranks without a ``host``
    key be compared (they share one clock); ``world_size`` names the default group's members when
    the dumps do not (gloo), so that ranks without a dump show up as unknown. On gloo (no
    completion state) a collective that the waiting ranks enqueued less than ``min_pending_s``
    before their own dump was taken is in flight, not hung: dumps of a running job are never
    taken at the same instant. That age needs the dump's ``dump_time_ns`` (the WorkerServer
    adds it) and compares only times of one rank's own clock.
    """
    config = straggler or StragglerConfig()
    traces, errors = normalize_dumps(dumps)
    signatures = _share_signatures(traces)
    members = _members(traces, world_size)
    current = _current_groups(members)

    findings: list[Finding] = []
    last_seq: dict[GroupKey, dict[int, int]] = {}
    unknown: set[int] = set()
    evidence = _StragglerEvidence()
    for key in sorted(members, key=_key_order):
        group_members = members[key]
        rows = {r: traces[r].groups[key] for r in group_members if r in traces and key in traces[r].groups}
        unknown.update(r for r in group_members if r not in traces)
        if len(rows) >= 2:
            mismatch = _first_mismatch(key, rows, traces, signatures)
            if mismatch is not None:
                findings.append(mismatch)
        if key in current:
            testimony = {r: _testimony(traces.get(r), key) for r in group_members}
            last_seq[key] = {r: s for r, s in testimony.items() if s is not None}
            hang = _hang(key, group_members, testimony, rows, traces, signatures, blame_missing,
                         min_pending_s)
            if hang is not None:
                findings.append(hang)
        if len(rows) == len(group_members) >= 2:
            evidence.add(key, group_members, rows, traces, same_host, config)
    stragglers, lags = evidence.findings(config)
    findings.extend(stragglers)
    findings.sort(key=lambda f: f.sort_key())
    lags.sort(key=lambda f: f.sort_key())
    return AnalysisResult(
        ranks=sorted(traces),
        unknown_ranks=sorted(unknown),
        findings=findings,
        errors=errors,
        last_seq=last_seq,
        lags=lags,
    )


def normalize_dumps(
    dumps: Mapping[int, Mapping[str, Any] | RankTrace],
) -> tuple[dict[int, RankTrace], list[dict[str, Any]]]:
    """Normalize every rank's dump once: ``(traces by rank, errors)``.

    A :class:`RankTrace` is taken as it is. A dump that is not a Flight Recorder dump becomes an
    ``{"rank": .., "error": ..}`` entry and is left out; the others are still normalized. Callers
    that query the traces beyond :func:`analyze` (the live monitor) normalize with this and pass
    the traces to :func:`analyze`, so that no dump is normalized twice.
    """
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


def current_groups(traces: Mapping[int, RankTrace], world_size: int | None = None) -> dict[GroupKey, list[int]]:
    """Every current group with its members: every group but torchft incarnations older than the
    latest one for their group rank (the groups ``AnalysisResult.last_seq`` covers)."""
    members = _members(traces, world_size)
    return {key: members[key] for key in _current_groups(members)}


def _key_order(key: GroupKey) -> tuple:
    return (key.pg, key.replica_group or -1, key.quorum_id or -1, key.group_rank or -1)


def _share_signatures(traces: Mapping[int, RankTrace]) -> list[Signature]:
    """Re-number every trace's signature ids into one shared table (returned)."""
    table: list[Signature] = []
    ids: dict[Signature, int] = {}
    for trace in traces.values():
        remap: dict[int | None, int | None] = {None: None}
        for local, sig in enumerate(trace.signatures):
            gid = ids.get(sig)
            if gid is None:
                gid = ids[sig] = len(table)
                table.append(sig)
            remap[local] = gid
        if any(k != v for k, v in remap.items()):
            get = remap.__getitem__
            for group in trace.groups.values():
                group.sigs = list(map(get, group.sigs))
        trace.signatures = table
    return table


def _members(traces: Mapping[int, RankTrace], world_size: int | None) -> dict[GroupKey, list[int]]:
    """Each group's members: declared (pg_config, incarnations) plus ranks seen in it."""
    found: dict[GroupKey, set[int]] = defaultdict(set)
    declared: dict[GroupKey, tuple[int, ...]] = {}  # the last list added per group
    for rank, trace in traces.items():
        for key, ranks in trace.members.items():
            # every member of a large group declares the same list: comparing it (C speed)
            # spares adding the same ranks to the set again
            if declared.get(key) != ranks:
                found[key].update(ranks)
                declared[key] = ranks
        for key in trace.groups:
            found[key].add(rank)
    # the default group "0" spans the world: gloo does not say so, but rank numbers do
    if traces:
        world = range(world_size) if world_size else range(max(traces) + 1)
        for key in list(found):
            if key.pg == "0" and key.quorum_id is None and key.replica_group is None:
                declared = any(key in t.members for t in traces.values())
                if not declared:
                    found[key].update(world)
    return {key: sorted(ranks) for key, ranks in found.items()}


def _current_groups(members: Mapping[GroupKey, list[int]]) -> set[GroupKey]:
    """Every group but torchft incarnations older than the latest for their group rank."""
    latest: dict[tuple[str, int | None], int] = {}
    for key in members:
        if key.quorum_id is not None:
            slot = (key.pg, key.group_rank)
            latest[slot] = max(latest.get(slot, key.quorum_id), key.quorum_id)
    return {
        key
        for key in members
        if key.quorum_id is None or key.quorum_id == latest[(key.pg, key.group_rank)]
    }


# ---- mismatch ------------------------------------------------------------------------------


def _first_mismatch(
    key: GroupKey, rows: Mapping[int, GroupTrace], traces: Mapping[int, RankTrace], signatures: list[Signature]
) -> MismatchFinding | None:
    distinct = _distinct_rows(rows.values())
    lo = min(t.first_seq for t in distinct)
    hi = max(t.last_seq for t in distinct)
    consensus: list[int | None] = [None] * (hi - lo + 1)
    # fill from the ranks that cover most, then check every rank against it with C-speed
    # slice comparisons; only disagreeing ranks are walked element by element. A rank whose
    # row equals one seen before changes neither the consensus nor the disagreeing ids.
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
    if not bad:
        return None
    seq = min(bad)
    at: dict[int, int] = {}
    for rank, t in rows.items():
        i = seq - t.first_seq
        if 0 <= i < len(t.sigs) and t.sigs[i] is not None:
            at[rank] = t.sigs[i]
    counts = Counter(at.values())
    ranked = counts.most_common()
    has_majority = len(ranked) == 1 or ranked[0][1] > ranked[1][1]
    variants = []
    for sig_id, _count in ranked:
        ranks = sorted(r for r, s in at.items() if s == sig_id)
        variants.append({"ranks": ranks, **signatures[sig_id].to_dict()})
    departs: list[int] = []
    if has_majority:
        majority = ranked[0][0]
        culprits = sorted(r for r, s in at.items() if s != majority)
        reference = signatures[majority]
        kind = _worst(_difference(reference, signatures[s]) for s in counts if s != majority)
        op = reference.op
        detail = (
            f"group {key.label()} seq {seq}: rank(s) {_ranks(culprits)} enqueued "
            f"{_describe(signatures[at[culprits[0]]])} while {ranked[0][1]} rank(s) enqueued "
            f"{_describe(reference)} ({kind} mismatch)"
        )
    else:
        culprits = sorted(at)
        kind = _worst(_difference(signatures[a], signatures[b]) for a in counts for b in counts if a != b)
        op = signatures[ranked[0][0]].op
        detail = (
            f"group {key.label()} seq {seq}: ranks disagree ({kind} mismatch) and no variant has a "
            "majority: " + "; ".join(f"{_ranks(v['ranks'])}: {_describe(signatures[s])}" for v, (s, _) in zip(variants, ranked, strict=True))
        )
        departs = _departs_from_history(key, seq, at, traces, signatures)
        if departs:
            detail += f"; rank(s) {_ranks(departs)} depart from their own history of that collective"
    return MismatchFinding(
        kind="mismatch",
        group=key,
        seq=seq,
        op=op,
        culprit_ranks=culprits,
        detail=detail,
        mismatch=kind,
        has_majority=has_majority,
        variants=variants,
        later_mismatches=len(bad) - 1,
        departs_from_history=departs,
    )


_MAX_DISTINCT = 8  # rows compared with each new one; beyond, rows are kept without comparing


def _distinct_rows(rows: Any) -> list[GroupTrace]:
    """The rows, in order, without those equal (first sequence id and signature ids) to an
    earlier one: in a healthy job every member of a group enqueued the same collectives."""
    out: list[GroupTrace] = []
    for t in rows:
        for seen in out[:_MAX_DISTINCT]:
            if seen.first_seq == t.first_seq and seen.sigs == t.sigs:
                break
        else:
            out.append(t)
    return out


def _departs_from_history(
    key: GroupKey, seq: int, at: Mapping[int, int], traces: Mapping[int, RankTrace], signatures: list[Signature]
) -> list[int]:
    """Ranks whose collective at ``seq`` differs from the variant of that op they themselves
    enqueued most often in the group's other collectives (every torchft incarnation of it).

    This breaks ties no majority can: a mismatched gloo all_reduce crashes a neighbour, and the
    two surviving dumps disagree. A rank with no history of the op, or no single most common
    variant, is not named (no evidence either way).
    """
    slot = (key.pg, key.replica_group, key.group_rank)
    out = []
    for rank, sig_id in at.items():
        counts: Counter[int | None] = Counter()
        for k, group in traces[rank].groups.items():
            if (k.pg, k.replica_group, k.group_rank) == slot:
                counts.update(group.sigs)
        counts[sig_id] -= 1  # the collective being judged is not its own history
        op = signatures[sig_id].op
        usual = [(s, n) for s, n in counts.most_common() if s is not None and n > 0 and signatures[s].op == op]
        if usual and (len(usual) == 1 or usual[0][1] > usual[1][1]) and usual[0][0] != sig_id:
            out.append(rank)
    return sorted(out)


_SEVERITY = {"op": 3, "size": 2, "dtype": 1}


def _worst(kinds: Any) -> str:
    return max(kinds, key=lambda k: _SEVERITY[k], default="op")


def _difference(a: Signature, b: Signature) -> str:
    if a.op != b.op or len(a.parts) != len(b.parts):
        return "op"
    if a.parts:
        return _worst(_difference(x, y) for x, y in zip(a.parts, b.parts, strict=True))
    if a.input_sizes != b.input_sizes or a.output_sizes != b.output_sizes:
        return "size"
    if a.input_dtypes != b.input_dtypes or a.output_dtypes != b.output_dtypes:
        return "dtype"
    return "size"


def _describe(sig: Signature) -> str:
    if sig.parts:
        return "coalesced[" + ", ".join(_describe(p) for p in sig.parts) + "]"
    sizes = "" if sig.input_sizes is None else f" {[list(s) for s in sig.input_sizes]}"
    # str(): a rank may serve a non-string dtype (bad input); it is described, not a crash.
    dtypes = "/".join(sorted({str(d) for d in (*sig.input_dtypes, *sig.output_dtypes)}))
    return f"{sig.op}{sizes}{' ' + dtypes if dtypes else ''}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


# ---- hang ----------------------------------------------------------------------------------


def _testimony(trace: RankTrace | None, key: GroupKey) -> int | None:
    """The rank's last sequence id in the group, 0 if it provably enqueued none, else None."""
    if trace is None:
        return None
    group = trace.groups.get(key)
    if group is not None:
        return group.last_seq
    if key.quorum_id is not None:
        first = trace.incarnations.get(key)
        if first is not None:
            # nothing of this incarnation retained: fine if the buffer reaches back to its start
            return 0 if trace.oldest_record_id is None or trace.oldest_record_id <= first else None
        if trace.is_torchft:
            joined = [k.quorum_id for k in trace.incarnations if k.pg == key.pg and k.group_rank == key.group_rank]
            if not joined or max(joined) < key.quorum_id:  # type: ignore[operator]
                return 0  # it has not reached this quorum yet
        return None
    return None if trace.wrapped else 0


def _hang(
    key: GroupKey,
    group_members: list[int],
    testimony: Mapping[int, int | None],
    rows: Mapping[int, GroupTrace],
    traces: Mapping[int, RankTrace],
    signatures: list[Signature],
    blame_missing: bool,
    min_pending_s: float = 0.0,
) -> HangFinding | None:
    known = {r: s for r, s in testimony.items() if s is not None}
    if blame_missing and known:
        # a rank without a dump is assumed to have done what is known to have completed (NCCL),
        # or all but the newest collective of the slowest rank with a dump (gloo)
        done = [c for c in map(_last_completed, rows.values()) if c is not None]
        assumed = max(done) if done else min(known.values()) - 1
        known.update({r: assumed for r in group_members if r not in traces})
    unknown = sorted(r for r in group_members if r not in known)
    if len(known) < 2:
        return None
    newest = max(known.values())
    behind = min(known.values())
    if behind == newest:
        return None
    seq = behind + 1
    culprits = sorted(r for r, s in known.items() if s == behind)
    waiting = sorted(r for r, s in known.items() if s >= seq)
    op = None
    for r in waiting:
        t = rows[r]
        i = seq - t.first_seq
        if 0 <= i < len(t.sigs):
            if t.states[i] == COMPLETED:
                return None  # it completed, so everyone joined: the laggards' dumps are older
            if op is None and t.sigs[i] is not None:
                op = signatures[t.sigs[i]].op
    ages = [_pending_for(traces.get(r), rows[r], seq) for r in waiting]
    if ages and all(a is not None for a in ages) and max(ages) < min_pending_s:
        return None  # enqueued just before the dumps were taken: in flight, not (yet) hung
    activity = {r: (traces[r].last_entry if r in traces else None) for r in known}
    detail = (
        f"group {key.label()}: rank(s) {_ranks(culprits)} never enqueued collective seq {seq}"
        f"{' (' + op + ')' if op else ''} that rank(s) {_ranks(waiting)} enqueued and wait in"
    )
    if unknown:
        detail += f"; no evidence from rank(s) {_ranks(unknown)}"
    return HangFinding(
        kind="hang",
        group=key,
        seq=seq,
        op=op,
        culprit_ranks=culprits,
        detail=detail,
        waiting_ranks=waiting,
        unknown_ranks=unknown,
        last_seq_by_rank=dict(known),
        last_activity=activity,
    )


def _pending_for(trace: RankTrace | None, row: GroupTrace, seq: int) -> float | None:
    """Seconds between a rank enqueuing ``seq`` and its dump being taken (its own clock)."""
    i = seq - row.first_seq
    if trace is None or trace.dump_time_ns is None or not 0 <= i < len(row.created_ns):
        return None
    created = row.created_ns[i]
    return (trace.dump_time_ns - created) / 1e9 if created else None


def _last_completed(trace: GroupTrace) -> int | None:
    states = trace.states
    for i in range(len(states) - 1, -1, -1):
        if states[i] == COMPLETED:
            return trace.first_seq + i
    return None


# ---- straggler -----------------------------------------------------------------------------


class _StragglerEvidence:
    """Tallies of who arrived last (and late), per (rank, group), accumulated group by group.

    Each group is judged on its own: a rank slow in one group must not be diluted by groups where
    it waits for others, and several equally slow ranks stand out against their group's others.
    Where only two ranks are compared, their signed gap per collective is kept instead (the pair
    rule, :meth:`findings`).
    """

    def __init__(self) -> None:
        self.observed: Counter[tuple[int, GroupKey]] = Counter()
        self.last: Counter[tuple[int, GroupKey]] = Counter()
        self.expected: defaultdict[tuple[int, GroupKey], float] = defaultdict(float)
        self.variance: defaultdict[tuple[int, GroupKey], float] = defaultdict(float)
        self.waits: defaultdict[tuple[int, GroupKey], list[float]] = defaultdict(list)
        self.late: Counter[tuple[int, GroupKey]] = Counter()
        self.late_waits: defaultdict[tuple[int, GroupKey], list[float]] = defaultdict(list)
        self.kind: dict[tuple[int, GroupKey], str] = {}
        self.groups: defaultdict[GroupKey, list[int]] = defaultdict(list)
        self.period_ms: dict[GroupKey, float] = {}
        # pairs: (group, (a, b)) -> how much later b arrived than a, per collective, in order
        self.pairs: dict[tuple[GroupKey, tuple[int, int]], list[float]] = {}
        self.pair_kind: dict[tuple[GroupKey, tuple[int, int]], str] = {}

    def add(
        self,
        key: GroupKey,
        group_members: list[int],
        rows: Mapping[int, GroupTrace],
        traces: Mapping[int, RankTrace],
        same_host: bool,
        config: StragglerConfig,
    ) -> None:
        lo = max(t.first_seq for t in rows.values())
        hi = min(t.last_seq for t in rows.values())
        if hi < lo:
            return
        self.period_ms[key] = _period_ms([_window(rows[r].created_ns, rows[r].first_seq, lo, hi)
                                          for r in group_members[:3]])
        if all(traces[r].flavour == "nccl" for r in group_members):
            cols = zip(*(_window(rows[r].duration_ms, rows[r].first_seq, lo, hi) for r in group_members), strict=True)
            self._tally(key, group_members, cols, "duration_ms", config)
            return
        by_host: defaultdict[str, list[int]] = defaultdict(list)
        for r in group_members:
            host = traces[r].host or ("" if same_host else None)
            if host is not None:
                by_host[host].append(r)
        for ranks in by_host.values():
            if len(ranks) < 2:
                continue
            # later enqueue = later arrival; negate (in ms) so that the last is the smallest,
            # as with durations
            cols = zip(*(_window(rows[r].created_ns, rows[r].first_seq, lo, hi) for r in ranks), strict=True)
            self._tally(key, ranks, ([-c / 1e6 if c else math.nan for c in col] for col in cols), "host_clock", config)

    def _tally(self, key: GroupKey, ranks: list[int], cols: Any, kind: str, config: StragglerConfig) -> None:
        n = len(ranks)
        if n == 2:
            # both values say "smaller = later": b's lag behind a is a - b
            gaps = [a - b for a, b in cols if a == a and b == b]
            if gaps:
                pair = (key, (ranks[0], ranks[1]))
                self.pairs.setdefault(pair, []).extend(gaps)
                self.pair_kind[pair] = kind
            return
        p = 1.0 / n
        used = 0
        half = n // 2
        last = [0] * n
        late = [0] * n
        waits: list[list[float]] = [[] for _ in ranks]
        late_waits: list[list[float]] = [[] for _ in ranks]
        # read once, not per collective (this loop runs once per collective of every group)
        odd, min_wait_ms, tie_ms = n % 2, config.min_wait_ms, config.tie_ms
        for col in cols:
            total = sum(col)
            if total != total:  # NaN: some rank has no evidence for this collective
                continue
            ordered = sorted(col)
            first = ordered[0]
            used += 1
            median = ordered[half] if odd else (ordered[half - 1] + ordered[half]) / 2
            cutoff = median - min_wait_ms
            if first <= cutoff:
                # ranks that arrived at least min_wait_ms after the median rank
                for i, value in enumerate(col):
                    if value <= cutoff:
                        late[i] += 1
                        late_waits[i].append(median - value)
            if ordered[1] - first <= tie_ms:
                continue
            i = col.index(first)
            last[i] += 1
            waits[i].append(median - first)
        if not used:
            return
        for i, r in enumerate(ranks):
            slot = (r, key)
            if slot not in self.kind:
                self.groups[key].append(r)
            self.observed[slot] += used
            self.expected[slot] += used * p
            self.variance[slot] += used * p * (1 - p)
            self.last[slot] += last[i]
            self.late[slot] += late[i]
            self.waits[slot].extend(waits[i])
            self.late_waits[slot].extend(late_waits[i])
            self.kind[slot] = kind

    def _floor_ms(self, key: GroupKey, config: StragglerConfig, least: float) -> float:
        """What a wait must reach in ``key``: ``least``, and a fraction of the group's period."""
        period = self.period_ms.get(key, math.nan)
        return max(least, config.min_period_fraction * period) if period == period else least

    def findings(self, config: StragglerConfig) -> tuple[list[StragglerFinding], list[StragglerFinding]]:
        """``(stragglers, lags)``. Ranks of groups of three or more are flagged by either rule
        (both need min_collectives, and a median wait of at least min_wait_ms and
        min_period_fraction of the group's period):

        - last: last at >= min_fraction of collectives, min_z above chance (1 / group size);
        - late: at least min_wait_ms behind the median rank at >= min_fraction of collectives,
          min_z above the group's typical rate of being that late (so that several equally slow
          ranks, which take turns being last, are found too; in a noisy job every rank is late
          about as often, so none stands out).

        Pairs (two ranks compared) by the pair rule (:class:`StragglerConfig`), as lags unless
        the same rank is also flagged in a larger group or lags behind another peer.
        One finding per rank, for the group with the strongest evidence.
        """
        flagged: dict[int, list[tuple[float, GroupKey, dict[str, Any]]]] = defaultdict(list)
        for key, ranks in self.groups.items():
            rates = sorted(self.late[(r, key)] / self.observed[(r, key)] for r in ranks)
            typical = min(max(rates[(len(rates) - 1) // 2], 0.02), 0.98)
            floor = self._floor_ms(key, config, config.min_wait_ms)
            for rank in ranks:
                slot = (rank, key)
                observed = self.observed[slot]
                if observed < config.min_collectives:
                    continue
                last, late = self.last[slot], self.late[slot]
                z_last = (last - self.expected[slot]) / (math.sqrt(self.variance[slot]) or 1.0)
                wait_last = _median(self.waits[slot])
                by_last = last / observed >= config.min_fraction and z_last >= config.min_z and wait_last >= floor
                z_late = (late - observed * typical) / math.sqrt(observed * typical * (1 - typical))
                wait_late = _median(self.late_waits[slot])
                by_late = late / observed >= config.min_fraction and z_late >= config.min_z and wait_late >= floor
                if by_last or by_late:
                    z, wait = (z_last, wait_last) if by_last else (z_late, wait_late)
                    flagged[rank].append(
                        (z, key, {"last": last, "late": late, "observed": observed, "z": z, "wait": wait,
                                  "expected": self.expected[slot], "kind": self.kind[slot]})
                    )
        pair_hits = self._pair_hits(config)
        out = []
        lags = []
        for rank, hits in pair_hits.items():
            peers = {h[2]["peer"] for h in hits}
            if rank in flagged or len(peers) >= 2:
                flagged[rank].extend(hits)  # other evidence agrees: an accusation
            else:
                lags.extend(self._finding(rank, [h], config, lag=True) for h in hits)
        for rank, hits in flagged.items():
            hits.sort(key=lambda h: -h[0])
            out.append(self._finding(rank, hits, config))
        return out, lags

    def _pair_hits(self, config: StragglerConfig) -> dict[int, list[tuple[float, GroupKey, dict[str, Any]]]]:
        """Every pair where one rank's median lag behind the other reaches the floor in each of
        ``pair_windows`` consecutive windows: rank -> hits (as ``flagged`` holds them)."""
        hits: dict[int, list[tuple[float, GroupKey, dict[str, Any]]]] = defaultdict(list)
        windows = max(1, config.pair_windows)
        for (key, (a, b)), gaps in self.pairs.items():
            n = len(gaps)
            if n < max(config.min_collectives, windows):
                continue
            floor = self._floor_ms(key, config, config.min_lag_ms)
            lag = _median(gaps)
            late, peer = (b, a) if lag > 0 else (a, b)
            sign = 1.0 if lag > 0 else -1.0
            per_window = [sign * _median(gaps[i * n // windows:(i + 1) * n // windows]) for i in range(windows)]
            if min(per_window) < floor:
                continue
            signed = [sign * g for g in gaps]
            later = sum(1 for g in signed if g > config.tie_ms)
            # z of being later this often against a coin toss, for ordering and the report
            z = (later - n / 2) / (math.sqrt(n / 4) or 1.0)
            hits[late].append(
                (z, key, {"last": later, "late": sum(1 for g in signed if g >= floor), "observed": n, "z": z,
                          "wait": sign * lag, "expected": n / 2, "kind": self.pair_kind[(key, (a, b))],
                          "peer": peer, "windows": per_window, "floor": floor})
            )
        return hits

    def _finding(self, rank: int, hits: list[tuple[float, GroupKey, dict[str, Any]]], config: StragglerConfig,
                 lag: bool = False) -> StragglerFinding:
        _, key, best = hits[0]
        observed = best["observed"]
        if "peer" in best:
            windows = ", ".join(f"{w:.2f}" for w in best["windows"])
            period = self.period_ms.get(key, math.nan)
            detail = (
                f"in group {key.label()} rank {rank} enqueued a median {best['wait']:.2f} ms after its "
                f"only compared peer, rank {best['peer']}, over {observed} collectives (per window: "
                f"{windows} ms; floor {best['floor']:.2f} ms, the group's period {period:.1f} ms; "
                f"{best['kind']})"
            )
            detail += (
                "; with two ranks there is no majority to say which one is off pace: a lag, not a straggler"
                if lag
                else "; other evidence agrees (" + ", ".join(k.label() for _, k, _ in hits[1:] or hits) + ")"
            )
        else:
            detail = (
                f"in group {key.label()} rank {rank} arrived last at {best['last']} and "
                f">= {config.min_wait_ms:g} ms after the median rank at {best['late']} of "
                f"{observed} collectives (chance of last {best['expected'] / observed:.0%}); "
                f"its peers waited a median {best['wait']:.2f} ms for it ({best['kind']})"
            )
        return StragglerFinding(
            kind="lag" if lag else "straggler",
            group=key,
            seq=None,
            op=None,
            culprit_ranks=[rank],
            detail=detail,
            rank=rank,
            score=best["last"] / observed,
            expected=best["expected"] / observed,
            z=best["z"],
            collectives=observed,
            median_wait_ms=best["wait"],
            evidence=best["kind"],
            groups=[k.label() for _, k, _ in hits],
            late_fraction=best["late"] / observed,
            peers=[best["peer"]] if "peer" in best else [],
        )


def _period_ms(created: list[list[int]]) -> float:
    """The median interval between consecutive collectives, ms, over the given ranks' own
    enqueue times (never compared across ranks); NaN when none has two times."""
    periods = []
    for times in created:
        steps = _steps(times)
        if steps:
            periods.append(_median(steps) / 1e6)
    return _median(periods) if periods else math.nan


def _steps(times: Any) -> list:
    """The intervals between consecutive enqueue times, but those next to a missing (0) time
    or going back."""
    if type(times) is array and times.typecode == "q" and 0 not in times:
        # the common case, ints as the loader's workers send them: all at C speed, then checked
        steps = list(map(sub, times[1:], times[:-1]))
        if not steps or min(steps) >= 0:
            return steps
    return [b - a for a, b in pairwise(times) if a and b and b >= a]


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def _window(values: list, first_seq: int, lo: int, hi: int) -> list:
    return values[lo - first_seq : hi - first_seq + 1]
