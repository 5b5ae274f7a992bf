"""``network``: the host whose network is bad, placed from the probe mesh's rounds; the rule:
docs/monitor.md (Network faults: finding the host). A missing row or fewer than three hosts name
nobody.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from monitor.config import ProbeConfig
from monitor.evidence.probes import ProbeRound
from monitor.evidence.view import ClusterView

from .findings import JOB_KINDS, Finding, Findings

log = logging.getLogger(__name__)

# a link "from" h is one h's rank was asked to measure: it fetched the payload from the peer
WHICH = {"both": "every link of {h}", "from": "every transfer {h} fetched",
         "to": "every transfer fetched from {h}"}
OTHERS_FINE = 0.75  # of the links among the hosts above suspicion, at least this many fine
# a rank's transfer from itself under this many times its bad links' best rate explains them
EXPLAINS = 2.0
# rounds in a row whose slow links are not judged while a rank heals (its transfer fills links)
HEAL_ROUNDS = 10


@dataclass
class Link:
    src: str
    dst: str
    ok: bool
    mbit_s: float | None
    error: str | None = None

    def fine(self, ref: float, ratio: float) -> bool:
        return self.ok and self.mbit_s is not None and self.mbit_s >= ratio * ref


@dataclass
class Verdict:
    text: str
    lines: dict[str, str] = field(default_factory=dict)  # culprit host -> why (usually one)
    bad: dict[str, list[str]] = field(default_factory=dict)  # culprit -> its links, described
    links: dict[str, list[Link]] = field(default_factory=dict)  # culprit -> its bad links
    spared: list[str] = field(default_factory=list)  # hosts whose own process explains them
    reference_mbit_s: float | None = None  # the other hosts' median link, the culprits judged by

    @property
    def hosts(self) -> list[str]:
        return list(self.lines)


def gist(probe: dict | None) -> tuple:
    """A round's verdict without its rates (not every round's are news): whom, and why."""
    p = probe or {}
    # a number on its own (a rate, a count), not one in a host's name (node-3, h2, 10.0.0.3)
    # nor an HTTP status (a 503 before the rank is not a 500 in it)
    return tuple(p.get("culprit_hosts") or ()), re.sub(
        r"(?<![\w.-])(?<!HTTP )\d+(?:\.\d+)?(?![\w-]|\.\d)", "#", p.get("verdict") or "")


def _describe(link: Link) -> str:
    how = f"{link.mbit_s:.1f} Mbit/s" if link.ok and link.mbit_s is not None else \
        f"failed: {link.error or 'no transfer'}"
    return f"{link.src} -> {link.dst}: {how}"


def _ref(links: list[Link], apart: set[str]) -> float | None:
    """The median rate of the links that work and touch none of ``apart``."""
    rates = [x.mbit_s for x in links if x.ok and x.mbit_s and x.src not in apart
             and x.dst not in apart]
    return statistics.median(rates) if rates else None


def _sides(h: str, links: list[Link], good: Callable[[Link], bool]) -> list[str]:
    """The directions ("from", "to") in which none of ``h``'s links is ``good``."""
    sides = {"from": [x for x in links if x.src == h], "to": [x for x in links if x.dst == h]}
    return [side for side, xs in sides.items() if xs and not any(good(x) for x in xs)]


def _bad_sides(h: str, links: list[Link], ref: float | None, ratio: float) -> list[str]:
    """The directions in which none of ``h``'s links is fine against ``ref``."""
    return [] if ref is None else _sides(h, links, lambda x: x.fine(ref, ratio))


def _name(out: Verdict, h: str, sides: list[str], links: list[Link], why: str) -> None:
    """Name ``h`` in ``out`` for its links in ``sides``; ``why`` is said of them ({n}: how many)."""
    shown = [x for x in links if (x.src == h and "from" in sides) or (x.dst == h and "to" in sides)]
    out.bad[h] = [_describe(x) for x in shown]
    out.links[h] = shown
    which = WHICH["both" if len(sides) == 2 else sides[0]].format(h=h)
    out.lines[h] = f"{which} {why.format(n=len(shown))}"


def place(rnd: ProbeRound, ratio: float, rates: bool = True) -> Verdict:
    """The verdict on one round; without ``rates``, hosts cut off only. A culprit whose rank is
    as slow serving itself (:func:`_busy`) is spared: its process slowed its links."""
    out = _place(rnd, ratio, rates)
    busy = {h: why for h in out.hosts if (why := _busy(h, rnd, out.links[h], ratio))}
    if not busy:
        return out
    for h in busy:
        for d in (out.lines, out.bad, out.links):
            d.pop(h)
    out.spared = list(busy)
    spared = "; ".join(f"not {h}: {why}" for h, why in busy.items())
    out.text = "; ".join([*out.lines.values(), spared]) if out.lines else f"no culprit: {spared}"
    return out


def _busy(h: str, rnd: ProbeRound, bad: list[Link], ratio: float) -> str | None:
    """Why ``h``'s bad links measure its rank's process, not its network: its transfer from
    itself (no network in it) failed, or is under ``ratio`` x the other ranks' median and under
    :data:`EXPLAINS` x its bad links' best; None when it cannot be told (no control sent)."""
    controls = rnd.controls()
    mine = controls.get(h)
    others = [c["mbit_s"] for o, c in controls.items() if o != h and c["ok"] and c["mbit_s"]]
    if mine is None or not others:
        return None
    ref = statistics.median(others)
    if not mine["ok"]:
        # the kernel completes a connect without the process: only a transfer that failed
        # points at the process; a connect that failed points at the network
        if not str(mine.get("error") or "").startswith("transfer:"):
            return None
        return (f"its rank cannot serve itself either ({mine['error']}) while the others do "
                f"at a median {ref:.1f} Mbit/s: its process is stuck or busy")
    rate = mine["mbit_s"]
    best = max((x.mbit_s for x in bad if x.ok and x.mbit_s), default=None)
    if rate is None or best is None or rate >= ratio * ref or rate >= EXPLAINS * best:
        return None
    return (f"its rank serves itself at {rate:.1f} Mbit/s (the others at a median "
            f"{ref:.1f}), as slow as its links: its process is busy")


def _place(rnd: ProbeRound, ratio: float, rates: bool) -> Verdict:
    missing = rnd.missing()
    if missing:
        return Verdict("no culprit: no probe results from " + ", ".join(
            f"{h} ({why})" for h, why in missing.items()))
    hosts = sorted(rnd.probes)
    if len(hosts) < 3:
        return Verdict(f"no culprit: {len(hosts)} host(s) probed; a bad link between two "
                       "hosts cannot be placed on either")
    links = [Link(src, dst, bool(row.get("ok")), row.get("mbit_s"), row.get("error"))
             for src, row_of in rnd.matrix().items() for dst, row in row_of.items()]
    cut = _cut_off(hosts, links)
    if cut.lines:
        return cut
    if not rates:
        return Verdict("no culprit: a rank heals, its transfer fills links: only hosts cut off "
                       "are judged")
    # suspects: a direction of theirs all bad against the links that do not touch them
    suspects = [h for h in hosts if _bad_sides(h, links, _ref(links, {h}), ratio)]
    out = Verdict("")
    clean_ref = _ref(links, set(suspects))
    clean = [x for x in links if x.src not in suspects and x.dst not in suspects]
    if suspects and 2 * len(suspects) < len(hosts) and clean_ref is not None \
            and sum(x.fine(clean_ref, ratio) for x in clean) >= math.ceil(OTHERS_FINE * len(clean)):
        for h in suspects:  # judged again against the links among the hosts above suspicion
            bad = _bad_sides(h, links, clean_ref, ratio)
            if not bad:
                continue
            out.reference_mbit_s = round(clean_ref, 3)
            _name(out, h, bad, links, f"is bad ({{n}}: under {ratio:g} x {clean_ref:.1f} Mbit/s, "
                  "the median of the other hosts' links, or failed) while the links among the "
                  "other hosts are good")
    if out.lines:
        out.text = "; ".join(out.lines.values())
        return out
    rates = [x.mbit_s for x in links if x.ok and x.mbit_s]
    if not rates:
        return Verdict(f"no culprit: every link failed alike ({len(links)} links)")
    ref = statistics.median(rates)
    bad = [x for x in links if not x.fine(ref, ratio)]
    if not bad:
        return Verdict(f"no culprit: every link alike ({len(links)} links, median "
                       f"{ref:.1f} Mbit/s, slowest {min(rates):.1f})")
    return Verdict(f"no culprit: {len(bad)} of {len(links)} links bad and no host in all "
                   f"of them ({'; '.join(_describe(x) for x in bad[:6])})")


def _cut_off(hosts: list[str], links: list[Link]) -> Verdict:
    """Hosts with every link in one direction failed while the links among the others connect:
    judged on connecting alone, as the rates of working links vary with load."""
    cut = {h: sides for h in hosts if (sides := _sides(h, links, lambda x: x.ok))}
    rest = [x for x in links if x.src not in cut and x.dst not in cut]
    out = Verdict("")
    if not cut or 2 * len(cut) >= len(hosts) or not rest \
            or sum(x.ok for x in rest) < math.ceil(OTHERS_FINE * len(rest)):
        return out
    for h, failed in cut.items():
        _name(out, h, failed, links, "failed ({n}) while the links among the other hosts connect")
    out.reference_mbit_s = _ref(links, set(cut))
    out.text = "; ".join(out.lines.values())
    return out


class Network:
    def __init__(self, cfg: ProbeConfig, findings: Findings) -> None:
        self.cfg, self.findings = cfg, findings
        self._streak: dict[str, tuple[int, float]] = {}  # host -> (rounds in a row, first at)
        self._heal_rounds = 0  # rounds in a row judged while a rank heals
        # open network finding -> (its hosts, full rounds in a row clear of them)
        self._clean: dict[tuple, tuple[tuple, int]] = {}
        self._said: tuple = ()  # the last verdict logged
        # finding key -> (the open finding, hosts a refresh named that it had not charged)
        self._added: dict[tuple, tuple[Finding, list[str]]] = {}

    def judge(self, view: ClusterView, rnd: ProbeRound | None, now: float,
              blind: str | None, pending: bool = False) -> list[Finding]:
        """``pending``: a job-wide finding is on its way (or held by an eviction); rounds then
        count towards a host's streak, but only an open one confirms a host, and the job has
        not recovered."""
        findings = self.findings
        jobs = [f for k, f in findings.open.items() if k[0] in JOB_KINDS]
        if not jobs:
            self._said = ()  # the next job-wide finding's first verdict is said again
        if not jobs and not pending:
            # recovered only once a step committed since the finding opened: a job stopped for
            # good (its quorum re-forming and failing) may close every job-wide finding
            top = view.newest_step()
            for key, f in list(findings.open.items()):
                if key[0] == "network" and ((s := f.evidence.get("step")) is None
                                            or top is not None and top > s):
                    findings.resolve(key, "job_recovered", now)
            self._streak, self._heal_rounds = {}, 0
            return []
        if rnd is None or blind:
            return []  # a round finished blind is not evidence
        healing = any((r.state or {}).get("phase") == "healing" for gv in view.groups.values()
                      for r in gv.reachable)
        self._heal_rounds = self._heal_rounds + 1 if healing else 0
        # a heal's checkpoint transfer fills its sender's and receiver's links (and their
        # processes' time): meanwhile slow links name nobody, a host cut off still does
        rates = self._heal_rounds == 0 or self._heal_rounds > HEAL_ROUNDS
        verdict = place(rnd, self.cfg.slow_ratio, rates)
        summary = {"at": rnd.finished_at, "verdict": verdict.text, "culprit_hosts": verdict.hosts,
                   "missing": rnd.missing(), **rnd.to_json()}
        for f in jobs:
            f.evidence["probe"] = summary
        said = gist(summary)
        if jobs and said != self._said:
            log.info("probe round for %s: %s", ", ".join(sorted({f.kind for f in jobs})),
                     verdict.text)
            self._said = said
        was = self._streak
        self._streak = {h: (was[h][0] + 1, was[h][1]) if h in was else (1, now)
                        for h in verdict.hosts}
        if not rates:  # a heal's round judged no rate: a slow host's streak waits, not ends
            self._streak = {**was, **self._streak}
        # a host spared for its own process is not judged this round: its streak waits and its
        # finding stays (its links are no better)
        self._streak.update({h: was[h] for h in verdict.spared if h in was})
        if not rnd.missing() and rates:  # a full round that measured a host, naming it no more
            for key, f in list(findings.open.items()):
                if key[0] != "network":
                    continue
                hosts = f.evidence.get("hosts") or [f.evidence.get("host")]
                if any(h not in rnd.probes or h in verdict.hosts or h in verdict.spared
                       for h in hosts):
                    self._clean.pop(key, None)
                    continue
                # as many rounds in a row as named it: one round of every link slow alike (the
                # ranks busy serving a bundle) is no evidence its links are good again; counted
                # afresh once the finding moved to other hosts
                was = self._clean.get(key)
                n = was[1] + 1 if was is not None and was[0] == tuple(hosts) else 1
                self._clean[key] = (tuple(hosts), n)
                if n >= self.cfg.rounds:
                    findings.resolve(key, "links_good", now)
        self._clean = {k: n for k, n in self._clean.items() if k in findings.open}
        confirmed = [h for h in verdict.hosts if self._streak[h][0] >= self.cfg.rounds]
        if not confirmed or not jobs:
            return []
        new = []
        for gv in view.in_quorum():
            # one finding per group, every named host's ranks in it: a group on two bad
            # hosts is one group to evict, and each host is charged (its culprits)
            on = {h: ranks for h in confirmed if (ranks := sorted(
                r.rank for r in gv.reachable if r.rank is not None
                and (r.state or {}).get("host") == h))}
            if not on:
                continue
            hosts = sorted(on)
            n = min(self._streak[h][0] for h in hosts)
            first = min(self._streak[h][1] for h in hosts)
            ev = {"host": hosts[0], "hosts": hosts,
                  "summary": "; ".join(verdict.lines[h] for h in hosts)
                  + f": the network of host{'s' if len(hosts) > 1 else ''} "
                  f"{', '.join(hosts)} is the fault ({n} probe rounds in a row); replica "
                  f"group {gv.replica_group} runs there",
                  "reference_mbit_s": verdict.reference_mbit_s,
                  "slow_ratio": self.cfg.slow_ratio, "rounds": n,
                  "links": [x for h in hosts for x in verdict.bad[h]],
                  "job_findings": sorted(f.kind for f in jobs),
                  "probe": {"bytes": self.cfg.size_bytes, "timeout_s": self.cfg.timeout_s,
                            **summary}}
            # the hosts charged: a host confirmed a round after its group's finding opened
            # joins it by a refresh, never a new finding, and is charged then (added_hosts)
            was = findings.open.get(("network", gv.replica_group, gv.replica_id))
            charged = set(was.evidence.get("charged_hosts") or ()) if was is not None else set()
            ev["charged_hosts"] = sorted(charged | set(hosts))
            ev["step"] = was.evidence.get("step") if was is not None else view.newest_step()
            ranks = sorted(r for h in hosts for r in on[h])
            new.append(findings.confirm("network", gv, ranks, ev, first, now, view))
            if was is not None and (added := set(hosts) - charged):
                kept = self._added.get(was.key)  # not yet handed on: kept with the new ones
                if kept is not None and kept[0] is was:
                    added |= set(kept[1])
                self._added[was.key] = (was, sorted(added))
        return [f for f in new if f]

    def added_hosts(self) -> list[tuple[Finding, list[str]]]:
        """Once each: the open network findings a refresh added hosts to, with those hosts."""
        out = [(f, hosts) for key, (f, hosts) in self._added.items()
               if self.findings.open.get(key) is f]
        self._added = {}
        return out
