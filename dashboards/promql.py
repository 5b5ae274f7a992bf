"""The PromQL the dashboards share: the variable selectors and the query shapes.

Every selector filters by Grafana's ``$job`` (one job, matched exactly: a single-value variable
is interpolated as it is, never regex-escaped, so ``=~`` would read a job name ``a.b`` as a
regex that also matches ``axb``), and on the drill-down by ``$replica_group`` and ``$rank``
(multi-value, "All" = ``.*``, which Grafana regex-escapes and joins) as regex matchers.
"""

from __future__ import annotations

# The WorkerServer's phases (worker_server.state.PHASES), in order; the phase timeline encodes
# the current phase as its 1-based position here. A test keeps the two lists in step.
PHASES = ("starting", "quorum", "forward", "backward", "allreduce", "commit", "optimizer",
          "healing", "stopped", "checkpoint", "busy")
PHASE_COLORS = {"starting": "blue", "quorum": "purple", "forward": "green", "backward": "green",
                "allreduce": "orange", "commit": "yellow", "optimizer": "green",
                "healing": "red", "stopped": "text", "checkpoint": "blue", "busy": "blue"}

J = 'job="$job"'
G = f'{J}, replica_group=~"$replica_group"'
R = f'{G}, rank=~"$rank"'
RI = "$__rate_interval"
STEP = "$__interval"


def new_series(m: str, window: str, seconds: str) -> str:
    """The series of monitor counter selector ``m`` that are new within ``window`` (``seconds``
    long; one Grafana step), each with how much it counts: they appear already at 1, so a
    difference cannot see their first increment.

    A series also looks new after a gap (a failed scrape's staleness marker, a network blip, a
    Prometheus restart): only one whose monitor was scraped ``window`` ago, or is itself new
    within it and started at most 5 minutes before (its first scrape can come well after its
    start, and its clock may be off; one replaced since included), is new, so a gap shows no
    fake events (an increment across the gap is not counted). One reset within the window
    counts its first value and its ``increase``, which adds the value before the reset."""
    start = f"lightkeeper_monitor_start_time_seconds{{{J}}}"
    # not increase() without a reset: extrapolated over a young series' few samples, 3 reads 4
    return (f"(((max_over_time({m}[{window}]) unless resets({m}[{window}]) > 0 "
            f"or min_over_time({m}[{window}]) + increase({m}[{window}])) "
            f"unless {m} offset {window}) and on (job, instance) "
            f"(lightkeeper_monitor_dry_run{{{J}}} offset {window} "
            f"or (max_over_time({start}[{window}]) unless {start} offset {window}) "
            f"> time() - {seconds} - 300))")


# The shipped scrape interval: a count over a range adds up each such step's growth. Also the
# recording rules' interval (dashboards/rules.py), which RANK_HEALS's offset must equal.
SCRAPE = "15s"
SCRAPE_S = 15


def live(selector: str) -> str:
    """``selector``'s series scraped within two scrape intervals: one failed scrape (its
    staleness marker) keeps a series in; a rank gone (stale) is out once its last sample is
    that old."""
    return f"last_over_time({selector}[{2 * SCRAPE_S}s])"


# each group's slowest rank's compute a step (as the straggler alert's recording rule), live
# series only: a restarted rank's old series' last steps stay in the rate's window
GROUP_COMPUTE = (f"max by (job, replica_group) "
                 f"(rate(lightkeeper_step_compute_seconds_sum{{{J}}}[{RI}]) "
                 f"/ rate(lightkeeper_step_compute_seconds_count{{{J}}}[{RI}]) "
                 f"and {live(f'lightkeeper_step_compute_seconds_count{{{J}}}')})")

# Each rank's heals in the evaluation interval before the previous evaluation, recorded every
# SCRAPE. A rank heals within a second of its start, before its first scrape (file_sd), so its
# series is first seen at 1, which increase() and rate() never count. A rank's growth is from its
# last sample of the same start within 5 minutes (across a gap once); without one (a new series,
# or a restart: the start moved) its whole value counts if it started within 5 minutes (a first
# scrape can come well after the start), so a series back from a longer gap counts nothing. It
# reads one interval late: a sample is stamped at its scrape's start but stored at its end
# (scrape_timeout <= 10 s < SCRAPE), so a scrape in flight at the tick is there by the next.
# A rank without the start gauge (an older WorkerServer) counts its growth only.
RANK_HEALS = "lightkeeper:rank_heals:growth15s"
_HEALS, _START, _BACK = "lightkeeper_heals_total", "lightkeeper_worker_start_time_seconds", 300
_H, _S, _LATE = f"{_HEALS} offset {SCRAPE}", f"{_START} offset {SCRAPE}", f"offset {2 * SCRAPE_S}s"
RANK_HEALS_EXPR = (f"{_H}\n"
                   f"  - (last_over_time({_HEALS}[{_BACK}s] {_LATE})\n"
                   f"     and last_over_time({_START}[{_BACK}s] {_LATE})\n"
                   f"       == {_S})\n"
                   f"or {_H} and {_S} > time() - {_BACK + SCRAPE_S}\n"
                   f"or ({_H} - last_over_time({_HEALS}[{_BACK}s] {_LATE}) >= 0 unless {_S})")


def scrape_growth(m: str, seen: list[str], start: str) -> str:
    """How much each series of monitor counter selector ``m`` grew in the ``SCRAPE`` before
    the evaluation, exactly (differences of samples: no extrapolation).

    A series present a step before counts its difference, or after a reset (its monitor
    restarted) its new value, as ``increase`` does. A series absent a step before is new (it
    appears already at 1) and counts its value, but only if its monitor (same ``job`` and
    ``instance``) was scraped a step before (any of ``seen``) or started at most 5 minutes
    before its ``start`` first showed (its first scrape can come well after its start, its
    clock may be off): a series back from a gap (a failed scrape, a Prometheus restart)
    counts nothing, nor does an increment during the gap."""
    s = SCRAPE
    known = " or ".join(f"{k} offset {s}" for k in seen)
    return (f"(max_over_time({m}[{s}]) unless {m} offset {s}) and on (job, instance) "
            f"({known} or max_over_time({start}[{s}]) > time() - {SCRAPE_S + 300}) "
            # the value a step before, 0 after a reset (0 *: nameless, as ``-`` makes the rest)
            f"or {m} - ({m} offset {s} <= {m} or 0 * {m} offset {s})")


def range_growth(m: str, seen: list[str], start: str, window: str) -> str:
    """How much each series of monitor counter selector ``m`` grew within ``window``: the sum
    of its growth in each scrape interval (:func:`scrape_growth`). Not ``increase``, which
    extrapolates to the window's edges (a young series' 3 reads 4) and loses a reset series'
    first life when its first value is not its least."""
    return f"sum_over_time(({scrape_growth(m, seen, start)})[{window}:{SCRAPE}])"


def not_standby(expr: str) -> str:
    """``expr`` less the series of standby shard monitors: a second monitor on the same
    ``--shard I/N`` exports its own copy of that slice's counts, which a sum would add twice."""
    return (f"(({expr}) unless on (job, instance) "
            f"(lightkeeper_monitor_shard_standby{{{J}}} == 1))")


def active_sum(expr: str, by: str = "") -> str:
    """The sum of monitor series ``expr`` over the job's monitors, less standby shards'."""
    return (f"sum by ({by}) " if by else "sum") + not_standby(expr)


def events(metric: str, sel: str, by: str) -> str:
    """How many times monitor counter ``metric`` grew within the dashboard's time range, by
    ``by``; a series new within it counts with its whole value (:func:`range_growth`)."""
    grew = range_growth(f"{metric}{{{sel}}}", [f"lightkeeper_monitor_dry_run{{{J}}}"],
                        f"lightkeeper_monitor_start_time_seconds{{{J}}}", "$__range")
    return f"sum by ({by}) ({grew})"


def step_growth(m: str) -> str:
    """How much each series of counter selector ``m`` grew since the previous step.

    Grafana steps ``$__interval`` apart: each step compares two instant values one step apart,
    so every increment counts at exactly one step (``increase`` over a longer window would count
    it at several, and over one step sees a single sample). A counter reset counts 0."""
    return f"clamp_min({m} - {m} offset {STEP}, 0)"


def step_events(metric: str, sel: str, by: str, standby: bool = True) -> str:
    """How much monitor counter ``metric`` grew since the previous step, by ``by``; a series
    new since then counts with its whole value (:func:`new_series`). ``standby=False``: not
    the counts of standby shard monitors (:func:`not_standby`)."""
    m = f"{metric}{{{sel}}}"
    grew = f"{new_series(m, STEP, '$__interval_ms / 1000')} or {step_growth(m)}"
    return f"sum by ({by}) ({grew if standby else not_standby(grew)})"


def finding_events(sel: str, by: str) -> str:
    """Findings confirmed since the previous step, by ``by``, standby shards' copies left out:
    a group's summed over the job's monitors (one shard owns the group), a job-wide one
    (``replica_group="job"``: job_stall, job_slow, which every shard finds over its slice) the
    most any one monitor counted, so one stall the N shards each see counts once."""
    m = "lightkeeper_monitor_findings_total"
    keep = ", ".join(dict.fromkeys([*(x.strip() for x in by.split(",")), "replica_group"]))
    groups = step_events(m, f'{sel}, replica_group!="job"', keep, standby=False)
    job = step_events(m, f'{sel}, replica_group="job"', f"{keep}, instance", standby=False)
    return f"sum by ({by}) ({groups} or max by ({keep}) ({job}))"


def group_heals(sel: str) -> str:
    """Each replica group's heals since the previous step (its ranks heal alike: the most of
    any rank), from the recorded growth (RANK_HEALS), each record counted at one step."""
    return f"max by (replica_group) (sum_over_time({RANK_HEALS}{{{sel}}}[{STEP}]))"


def group_steps(metric: str) -> str:
    """A worker counter's growth since the previous step per replica group (its ranks count
    the same events: the most of any rank)."""
    return f"max by (replica_group) ({step_growth(f'{metric}{{{J}}}')})"


# one marker at the first step that sees a new quorum id (changes() over one step sees one sample)
QUORUM_CHANGED = (f"max by (job) (lightkeeper_quorum_id{{{J}}} "
                  f"!= lightkeeper_quorum_id{{{J}}} offset {STEP})")


def step_quantile(q: float, by: str, sel: str) -> str:
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate(lightkeeper_step_duration_seconds_bucket{{{sel}}}[{RI}])))")


def step_mean(by: str, sel: str) -> str:
    return (f"sum by ({by}) (rate(lightkeeper_step_duration_seconds_sum{{{sel}}}[{RI}])) / "
            f"sum by ({by}) (rate(lightkeeper_step_duration_seconds_count{{{sel}}}[{RI}]))")


def phase_code_expr(sel: str) -> str:
    """One series per rank whose value is the 1-based index of its current phase in PHASES."""
    terms = " or ".join(f'lightkeeper_phase{{{sel}, phase="{p}"}} * {i}'
                        for i, p in enumerate(PHASES, start=1))
    return f"sum by (job, replica_group, rank) ({terms})"

