"""What the API's POST routes make of bodies a caller gets wrong: a clear 400, no traceback in
the log; a refused registration's log line without the URL's password (docs/monitor.md, API)."""

from __future__ import annotations

import logging

import pytest

from monitor.api.app import create_app
from monitor.config import MonitorConfig
from monitor.service import Monitor

ADMIN, REGISTER = "adm", "reg"
DEEP = b"[" * 5000 + b"]" * 5000  # past the JSON parser's recursion limit, under MAX_BODY


@pytest.fixture
def mon(tmp_path):
    m = Monitor(MonitorConfig(port=0, targets=[], job="sim", state_path=str(tmp_path / "m.db"),
                              token=ADMIN, register_token=REGISTER))
    yield m
    m.stop()


def _bad_requests(client) -> float:
    """``registrations{outcome="bad_request"}`` as /metrics says it (0: not yet)."""
    for line in client.get("/metrics").get_data(as_text=True).splitlines():
        if line.startswith("lightkeeper_monitor_registrations_total{") \
                and 'outcome="bad_request"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_deeply_nested_json_is_a_400_without_a_logged_traceback(mon, caplog):
    client = create_app(mon).test_client()
    before = _bad_requests(client)

    def post(path: str, token: str | None):
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return client.post(path, data=DEEP, headers=headers)

    with caplog.at_level(logging.INFO):
        r = post("/v1/targets", REGISTER)
        assert r.status_code == 400, r.get_json()
        assert "JSON object" in r.get_json()["error"]
        assert post("/v1/targets", None).status_code == 401  # the body read before the token
        for path in ("/v1/evict", "/v1/hosts/h1/release"):
            r = post(path, ADMIN)
            assert r.status_code == 400, (path, r.get_json())
            assert r.get_json()["error"] == "the body is not valid JSON"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert _bad_requests(client) == before + 1


@pytest.mark.parametrize("url", ["http://rank:pw-s3cret@10.0.0.7:9500",
                                 "rank:pw-s3cret@10.0.0.7:9500"])  # scheme-less: taken too
def test_another_jobs_rank_is_refused_without_its_urls_password_in_the_log(mon, caplog, url):
    client = create_app(mon).test_client()
    with caplog.at_level(logging.INFO):
        r = client.post("/v1/targets", json={"url": url, "job": "other"},
                        headers={"Authorization": f"Bearer {REGISTER}"})
    assert r.status_code == 409
    said = [r.getMessage() for r in caplog.records]
    assert any("refusing ranks of job 'other'" in m and "rank:***@10.0.0.7:9500" in m
               for m in said), said
    assert not any("pw-s3cret" in m for m in said), said


@pytest.mark.parametrize("token", ["wrong", REGISTER])  # refused unauthorized; refused its query
def test_a_refused_registration_with_a_long_password_logs_none_of_it(mon, caplog, token):
    secret = "s3cret" + "x" * 300  # a JWT-sized password: past the log line's 200-character cut
    client = create_app(mon).test_client()
    with caplog.at_level(logging.INFO):
        r = client.post("/v1/targets", json={"url": f"rank:{secret}@10.0.0.7:9500/?q=1"},
                        headers={"Authorization": f"Bearer {token}"})
    assert r.status_code in (400, 401, 403), r.get_json()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "10.0.0.7" in said or "rank:" in said, said  # the refusal was said
    assert "xxxxxxxxxx" not in said, said
