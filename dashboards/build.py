"""The Lightkeeper Grafana dashboards, as code.

``build_dashboards()`` returns the three dashboards as dicts (:mod:`dashboards.job_overview`,
:mod:`dashboards.rank_drilldown`, :mod:`dashboards.monitor_health`, from the queries of
:mod:`dashboards.promql`); ``write_all()`` writes them (and the generated Prometheus files, see
:mod:`dashboards.rules` and :mod:`dashboards.promconfig`) to ``dashboards/generated/`` and
``dashboards/prometheus/``. The committed files are this module's output: ``lightkeeper
dashboards build --check`` (and a test) fails when they are stale.

Every query uses only metrics the WorkerServer (``lightkeeper_*``) or the monitor
(``lightkeeper_monitor_*``) export (docs/CONTRACTS.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import UID_DRILLDOWN, UID_MONITOR, UID_OVERVIEW
from .job_overview import BADPUT_COLORS, job_overview
from .monitor_health import monitor_health
from .promql import PHASES
from .rank_drilldown import rank_drilldown

# the names callers and tests have always read from here
__all__ = ["BADPUT_COLORS", "GENERATED_DIR", "PACKAGE_DIR", "PHASES", "PROMETHEUS_DIR",
           "UID_DRILLDOWN", "UID_MONITOR", "UID_OVERVIEW", "build_dashboards", "expected_files",
           "render_json", "stale_files", "write_all"]

PACKAGE_DIR = Path(__file__).resolve().parent
GENERATED_DIR = PACKAGE_DIR / "generated"
PROMETHEUS_DIR = PACKAGE_DIR / "prometheus"


def build_dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON, for every dashboard Lightkeeper ships."""
    return {
        "job-overview.json": job_overview(),
        "rank-drilldown.json": rank_drilldown(),
        "monitor-health.json": monitor_health(),
    }


def render_json(obj: dict) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def expected_files() -> dict[Path, str]:
    """Every generated file (absolute path) and the text it must contain."""
    from .promconfig import render_prometheus_yml
    from .rules import render_rules, render_rules_test

    files = {GENERATED_DIR / name: render_json(d) for name, d in build_dashboards().items()}
    files[PROMETHEUS_DIR / "prometheus.yml"] = render_prometheus_yml()
    files[PROMETHEUS_DIR / "rules.yml"] = render_rules()
    files[PROMETHEUS_DIR / "rules_test.yml"] = render_rules_test()
    return files


def stale_files() -> list[Path]:
    """Generated files whose committed content differs from what the code builds now."""
    out = []
    for path, text in expected_files().items():
        try:
            current = path.read_bytes()  # a hand edit may be no UTF-8: stale all the same
        except OSError:  # missing, or no file
            current = None
        if current != text.encode("utf-8"):
            out.append(path)
    return out


def write_all() -> list[Path]:
    """(Re)write every generated file; returns those that changed."""
    changed = []
    for path, text in expected_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != text.encode("utf-8"):
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed
