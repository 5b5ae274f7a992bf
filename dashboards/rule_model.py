"""The shapes of Lightkeeper's Prometheus rules (records, alerts, their promtool cases) and the
series helpers the alerts' cases are written with (dashboards/alert_cases.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .promql import range_growth

# Runbooks are sections of docs/dashboards.md, one per alert, headed by the alert's name.
RUNBOOK_BASE = "https://github.com/lightkeeper/lightkeeper/blob/main/docs/dashboards.md"


@dataclass(frozen=True)
class Record:
    record: str
    expr: str


@dataclass(frozen=True)
class Case:
    """One promtool test: input series, when to evaluate, the alerts expected (none = silent)."""
    name: str
    series: list[tuple[str, str]]
    eval_time: str
    fires: list[dict[str, str]] = field(default_factory=list)
    interval: str = "15s"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    runbook: str
    cases: list[Case]

    def annotations(self) -> dict[str, str]:
        return {"summary": self.summary, "description": self.description,
                "runbook": self.runbook,
                "runbook_url": f"{RUNBOOK_BASE}#{self.name.lower()}"}


def grown(selector: str, window: str) -> str:
    """How much a monitor counter grew within ``window`` (``15m``, ``1h``), per series, exactly
    (:func:`dashboards.promql.range_growth`): a series new within the window (it appears
    already at 1) counts with its whole value if its monitor was scraped a step before or had
    just started (after a Prometheus restart every series looks new); a reset (a monitor
    restart) counts the new value, as ``increase`` does."""
    return range_growth(selector, ["lightkeeper_monitor_sweeps_total",
                                   "lightkeeper_monitor_start_time_seconds"],
                        "lightkeeper_monitor_start_time_seconds", window)


W = 'job="train", lightkeeper_component="worker"'
M = 'job="train", lightkeeper_component="monitor", instance="mon:19400"'
M2 = 'job="train", lightkeeper_component="monitor", instance="mon2:19400"'


def _worker(rg: int, extra: str = "") -> str:
    return (f'{W}, instance="w{rg}:9000", replica_group="{rg}", rank="{rg}", group_rank="0"'
            + (f", {extra}" if extra else ""))


# a monitor up beside its ranks whose sweeps all fail: what it exports from its start, no sweep
NEVER_SWEPT = [(f"up{{{M}}}", "1x40"), (f"lightkeeper_monitor_dry_run{{{M}}}", "0x40"),
               (f"lightkeeper_step{{{_worker(0)}}}", "1x40")]


# Groups 0 and 2 compute 0.1 s a step; group 1 0.3 s from 45 s on, is evicted after 2m45s (its
# rank's series marked stale at 3m) and restarted as another instance, at pace from 3m15s: at
# 3m30s only the old series' last slow steps, still in a [1m] window, say it is slow.
_C = "lightkeeper_step_compute_seconds"
_W1B = f'{W}, instance="w1b:9000", replica_group="1", rank="1", group_rank="0"'
RESTARTED = (
    [(f"{_C}_{m}{{{_worker(g)}}}", v) for g in (0, 2)
     for m, v in (("count", "0+10x30"), ("sum", "0+1x30"))]
    + [(f"{_C}_count{{{_worker(1)}}}", "0+10x11 stale"),
       (f"{_C}_sum{{{_worker(1)}}}", "0+1x3 6+3x7 stale"),
       (f"{_C}_count{{{_W1B}}}", "_x13 0+10x16"), (f"{_C}_sum{{{_W1B}}}", "_x13 0+1x16")])


def blip(slow: int, missed: int) -> list[tuple[str, str]]:
    """Groups 0-2, a rank each, 10 steps a scrape; group ``slow`` computes 0.2 s a step (2x the
    median; 1.5x the two others'), the others 0.1 s; group ``missed``'s rank misses its scrape
    at 3m (a staleness marker)."""
    out = []
    for g in range(3):
        for m, v in (("count", 10), ("sum", 2 if g == slow else 1)):
            values = f"0+{v}x11 stale {13 * v}+{v}x8" if g == missed else f"0+{v}x21"
            out.append((f"{_C}_{m}{{{_worker(g)}}}", values))
    return out
