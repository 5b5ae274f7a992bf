"""Checks for the generated dashboards: Grafana's model, PromQL syntax, metric names, staleness.

- Schema: every dashboard against Grafana's dashboard model from the npm package
  ``@grafana/schema`` (:mod:`dashboards.schema_check`): the dashboard, each panel's ``options``
  and ``fieldConfig.defaults.custom`` as its kind's, every target and annotation query as a
  Prometheus query.
- PromQL: every target, annotation and variable query parses (``promql_parser``) once
  Grafana's variables are replaced by what Grafana would send (:func:`substitute`).
- Metric names: :func:`metric_names` lists what a query reads; the caller compares it with
  what real WorkerServers and monitors export (``--metrics-url``; the tests scrape them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .build import GENERATED_DIR, build_dashboards, stale_files
from .schema_check import SchemaProject, schema_errors

# What Grafana puts in place of its built-in variables (a plausible dashboard refresh).
BUILTINS = {
    "$__rate_interval_ms": "60000",
    "$__rate_interval": "1m",
    "$__interval_ms": "15000",
    "$__interval": "15s",
    "$__range_s": "1800",
    "$__range_ms": "1800000",
    "$__range": "30m",
}
# $replica_group and $rank are multi-value regex matchers, "All" is ".*"; $job is one job,
# matched exactly (any name parses).
DEFAULT_VARIABLES = {"job": "job", "replica_group": ".*", "rank": ".*"}


# --- walking a dashboard ------------------------------------------------------------------------
@dataclass(frozen=True)
class Query:
    dashboard: str  # uid
    where: str      # "panel 'Title' A", "annotation 'Evictions'", "variable job"
    expr: str       # as stored, with Grafana variables
    kind: str       # "target" | "annotation" | "variable"
    instant: bool = False


def iter_panels(dashboard: dict) -> Iterator[dict]:
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", []) if p.get("type") == "row" else ()


_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$", re.S)
_LABEL_VALUES_1 = re.compile(r"^\s*label_values\(\s*(\w+)\s*\)\s*$")


def variable_selector(query: str) -> str | None:
    """The PromQL selector inside Grafana's ``label_values(selector, label)``."""
    m = _LABEL_VALUES.match(query)
    if m:
        return m.group(1)
    if _LABEL_VALUES_1.match(query):
        return None  # label_values(label): no metric
    return query


def iter_queries(dashboard: dict) -> Iterator[Query]:
    uid = dashboard.get("uid", "?")
    for p in iter_panels(dashboard):
        for t in p.get("targets", []):
            if "expr" in t:
                yield Query(uid, f"panel {p.get('title')!r} {t.get('refId')}", t["expr"], "target",
                            bool(t.get("instant")) and not t.get("range"))
    for a in dashboard.get("annotations", {}).get("list", []):
        expr = (a.get("target") or {}).get("expr")
        if expr:
            yield Query(uid, f"annotation {a.get('name')!r}", expr, "annotation")
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            sel = variable_selector(q or "")
            if sel:
                yield Query(uid, f"variable {v.get('name')}", sel, "variable", True)


def all_queries(dashboards: dict[str, dict] | None = None) -> list[Query]:
    dashboards = dashboards if dashboards is not None else build_dashboards()
    return [q for d in dashboards.values() for q in iter_queries(d)]


def substitute(expr: str, variables: dict[str, str] | None = None,
               builtins: dict[str, str] | None = None) -> str:
    """Replace Grafana's variables (``$x``, ``${x}``, ``[[x]]``) the way Grafana would."""
    values = {**BUILTINS, **(builtins or {})}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    variables = {**DEFAULT_VARIABLES, **(variables or {})}

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in variables:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", repl, expr)


# --- PromQL -------------------------------------------------------------------------------------
class ParserMissing(RuntimeError):
    pass


def _promql_parser():
    try:
        import promql_parser
    except ImportError as e:  # depends on the environment
        raise ParserMissing("the PromQL parser is not installed: pip install "
                            "'lightkeeper[monitor]'") from e
    return promql_parser


def parse_promql(expr: str):
    """The AST of ``expr`` (raises ValueError with the parser's message when it does not parse)."""
    return _promql_parser().parse(expr)


def metric_names(expr: str) -> set[str]:
    """Every metric name a (substituted) PromQL expression selects."""
    promql_parser = _promql_parser()
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                if m.name != "__name__":
                    continue
                alternatives = m.value.split("|")
                if m.op == promql_parser.MatchOp.Re \
                        and all(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", a) for a in alternatives):
                    names.update(alternatives)  # {__name__=~"a|b"}: names a and b
                else:
                    names.add(m.value)
        return True

    promql_parser.walk(parse_promql(expr), visit)
    return names


def exported_names(names: set[str]) -> set[str]:
    """``names`` with each recorded series (dashboards/alerts.py RECORDS) replaced by the
    metrics its rule reads: what must be exported for a query to have data."""
    from .alerts import RECORDS

    rules = {r.record: r.expr for r in RECORDS}
    out: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in rules:
            todo += metric_names(rules.pop(name))
        else:
            out.add(name)
    return out


def names_from_exposition(text: str) -> set[str]:
    """Sample names a /metrics page exposes, including families declared without samples
    yet (a labelled counter before its first increment): counters as ``_total``, histograms
    as ``_bucket``/``_sum``/``_count``, info as ``_info``."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) < 4:
                continue
            name, kind = parts[2], parts[3]
            if kind == "counter":
                names.add(name if name.endswith("_total") else name + "_total")
            elif kind in ("histogram", "gaugehistogram"):
                names.update({name + "_bucket", name + "_sum", name + "_count"})
            elif kind == "summary":
                names.update({name, name + "_sum", name + "_count"})
            elif kind == "info":
                names.add(name if name.endswith("_info") else name + "_info")
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


# --- everything at once (the CLI) ---------------------------------------------------------------
def validate_all(*, schemas: SchemaProject | None, known_metrics: set[str] | None = None,
                 check_stale: bool = True, files: list[Path] | None = None) -> list[str]:
    """Problems found in the dashboards (the committed files, or ``files``); empty = valid.
    ``schemas`` None skips the schema check (the CLI always passes one: a missing install is
    an error there, not a skip)."""
    problems: list[str] = []
    if files is None:
        files = sorted(GENERATED_DIR.glob("*.json"))
    if not files:
        problems.append(f"no dashboards in {GENERATED_DIR}: run `lightkeeper dashboards build`")
    dashboards = {}
    for f in files:
        try:
            dashboards[f.name] = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{f}: cannot read: {e}")
    if check_stale:
        problems += [f"{p}: stale, run `lightkeeper dashboards build`" for p in stale_files()]
    if schemas is not None and dashboards:
        for name, errors in schema_errors(dashboards, schemas).items():
            problems += [f"{name}: {e}" for e in errors]
    uids: dict[str, str] = {}
    for name, d in dashboards.items():
        if d.get("uid") in uids:
            problems.append(f"{name}: uid {d.get('uid')!r} also used by {uids[d['uid']]}")
        uids[d.get("uid")] = name
        for q in iter_queries(d):
            try:
                expr = substitute(q.expr)
                names = exported_names(metric_names(expr))
            except (KeyError, ValueError) as e:
                problems.append(f"{name}: {q.where}: {e}")
                continue
            if known_metrics is not None:
                unknown = sorted(names - known_metrics)
                if unknown:
                    problems.append(f"{name}: {q.where}: metrics not exported: {unknown}")
    return problems
