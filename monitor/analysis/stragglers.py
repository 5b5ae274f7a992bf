"""Stragglers: ranks that keep the other members of a group waiting (docs/analyze.md).
Never comparing two hosts' clocks: NCCL durations, else enqueue times among one host's ranks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from .findings import StragglerFinding
from .model import GroupKey, GroupTrace, RankTrace
from .steps import _period

Hit = tuple[float, GroupKey, dict[str, Any]]  # (z, group, what the finding reports)
# a group's collectives of one signature (None: all of them), or at one position in its step
Class = tuple[GroupKey, int | None, int | None]  # (group, signature, position)


@dataclass(frozen=True)
class StragglerConfig:
    """Thresholds for calling a rank a straggler."""

    min_collectives: int = 10  # collectives with evidence the rank took part in
    min_fraction: float = 0.5  # fraction of them at which it arrived last (or late)
    min_z: float = 4.0  # standard deviations above what chance gives
    min_wait_ms: float = 1.0  # median time its peers waited for it; also what counts as late
    tie_ms: float = 1e-6  # arrivals closer than this have no "last"
    min_period_fraction: float = 0.1  # of the pace (larger groups) or the period (pairs)
    min_lag_ms: float = 2.0  # pairs: the least median lag in each window
    pair_windows: int = 3
    # only the collectives every member enqueued at or after this (ns, each rank's own clock): an
    # incident bundle's finding is judged from its onset, not diluted by the healthy steps before
    since_ns: int | None = None


@dataclass
class _Tally:
    kind: str  # "duration_ms" or "host_clock"
    observed: int = 0  # collectives with evidence from every compared rank
    last: int = 0
    late: int = 0  # at least min_wait_ms after the median rank
    expected: float = 0.0  # times last by chance, and its variance
    variance: float = 0.0
    waits: list[float] = field(default_factory=list)  # the median rank's wait when it was last
    late_waits: list[float] = field(default_factory=list)


class StragglerEvidence:
    """Who arrived last (and late), per group and rank; for pairs, the gap per collective."""

    def __init__(self, traces: Mapping[int, RankTrace]) -> None:
        self.traces = traces
        self.tallies: dict[Class, dict[int, _Tally]] = {}
        self.period_ms: dict[GroupKey, float] = {}
        self.pattern: dict[GroupKey, int] = {}  # collectives a step, where tallied per position
        # (group, position) -> its median step, where the position's signature recurs in the step
        self.step_ms: dict[tuple[GroupKey, int], float] = {}
        # (group, (a, b)) -> how much later b arrived than a, per step (or collective), in order
        self.pairs: dict[tuple[GroupKey, tuple[int, int]], list[float]] = {}
        self.pair_kind: dict[tuple[GroupKey, tuple[int, int]], tuple[str, int]] = {}  # (kind, step)
        # no two ranks' arrivals comparable, no clock shared: groups whose dumps name no host,
        # and groups whose every rank is on a host of its own
        # ...and groups some of whose members' dumps are missing or hold none of its entries
        self.unchecked: dict[str, list[GroupKey]] = {"no_host": [], "own_hosts": [], "missing": [],
                                                     "rolled": []}
        self.compared: set[int] = set()  # ranks whose arrivals were set against a peer's
        # ... in a torchft cross-group group; None while the dumps showed none
        self.compared_across: set[int] | None = None

    def add(self, key: GroupKey, members: list[int], rows: Mapping[int, GroupTrace], same_host: bool,
            config: StragglerConfig) -> None:
        """Tally one group whose every member has a dump (``rows``: each member's trace of it)."""
        if key.quorum_id is not None and self.compared_across is None:
            self.compared_across = set()
        lo = max(t.first_seq for t in rows.values())
        if config.since_ns is not None:
            lo = max(lo, *(_first_since(rows[r], config.since_ns) for r in members))
        hi = min(t.last_seq for t in rows.values())
        if hi < lo:
            return
        # torch records durations only with TORCH_NCCL_ENABLE_TIMING: without them, NCCL's
        # dumps are compared by enqueue times like gloo's
        if all(self.traces[r].flavour == "nccl" and _timed(_window(rows[r].duration_ms, rows[r].first_seq, lo, hi))
               for r in members):
            subsets, kind = [members], "duration_ms"
        else:
            by_host: defaultdict[str, list[int]] = defaultdict(list)
            for r in members:
                host = self.traces[r].host or ("" if same_host else None)
                if host is not None:
                    by_host[host].append(r)
            subsets, kind = [ranks for ranks in by_host.values() if len(ranks) >= 2], "host_clock"
            if not subsets:
                named = all(self.traces[r].host for r in members)  # else --same-host may help
                self.unchecked["own_hosts" if named else "no_host"].append(key)
        first = rows[members[0]]
        sigs = _window(first.sigs, first.first_seq, lo, hi)
        varied = len(set(sigs)) > 1
        pair = any(len(ranks) == 2 for ranks in subsets)
        pattern = step = 1
        if pair or (varied and subsets):
            # a rank slow before a step's first collective is late there only, the rest of the
            # step in sync: a pair's lags are summed per step (one period of its pattern of
            # collectives, read from its newest 600, also before the window), a larger group's
            # collectives judged per position in the step
            end = hi - first.first_seq + 1
            recent = first.sigs[max(0, end - 600):end]
            found = _period(recent, -1)
            if found == 1 and varied:  # long runs of one signature hold period 1 for 9 in 10
                found = _period(_runs(recent), -1)
            pattern = found or 1
        if pair:
            step = pattern if (hi - lo + 1) // pattern >= config.pair_windows else 1
            self.period_ms[key] = _period_ms([_window(rows[r].created_ns, rows[r].first_seq, lo, hi)[::step]
                                              for r in members[:3]])
        for ranks in subsets:
            if kind == "duration_ms":
                cols = zip(*(_window(rows[r].duration_ms, rows[r].first_seq, lo, hi) for r in ranks), strict=True)
            else:
                # later enqueue = later arrival; negated (ms) so that the last is the smallest
                times = zip(*(_window(rows[r].created_ns, rows[r].first_seq, lo, hi) for r in ranks), strict=True)
                cols = ([-c / 1e6 if c else math.nan for c in col] for col in times)
            if len(ranks) == 2:
                self._pair(key, ranks, cols, kind, step, step == pattern, config)
                continue
            if not varied:
                self._tally((key, None, None), ranks, cols, kind, config)
                continue
            # a rank late into one of a step's collectives is last at too few of the group's
            # to stand out: each position in the step (one signature; a signature may repeat in
            # a step, as FSDP's all_gathers of identical blocks), else each signature, on its own
            cols = list(cols)
            # per position: times its ranks only where a position has 10 steps, not 10 collectives
            self._tally((key, None, None), ranks, cols, kind, config, compare=pattern == 1)
            if pattern > 1:
                self.pattern[key] = pattern
                step_ms = _period_ms([_window(rows[r].created_ns, rows[r].first_seq, lo, hi)[::pattern]
                                      for r in members[:3]])
                for pos in range(pattern):
                    part = cols[pos::pattern]
                    if len(part) >= config.min_collectives:
                        self._tally((key, sigs[pos], pos), ranks, part, kind, config)
                        if sigs[:pattern].count(sigs[pos]) > 1:
                            self.step_ms[(key, pos)] = step_ms
                continue
            by_sig: defaultdict[int, list] = defaultdict(list)
            for sig, col in zip(sigs, cols, strict=True):
                by_sig[sig].append(col)
            for sig, part in by_sig.items():
                if sig is not None and len(part) >= config.min_collectives:
                    self._tally((key, sig, None), ranks, part, kind, config)

    def _pair(self, key: GroupKey, ranks: list[int], cols: Any, kind: str, step: int, whole: bool,
              config: StragglerConfig) -> None:
        """``step`` collectives' lags summed into one; not ``whole``: fewer steps than windows, so
        judged per collective, which cannot clear a rank late at one collective of a step."""
        gaps = [a - b for a, b in cols]  # both values say "smaller = later": b's lag behind a
        if step > 1:
            gaps = [sum(gaps[i:i + step]) for i in range(0, len(gaps) - step + 1, step)]
        gaps = [g for g in gaps if g == g]  # NaN: a collective without evidence
        if whole and len(gaps) * step >= config.min_collectives:
            self._compared(key, ranks)
        if gaps:
            pair = (key, (ranks[0], ranks[1]))
            self.pairs.setdefault(pair, []).extend(gaps)
            self.pair_kind[pair] = (kind, step)

    def _compared(self, key: GroupKey, ranks: list[int]) -> None:
        self.compared.update(ranks)
        if key.quorum_id is not None and self.compared_across is not None:
            self.compared_across.update(ranks)

    def _tally(self, cls: Class, ranks: list[int], cols: Any, kind: str, config: StragglerConfig,
               compare: bool = True) -> None:
        n = len(ranks)
        p = 1.0 / n
        used = 0
        half = n // 2
        last = [0] * n
        late = [0] * n
        waits: list[list[float]] = [[] for _ in ranks]
        late_waits: list[list[float]] = [[] for _ in ranks]
        # one pass per collective of every group: the analyzer's hot loop (bench_analyze.py)
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
        if compare and used >= config.min_collectives:  # fewer time no one (a bundle's few since its onset)
            self._compared(cls[0], ranks)
        group = self.tallies.setdefault(cls, {})
        for i, r in enumerate(ranks):
            t = group.setdefault(r, _Tally(kind))
            t.observed += used
            t.expected += used * p
            t.variance += used * p * (1 - p)
            t.last += last[i]
            t.late += late[i]
            t.waits.extend(waits[i])
            t.late_waits.extend(late_waits[i])

    def findings(self, config: StragglerConfig) -> tuple[list[StragglerFinding], list[StragglerFinding]]:
        """``(stragglers, lags)``: one straggler finding per rank (its strongest group's), a lag
        per pair where nothing else agrees."""
        flagged: dict[int, list[Hit]] = defaultdict(list)
        pooled: dict[GroupKey, float] = {}  # a group's typical late rate, its whole tally's (added first)
        for (key, sig, pos), group in self.tallies.items():
            rates = sorted(t.late / t.observed for t in group.values())
            typical = min(max(rates[(len(rates) - 1) // 2], 0.02), 0.98)
            if sig is None:
                pooled[key] = typical
            floor = None
            for rank, t in group.items():
                observed, last, late = t.observed, t.last, t.late
                if observed < config.min_collectives:
                    continue
                z_last = (last - t.expected) / (math.sqrt(t.variance) or 1.0)
                z_late = (late - observed * typical) / math.sqrt(observed * typical * (1 - typical))
                wait_last, wait_late = _median(t.waits), _median(t.late_waits)
                by_last = last / observed >= config.min_fraction and z_last >= config.min_z and wait_last >= config.min_wait_ms
                by_late = late / observed >= config.min_fraction and z_late >= config.min_z and wait_late >= config.min_wait_ms
                if pos is not None:
                    # a step's many positions, each of few collectives (one a step): jitter makes
                    # one rank stand out at one of them unless each is held to chance divided
                    # among them, exactly (a binomial tail): of last, among the ranks it is
                    # compared with (its host's, by enqueue time); of late, the group's whole
                    # typical rate (a position's own, from so few, is too rough)
                    chance = 0.5 * math.erfc(config.min_z / math.sqrt(2)) / self.pattern[key]
                    by_last = by_last and _tail(observed, last, t.expected / observed) <= chance
                    by_late = by_late and _tail(observed, late, max(pooled.get(key, typical), typical)) <= chance
                if not (by_last or by_late):
                    continue
                if floor is None:  # only for a group with a candidate: it reads every rank's enqueues
                    floor = _floor(self._pace_ms(list(group)[:3], config.since_ns or 0), config, config.min_wait_ms)
                    if pos is not None:
                        # a signature recurring in the step has no tally of its own, so a position's
                        # one collective a step is judged as a pair's lag is, against the step
                        floor = max(floor, _floor(self.step_ms.get((key, pos), math.nan), config, config.min_wait_ms))
                by_last = by_last and wait_last >= floor
                by_late = by_late and wait_late >= floor
                if by_last or by_late:
                    z, wait = (z_last, wait_last) if by_last else (z_late, wait_late)
                    flagged[rank].append(
                        (z, key, {"last": last, "late": late, "observed": observed, "z": z, "wait": wait,
                                  "expected": t.expected, "kind": t.kind, "sig": sig, "pos": pos})
                    )
        out, lags = [], []
        for rank, hits in self._pair_hits(config).items():
            peers = {h[2]["peer"] for h in hits}
            if rank in flagged or len(peers) >= 2:
                flagged[rank].extend(hits)  # other evidence agrees: an accusation
            else:
                lags.extend(self._finding(rank, [h], config, lag=True) for h in hits)
        for rank, hits in flagged.items():
            # a group's whole tally and one signature's: one hit, the one its peers waited
            # longest in (the late collective's, not the group's diluted median)
            best: dict[GroupKey, Hit] = {}
            pairs = []
            for h in hits:
                if "peer" in h[2]:
                    pairs.append(h)
                elif h[1] not in best or h[2]["wait"] > best[h[1]][2]["wait"]:
                    best[h[1]] = h
            hits = pairs + list(best.values())
            hits.sort(key=lambda h: -h[0])
            out.append(self._finding(rank, hits, config))
        return out, lags

    def _pace_ms(self, ranks: list[int], since_ns: int) -> float:
        return _period_ms([sorted(t for g in self.traces[r].groups.values() for t in g.created_ns if t and t >= since_ns)
                           for r in ranks])

    def _pair_hits(self, config: StragglerConfig) -> dict[int, list[Hit]]:
        """The later rank -> its hits: pairs where its median lag (per step, or per collective)
        reaches the floor in each of ``pair_windows`` windows."""
        hits: dict[int, list[Hit]] = defaultdict(list)
        windows = max(1, config.pair_windows)
        for (key, (a, b)), gaps in self.pairs.items():
            n = len(gaps)
            kind, step = self.pair_kind[(key, (a, b))]
            if n < windows or n * step < config.min_collectives:
                continue
            floor = _floor(self.period_ms.get(key, math.nan), config, config.min_lag_ms)
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
                          "wait": sign * lag, "expected": n / 2, "kind": kind, "step": step,
                          "peer": peer, "windows": per_window, "floor": floor})
            )
        return hits

    def _finding(self, rank: int, hits: list[Hit], config: StragglerConfig, lag: bool = False) -> StragglerFinding:
        _, key, best = hits[0]
        observed, step = best["observed"], best.get("step", 1)
        if "peer" in best:
            windows = ", ".join(f"{w:.2f}" for w in best["windows"])
            period = self.period_ms.get(key, math.nan)
            per, over = (f" a step (its {step} collectives' lags summed)", f"{observed} steps") if step > 1 \
                else ("", f"{observed} collectives")
            detail = (
                f"in group {key.label()} rank {rank} enqueued a median {best['wait']:.2f} ms{per} after its "
                f"only compared peer, rank {best['peer']}, over {over} (per window: "
                f"{windows} ms; floor {best['floor']:.2f} ms, the group's {'step' if step > 1 else 'period'} "
                f"{period:.1f} ms; {best['kind']})"
            )
            detail += ("; with two ranks there is no majority to say which one is off pace: a lag, not a straggler"
                       if lag else "; other evidence agrees (" + ", ".join(k.label() for _, k, _ in hits[1:] or hits) + ")")
        else:
            sig = best.get("sig")
            which = "" if sig is None else f" {self.traces[rank].signatures[sig].op}"
            which += " collectives" + (f", the same one of each step's {self.pattern[key]}"
                                       if best.get("pos") is not None else "")
            detail = (
                f"in group {key.label()} rank {rank} arrived last at {best['last']} and "
                f">= {config.min_wait_ms:g} ms after the median rank at {best['late']} of "
                f"{observed}{which} (chance of last {best['expected'] / observed:.0%}); "
                f"its peers waited a median {best['wait']:.2f} ms for it ({best['kind']})"
            )
        return StragglerFinding(
            kind="lag" if lag else "straggler", group=key, seq=None, op=None, culprit_ranks=[rank], detail=detail,
            rank=rank, score=best["last"] / observed, expected=best["expected"] / observed, z=best["z"],
            collectives=observed * step, median_wait_ms=best["wait"], evidence=best["kind"],
            groups=[k.label() for _, k, _ in hits], late_fraction=best["late"] / observed,
            peers=[best["peer"]] if "peer" in best else [])


def _floor(scale_ms: float, config: StragglerConfig, least: float) -> float:
    return max(least, config.min_period_fraction * scale_ms) if scale_ms == scale_ms else least


def _period_ms(created: list[Any]) -> float:
    """The median interval between a rank's consecutive enqueues, ms; NaN when none has two."""
    periods = []
    for times in created:
        steps = [b - a for a, b in pairwise(times) if a and b and b >= a]
        if steps:
            periods.append(_median(steps) / 1e6)
    return _median(periods) if periods else math.nan


def _runs(sigs: list[int | None]) -> list[Any]:
    """Each signature with its place in its run of equal ones: a step of long runs (FSDP's
    identical blocks, all_gathers then reduce_scatters) repeats only over the whole step."""
    out, run = [], 0
    for i, sig in enumerate(sigs):
        run = run + 1 if i and sig == sigs[i - 1] else 0
        out.append((sig, run))
    return out


def _tail(n: int, k: int, p: float) -> float:
    """The chance of at least ``k`` of ``n`` trials, each ``p``."""
    lp, lq, ln = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    return sum(math.exp(ln - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
               for i in range(k, n + 1))


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def _timed(durations: Any) -> bool:
    return any(d == d for d in durations)  # NaN: no duration


def _first_since(row: GroupTrace, since_ns: int) -> int:
    """The first sequence id of ``row`` enqueued at or after ``since_ns`` (past its last: none)."""
    return row.first_seq + next((i for i, t in enumerate(row.created_ns) if t >= since_ns), len(row.sigs))


def _window(values: Any, first_seq: int, lo: int, hi: int) -> Any:
    return values[lo - first_seq : hi - first_seq + 1]
