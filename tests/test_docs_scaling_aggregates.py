"""docs/scaling.md ships the recorded per-group aggregates to a central store (remote write or
federation): the per-rank recorded series (``lightkeeper:rank_*``, one per rank) stay on the
shards, so the documented filters must pass every other recorded series and none of those."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "scaling.md").read_text()


def _block(name: str) -> dict:
    (text,) = re.findall(rf"```yaml\n(# {re.escape(name)}:.*?)```", DOC, re.S)
    return yaml.safe_load(text)


def _recorded() -> set[str]:
    rules = yaml.safe_load((ROOT / "dashboards" / "prometheus" / "rules.yml").read_text())
    return {r["record"] for doc in (rules, _block("shard-rules.yml"))
            for g in doc["groups"] for r in g["rules"] if "record" in r}


def _aggregates(recorded: set[str]) -> set[str]:
    per_rank = {n for n in recorded if n.startswith("lightkeeper:rank_")}
    assert per_rank  # the heals rule's series
    return recorded - per_rank


def test_the_documented_remote_write_ships_the_aggregates_only():
    recorded = _recorded()
    (rw,) = _block("shard-prometheus.yml")["remote_write"]
    kept = set()
    for name in recorded:  # Prometheus's keep/drop relabelling of __name__, in order
        keep = True
        for c in rw["write_relabel_configs"]:
            assert c["source_labels"] == ["__name__"]
            hit = re.fullmatch(c["regex"], name) is not None
            keep = keep and (hit if c["action"] == "keep" else not hit)
        if keep:
            kept.add(name)
    assert kept == _aggregates(recorded)


def test_the_documented_federation_match_ships_the_aggregates_only():
    (match,) = re.findall(r"match\[\]=\{([^}]*)\}", DOC)
    matchers = re.findall(r'__name__(=~|!~)"([^"]*)"', match)
    assert len(matchers) == match.count("__name__")
    recorded = _recorded()
    kept = {n for n in recorded
            if all((re.fullmatch(rx, n) is not None) == (op == "=~") for op, rx in matchers)}
    assert kept == _aggregates(recorded)
