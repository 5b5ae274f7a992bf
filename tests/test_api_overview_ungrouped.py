"""The overview lists the targets in no replica group (one that never answered: a mistyped
address) with why, next to the groups; "no ranks known yet" only when no target is known."""

from __future__ import annotations

from monitor.api import app as app_module
from monitor.api.app import create_app
from monitor.config import MonitorConfig
from monitor.service import Monitor


def _overview(tmp_path, targets: list[str]) -> str:
    mon = Monitor(MonitorConfig(port=0, targets=targets, state_path=str(tmp_path / "m.db")))
    try:
        mon.sweep_once()
        return create_app(mon).test_client().get("/").get_data(as_text=True)
    finally:
        mon.stop()


def test_a_target_that_never_answered_is_listed_with_why(tmp_path):
    page = _overview(tmp_path, ["http://127.0.0.1:1"])  # nothing listens on port 1: refused
    assert "no ranks known yet" not in page
    table = page[page.index('<table id="ungrouped">'):page.index("<h2>Findings")]
    assert "http://127.0.0.1:1" in table
    assert '<td class="unreachable">connection</td>' in table
    assert "Connection" in table  # the error as /v1/cluster's ungrouped say it
    assert "1 targets known, none has said its group" in page


def test_the_overview_lists_a_bounded_number_of_ungrouped_targets(tmp_path, monkeypatch):
    monkeypatch.setattr(app_module, "OVERVIEW_UNGROUPED", 1)
    page = _overview(tmp_path, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    table = page[page.index('<table id="ungrouped">'):page.index("<h2>Findings")]
    assert table.count('class="ungrouped"') == 1
    assert "1 more" in table and 'href="/v1/cluster"' in table


def test_no_target_at_all_says_how_to_give_some(tmp_path):
    page = _overview(tmp_path, [])
    assert "no ranks known yet: pass --targets" in page
    assert '<table id="ungrouped">' not in page
