"""The documented contracts and flags against the real thing, both ways.

docs/CONTRACTS.md's tables and metric lists are compared with what a real WorkerServer (Flask,
and torch's own debug server where this torch has one) and a real monitor (against simulated
ranks, tests/support/monitor_sim.py) answer; the flag tables of the docs pages with the
argparse parsers of ``lightkeeper monitor``, ``run``, ``train``, ``demo`` and ``analyze``
(flags hidden with ``argparse.SUPPRESS`` excepted). A field, metric, route or flag added,
renamed or gone, or a documented default that is not argparse's, fails here with its name.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
from pathlib import Path

import pytest
import requests

from monitor.config import QUARANTINE_AFTER

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CODE = re.compile(r"`([^`]+)`")


# --- reading the docs (strict: a heading or table that is not where it is said fails) ---

def section(page: Path, title: str) -> str:
    """The text under the one heading that starts with ``title``, up to the next heading of
    the same or a higher level."""
    lines = page.read_text().splitlines()
    starts = [i for i, line in enumerate(lines)
              if re.match(r"#+ ", line) and line.lstrip("#").strip().startswith(title)]
    assert len(starts) == 1, f"{page.name}: {len(starts)} headings start with {title!r}"
    level = len(lines[starts[0]]) - len(lines[starts[0]].lstrip("#"))
    body = []
    for line in lines[starts[0] + 1:]:
        m = re.match(r"(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        body.append(line)
    return "\n".join(body)


def cells(line: str) -> list[str]:
    """A table row's cells; ``\\|`` is a ``|`` inside a cell."""
    parts = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [p.strip().replace("\\|", "|") for p in parts]


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table in ``text``: (header cells, body rows)."""
    out, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append(cells(line))
            continue
        if rows:
            assert len(rows) >= 2 and set("".join(rows[1])) <= set("-: "), rows[:2]
            out.append((rows[0], rows[2:]))
            rows = []
    return out


def table(text: str, first: str) -> list[list[str]]:
    """The body of the one table whose header's first cell is ``first``."""
    found = [body for head, body in tables(text) if head[0].lower() == first]
    assert len(found) == 1, f"{len(found)} tables headed {first!r}"
    return found[0]


def key_table(rows: list[list[str]]) -> tuple[set[str], set[str]]:
    """(every key, the keys present only when asked) of a ``key | type | meaning`` table."""
    keys, optional = set(), set()
    for row in rows:
        names = CODE.findall(row[0])
        assert names and all(re.fullmatch(r"[\w.]+", n) for n in names), row[0]
        keys |= set(names)
        if re.search(r"present only when|absent when", row[-1]):
            optional |= set(names)
    return keys, optional


def key_types(rows: list[list[str]]) -> dict[str, str]:
    """Key -> its documented type of a ``key | type | meaning`` table (``a``, ``b`` | ``str,
    int``: one type each)."""
    out = {}
    for row in rows:
        names = CODE.findall(row[0])
        types = [t.strip() for t in row[1].split(", ")] if len(names) > 1 else [row[1]]
        types = types * len(names) if len(types) == 1 else types
        assert len(types) == len(names), row
        out.update(zip(names, types, strict=True))
    return out


JSON_TYPES = {"str": str, "string": str, "int": int, "float": (int, float), "bool": bool,
              "object": dict, "dict": dict, "list": list}


def has_type(value: object, spec: str) -> bool:
    """Whether a JSON value is of a documented type: ``int``, ``float or null``,
    ``list[float]``, ``dict[str, float]``, ``object``, ..."""
    if value is None:
        return spec.endswith(" or null")
    m = re.fullmatch(r"(\w+)(?:\[(.*)\])?(?: or null)?", spec)
    assert m and m.group(1) in JSON_TYPES, f"no such type {spec!r}"
    kind, inner = m.groups()
    if isinstance(value, bool) and kind != "bool" or not isinstance(value, JSON_TYPES[kind]):
        return False
    if kind == "list" and inner:
        return all(has_type(v, inner) for v in value)
    if kind == "dict" and inner:
        key, val = (t.strip() for t in inner.split(","))
        return all(has_type(k, key) and has_type(v, val) for k, v in value.items())
    return True


def documented_metrics(text: str, prefix: str) -> dict[str, set[str]]:
    """Metric name -> the label names documented with it (``name{a,b="x"}``: a, b)."""
    out: dict[str, set[str]] = {}
    for span in CODE.findall(text):
        if m := re.fullmatch(prefix + r"(\w+)(?:\{(.*)\})?", span):
            labels = {part.split("=")[0].strip() for part in (m.group(2) or "").split(",")}
            out.setdefault(prefix + m.group(1), set()).update(labels - {""})
    return out


def served_metrics(text: str) -> dict[str, set[str] | None]:
    """Metric family name -> its samples' label names (None: no sample) of a Prometheus text
    answer, less the ``_created`` companions prometheus_client adds to counters and
    histograms, and less histograms' ``le``."""
    from prometheus_client.parser import text_string_to_metric_families

    types = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    bases = {n.removesuffix("_total") for n in types}
    out: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(text):
        name = next(n for n in (family.name + "_total", family.name) if n in types)
        if name.endswith("_created") and name.removesuffix("_created") in bases - {name}:
            continue
        labels = [set(s.labels) - {"le"} for s in family.samples]
        out[name] = set().union(*labels) if labels else None
    return out


def same_metrics(served: dict[str, set[str] | None], documented: dict[str, set[str]],
                 base: set[str]) -> None:
    assert sorted(set(served) - set(documented)) == [], "served, not documented"
    assert sorted(set(documented) - set(served)) == [], "documented, not served"
    wrong = {name: sorted(labels) for name, labels in served.items()
             if labels is not None and labels != base | documented[name]}
    assert wrong == {}, f"labels other than {sorted(base)} and the documented ones"


# --- a real WorkerServer, on its own server and on torch's ---

CONTRACTS = DOCS / "CONTRACTS.md"


@pytest.fixture(scope="module", params=["flask", "torch"])
def rank(request):
    """(GET path -> answer) of one rank's WorkerServer, a few steps into its training."""
    from worker_server import RankIdentity, RankState, WorkerServer

    if request.param == "torch":
        from worker_server.torch_server import unavailable
        if unavailable() is not None:
            pytest.skip(str(unavailable()))
    state = RankState(RankIdentity(job="contracts", replica_group=1, group_rank=0,
                                   group_world_size=1, lighthouse="http://127.0.0.1:1"))
    for step in range(1, 4):  # as the instrumented Manager drives them (instrument.py)
        state.step_started()
        state.timing.begin_step()
        state.set_quorum(3, 2, True)
        with state.timing.waiting("cross"):
            pass
        state.timing.end_step(step)
        state.step_finished(step, committed=True, loss=1.5)
    srv = WorkerServer(state, server=request.param).serve()
    try:
        if request.param == "flask":
            def get(path: str) -> requests.Response:
                return requests.get(srv.url + path, timeout=10)
        else:  # the same bytes as POST /handler/lightkeeper_<name> (docs/worker_server.md)
            from monitor.poll.torch_target import base_url

            def get(path: str) -> requests.Response:
                route, _, query = path.partition("?")
                name = {"/v1/state": "state", "/v1/fr_trace": "fr_trace",
                        "/metrics": "metrics"}[route]
                return requests.post(f"{base_url(srv.url)}/handler/lightkeeper_{name}"
                                     + (f"?{query}" if query else ""), timeout=10)
            get.handlers = requests.get(f"{base_url(srv.url)}/handler/", timeout=10).json()
        yield get
    finally:
        srv.stop()


def test_state_keys_are_the_documented_ones(rank):
    text = section(CONTRACTS, "WorkerServer `GET /v1/state`")
    keyed = [body for head, body in tables(text) if head[0] == "key"]
    assert len(keyed) == 2, "two key tables: /v1/state's, then timing's"
    documented, optional = key_table(keyed[0])
    timing_keys, timing_optional = key_table(keyed[1])
    timing_keys = {k for k in timing_keys if "." not in k}  # dotted: fields of its objects

    plain = rank("/v1/state")
    asked = rank("/v1/state?since=1&recent=2&packed=1")
    assert plain.status_code == asked.status_code == 200
    plain, asked = plain.json(), asked.json()
    assert sorted((set(plain) | set(asked)) - documented) == [], "served, not documented"
    assert sorted(documented - optional - set(plain)) == [], "documented, not served"
    assert sorted(documented - set(plain) - set(asked)) == [], "documented, never served"
    timing = set(plain["timing"]), set(asked["timing"])
    assert sorted((timing[0] | timing[1]) - timing_keys) == []
    assert sorted(timing_keys - timing_optional - timing[0]) == []
    assert sorted(timing_keys - timing[0] - timing[1]) == []


def test_state_values_have_the_documented_types(rank):
    keyed = [body for head, body in tables(section(CONTRACTS, "WorkerServer `GET /v1/state`"))
             if head[0] == "key"]
    state = rank("/v1/state?since=1").json()
    wrong = []
    for doc, rows in ((state, keyed[0]), (state["timing"], keyed[1])):
        for key, spec in key_types(rows).items():
            head, _, field = key.partition(".")
            if head not in doc:  # a key present only when asked (test above)
                continue
            value = doc[head] if not field else (doc[head] or {}).get(field)
            if field and doc[head] is None:  # a field of an object that is null
                continue
            if not has_type(value, spec):
                wrong.append(f"{key}: {value!r} is not {spec}")
    assert wrong == []


def test_state_phases_are_the_documented_ones():
    from worker_server import PHASES

    keyed = [body for head, body in tables(section(CONTRACTS, "WorkerServer `GET /v1/state`"))
             if head[0] == "key"]
    rows = [r for r in keyed[0] if r[0] == "`phase`"]
    assert len(rows) == 1
    assert CODE.findall(rows[0][2]) == list(PHASES)


def test_fr_trace_keys_are_torchs_and_the_documented_ones(rank):
    from worker_server.flight_recorder import raw_dump_json

    text = section(CONTRACTS, "WorkerServer `GET /v1/fr_trace`")
    m = re.search(r"plus self-describing keys:(.*?)\(", text, re.S)
    assert m, "the paragraph naming the self-describing keys"
    documented = set(CODE.findall(m.group(1)))
    r = rank("/v1/fr_trace")
    assert r.status_code == 200, r.text
    added = set(r.json()) - set(json.loads(raw_dump_json()))
    assert added == documented


def test_torch_handlers_are_the_documented_ones(rank):
    if not hasattr(rank, "handlers"):
        pytest.skip("torch's server only")
    intro = section(CONTRACTS, "WorkerServer `GET /v1/state`").strip().split("\n\n")[0]
    documented = {h for span in CODE.findall(intro) for h in re.findall(r"\blightkeeper_\w+", span)}
    assert {h for h in rank.handlers if h.startswith("lightkeeper_")} == documented


def test_rank_metrics_are_the_documented_ones(rank):
    text = section(CONTRACTS, "WorkerServer `/metrics`")
    same_metrics(served_metrics(rank("/metrics").text), documented_metrics(text, "lightkeeper_"),
                 {"job", "replica_group", "rank", "group_rank"})


# --- a real monitor ---

@pytest.fixture(scope="module")
def monitor(tmp_path_factory):
    from lightkeeper.processes import wait_until
    from monitor.config import MonitorConfig
    from monitor.service import Monitor
    from tests.support.monitor_sim import SimRanks

    d = tmp_path_factory.mktemp("monitor")
    sim = SimRanks.start(2)
    try:
        mon = Monitor(MonitorConfig(port=0, interval_s=0.2, state_path=str(d / "state.sqlite"),
                                    targets=sim.urls, sd_out=str(d / "targets.json"),
                                    job="contracts")).start()
        try:
            wait_until(lambda: mon.sweeps >= 2, 10, what="two sweeps")
            yield mon
        finally:
            mon.stop()
    finally:
        sim.stop()


def test_monitor_metrics_are_the_documented_ones(monitor):
    text = section(CONTRACTS, "Monitor `/metrics`")
    bad = requests.post(monitor.url + "/v1/targets", json={}, timeout=10)  # a counted outcome
    assert bad.status_code == 400
    served = served_metrics(requests.get(monitor.url + "/metrics", timeout=10).text)
    same_metrics(served, documented_metrics(text, "lightkeeper_monitor_"), {"job"})


def test_a_refused_registration_is_counted_with_a_documented_outcome(monitor):
    """A rank of another job (409) is refused like any other: counted by outcome."""
    text = section(CONTRACTS, "Monitor `/metrics`")
    m = re.search(r"registrations_total\{outcome\}` \(outcome: ([^)]*)\)", text)
    assert m, "the registration outcomes"
    documented = set(CODE.findall(m.group(1)))
    other = requests.post(monitor.url + "/v1/targets", timeout=10, json={
        "url": "http://127.0.0.1:9", "job": "another", "replica_group": 0, "rank": 0})
    assert other.status_code == 409, other.text
    assert requests.post(monitor.url + "/v1/targets", json=[], timeout=10).status_code == 400
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(monitor.url + "/metrics", timeout=10).text
    counted = {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "lightkeeper_monitor_registrations_total"}
    assert counted.keys() <= documented
    assert counted.get("other_job", 0) >= 1 and counted.get("bad_request", 0) >= 1, counted


def route(spec: str) -> tuple[str, str]:
    """``GET /v1/goodput[?incidents=N]`` -> ("GET", "/v1/goodput"); parameters as ``<>``."""
    method, path = spec.split(" ", 1)
    path = re.sub(r"\[?\?.*", "", path)
    return method, re.sub(r"<[^>]*>|\{[^}]*\}", "<>", path)


def routes(app) -> set[tuple[str, str]]:
    return {route(f"{m} {rule.rule}") for rule in app.url_map.iter_rules()
            if rule.endpoint != "static" for m in rule.methods - {"HEAD", "OPTIONS"}}


def documented_routes(rows: list[list[str]]) -> set[tuple[str, str]]:
    found = [route(s) for row in rows for s in CODE.findall(row[0])
             if re.match(r"(GET|POST|PUT|PATCH|DELETE) /", s)]
    assert len(found) == len(set(found)), "a route documented twice"
    return set(found)


def test_monitor_routes_are_the_documented_ones(monitor):
    from monitor.api.app import create_app

    served = routes(create_app(monitor))
    assert served == documented_routes(table(section(CONTRACTS, "Monitor HTTP API"), "route"))
    assert served == documented_routes(table(section(DOCS / "monitor.md", "API"), "endpoint"))


def test_rank_routes_are_the_documented_ones():
    from worker_server import RankIdentity, RankState, create_app

    state = RankState(RankIdentity(job="contracts", replica_group=0, group_rank=0,
                                   group_world_size=1, lighthouse=None))
    served = routes(create_app(state))
    intro = (DOCS / "worker_server.md").read_text().split("\n## ")[0]  # before its sections
    assert served == documented_routes(table(intro, "endpoint"))


# --- the command lines' flags ---

# command -> (its module, the pages whose flag tables document it)
COMMANDS = {
    "monitor": ("monitor.cli", ["monitor.md", "quarantine.md", "scaling.md"]),
    "run": ("lightkeeper.run", ["run.md"]),
    "train": ("trainer.cli", ["trainer.md"]),
    "demo": ("lightkeeper.demo", ["demo.md"]),
    "analyze": ("monitor.analysis.cli", ["analyze.md"]),
}
# argparse's defaults that come from the environment (docs: `$VAR`), unset for the parsers
ENV = ("TORCHFT_LIGHTHOUSE", "LIGHTKEEPER_JOB", "LIGHTKEEPER_WORKER_HOST", "LIGHTKEEPER_ETCD")
# flags whose value is merged over the product's own after parsing: that is the default
MERGED = {"--quarantine-after": QUARANTINE_AFTER}


def parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"lightkeeper {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(p)
    return p


def flag_rows(page: Path) -> list[tuple[list[str], str | None]]:
    """(flags, the default cell or None) of each row of the page's flag tables (header
    ``flag`` or ``option``), or of its ``**Options.**`` paragraph."""
    text = page.read_text()
    out = []
    for head, body in tables(text):
        if head[0].lower() not in ("flag", "option"):
            continue
        col = head.index("default") if "default" in head else None
        for row in body:
            flags = [re.match(r"--[\w-]+", s).group(0) for s in CODE.findall(row[0])
                     if s.startswith("--")]
            if flags:
                out.append((flags, row[col] if col is not None else None))
    m = re.search(r"^\*\*Options\.\*\*(.*?)\n\n", text, re.S | re.M)
    if m:
        out += [([f], None) for f in re.findall(r"`(--[\w-]+)", m.group(1))]
    return out


def stated_default(cell: str) -> str | None:
    """The literal a default cell states (a number, a word, a path, a list), without its
    trailing remark in parentheses; None for prose or an environment variable."""
    value = re.sub(r"\s*\([^)]*\)$", "", cell).strip()
    value = value[1:-1] if re.fullmatch(r"`[^`]*`", value) else value
    if value.startswith("$") or not re.fullmatch(r"[\w./,:=\-]+", value):
        return None
    return value


def same(stated: str, default: object) -> bool:
    if isinstance(default, bool) or default is None:
        return stated in ("off", "none") and not default
    if isinstance(default, (int, float)):
        return re.fullmatch(r"[\d.]+", stated) is not None and float(stated) == default
    if isinstance(default, dict):
        return stated == ",".join(f"{k}={v}" for k, v in default.items())
    if isinstance(default, (tuple, list)):
        return stated == ",".join(map(str, default)) or (stated == "none" and not default)
    if isinstance(default, str) and stated.startswith("./"):
        return os.path.abspath(stated) == os.path.abspath(default)
    return stated == str(default)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_documented_and_every_documented_flag_exists(command, monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    actions = {s: a for a in parser(command)._actions if a.help != argparse.SUPPRESS
               for s in a.option_strings if s.startswith("--") and s != "--help"}
    rows = [row for page in COMMANDS[command][1] for row in flag_rows(DOCS / page)]
    documented = {f for flags, _ in rows for f in flags}
    assert sorted(set(actions) - documented) == [], "flags no docs page names"
    assert sorted(documented - set(actions)) == [], "documented flags the command lacks"

    wrong = []
    for flags, cell in rows:
        if cell is None:
            continue
        values = [v.strip() for v in cell.split(", ")] if len(flags) > 1 else [cell]
        if len(values) == 1:
            values *= len(flags)
        assert len(values) == len(flags), (flags, cell)
        for flag, value in zip(flags, values, strict=True):
            action, stated = actions[flag], stated_default(value)
            default = MERGED.get(flag, action.default)
            if stated is None or action.nargs == 0 and stated == "off":
                continue
            # flags whose None is settled after parsing (e.g. from the environment)
            if default is None and stated not in ("none", "off"):
                continue
            if not same(stated, default):
                wrong.append(f"{flag}: docs {value!r}, argparse {default!r}")
    assert wrong == []


def test_every_variable_a_rank_reads_is_documented():
    """The ``LIGHTKEEPER_*`` variables named in worker_server/ against docs/worker_server.md's
    Environment table and docs/run.md's (the hook's own, set by ``lightkeeper run``)."""
    named = {v for path in (ROOT / "worker_server").rglob("*.py")
             for v in re.findall(r"[\"'](LIGHTKEEPER_[A-Z_]+)[\"']", path.read_text())}
    rows = (table(section(DOCS / "worker_server.md", "Environment"), "variable")
            + table((DOCS / "run.md").read_text(), "option"))
    documented = {v for row in rows for cell in row for span in CODE.findall(cell)
                  for v in re.findall(r"LIGHTKEEPER_[A-Z_]+", span)}
    assert sorted(named - documented) == [], "read by a rank, in no Environment table"
