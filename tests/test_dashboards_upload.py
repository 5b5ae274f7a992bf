"""``lightkeeper dashboards upload`` against a local stand-in for Grafana's HTTP API.

No Grafana server can run on these machines, so a small HTTP server plays the part of the few
endpoints the upload uses (``GET/POST /api/folders``, ``POST /api/dashboards/db``), with Grafana's
status codes and bodies, and records and checks every request: the bearer token, the folder,
``overwrite: true``, and that each dashboard arrives intact under its fixed uid.
"""

from __future__ import annotations

import json

import pytest

from dashboards.build import build_dashboards
from lightkeeper.cli import main
from tests.support.http_stub import HttpStub

TOKEN = "glsa_test_token"
DASHBOARDS = {d["uid"]: d for d in build_dashboards().values()}


class FakeGrafana:
    """Grafana's folder and dashboard API, in memory."""

    def __init__(self, *, forbid: bool = False, prefix: str = "", echo_auth: bool = False
                 ) -> None:
        """``prefix``: served under that sub-path (a reverse proxy's); ``echo_auth``: every
        request fails with a 500 that quotes the Authorization header back."""
        self.folders: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}  # uid -> saved body
        self.versions: dict[str, int] = {}
        self.problems: list[str] = []
        self.forbid = forbid
        self.prefix, self.echo_auth = prefix, echo_auth
        self.server = HttpStub({"GET": self.answer, "POST": self.answer})
        self.url = self.server.url + prefix

    @property
    def requests(self) -> list[tuple[str, str, dict | None]]:
        return [(r.method, r.target, _json(r)) for r in self.server.requests]

    def answer(self, req) -> tuple[int, dict]:
        if self.echo_auth:
            return 500, {"message": f"bad {req.headers['Authorization']}"}
        if not req.target.startswith(self.prefix + "/api/"):
            return 404, {"message": "Not found"}
        if req.headers.get("Authorization") != f"Bearer {TOKEN}":
            return 401, {"message": "invalid API key"}
        if self.forbid:
            return 403, {"message": "You'll need additional permissions"}
        return self.route(req.method, req.target[len(self.prefix):], _json(req))

    def route(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        if method == "GET" and path.startswith("/api/folders/"):
            uid = path.rsplit("/", 1)[1]
            if uid in self.folders:
                return 200, self.folders[uid]
            return 404, {"message": "folder not found", "status": "not-found"}
        if method == "POST" and path == "/api/folders":
            uid = body.get("uid")
            if uid in self.folders:
                return 409, {"message": "a folder with the same uid already exists"}
            self.folders[uid] = {"id": len(self.folders) + 1, "uid": uid, "title": body["title"]}
            return 200, self.folders[uid]
        if method == "POST" and path == "/api/dashboards/db":
            d = body.get("dashboard") or {}
            uid = d.get("uid")
            if body.get("folderUid") not in self.folders:
                self.problems.append(f"dashboard {uid} saved into unknown folder "
                                     f"{body.get('folderUid')!r}")
                return 400, {"message": "folder not found"}
            if uid in self.dashboards and not body.get("overwrite"):
                return 412, {"message": "A dashboard with the same uid already exists",
                             "status": "name-exists"}
            if d.get("id") not in (None, 0):
                self.problems.append(f"dashboard {uid} sent with id {d.get('id')}")
            self.dashboards[uid] = body
            self.versions[uid] = self.versions.get(uid, 0) + 1
            return 200, {"id": 1, "uid": uid, "status": "success",
                         "url": f"/d/{uid}/{uid}", "version": self.versions[uid]}
        return 404, {"message": "Not found"}

    def __enter__(self) -> FakeGrafana:
        return self

    def __exit__(self, *exc) -> None:
        self.server.close()


def _json(req) -> dict | None:
    return json.loads(req.body) if req.body else None


@pytest.fixture
def grafana():
    with FakeGrafana() as g:
        yield g


def test_upload_creates_folder_and_dashboards_then_overwrites(grafana, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    assert main(["dashboards", "upload", "--grafana-url", grafana.url]) == 0
    out = capsys.readouterr().out
    assert set(grafana.folders) == {"lightkeeper"}
    assert grafana.folders["lightkeeper"]["title"] == "Lightkeeper"
    assert set(grafana.dashboards) == set(DASHBOARDS)
    for uid, body in grafana.dashboards.items():
        assert body["overwrite"] is True and body["folderUid"] == "lightkeeper"
        sent = {k: v for k, v in body["dashboard"].items() if k != "id"}
        assert sent == DASHBOARDS[uid], f"{uid} changed on the way"
        assert f"uploaded {uid}" in out
    first = list(grafana.requests)
    assert [(m, p) for m, p, _ in first[:2]] == [("GET", "/api/folders/lightkeeper"),
                                                 ("POST", "/api/folders")]

    # again: same folder (not re-created), same uids, new versions
    assert main(["dashboards", "upload", "--grafana-url", grafana.url + "/"]) == 0
    second = grafana.requests[len(first):]
    assert [(m, p) for m, p, _ in second] == [("GET", "/api/folders/lightkeeper")] + [
        ("POST", "/api/dashboards/db")] * len(DASHBOARDS)
    assert set(grafana.versions.values()) == {2}
    assert len(grafana.folders) == 1 and not grafana.problems


def test_upload_into_another_folder(grafana, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", TOKEN)
    assert main(["dashboards", "upload", "--grafana-url", grafana.url, "--token-env", "MY_TOKEN",
                 "--folder", "Training", "--folder-uid", "training"]) == 0
    assert set(grafana.folders) == {"training"}
    assert {b["folderUid"] for b in grafana.dashboards.values()} == {"training"}


def test_bad_token_is_a_clear_error(grafana, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", "wrong")
    assert main(["dashboards", "upload", "--grafana-url", grafana.url]) == 1
    err = capsys.readouterr().err
    assert "rejected the token (401 Unauthorized)" in err and "GRAFANA_TOKEN" in err
    assert not grafana.dashboards
    # the token travelled as a bearer token, never in the URL
    assert all("wrong" not in path for _, path, _ in grafana.requests)


def test_missing_token_is_a_clear_error(grafana, monkeypatch, capsys):
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert main(["dashboards", "upload", "--grafana-url", grafana.url]) == 1
    assert "no Grafana token: set $GRAFANA_TOKEN" in capsys.readouterr().err
    assert not grafana.requests


def test_forbidden_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    with FakeGrafana(forbid=True) as g:
        assert main(["dashboards", "upload", "--grafana-url", g.url]) == 1
    assert "403 Forbidden" in capsys.readouterr().err


def test_unreachable_grafana_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    port = 1  # nothing listens on port 1: refused
    assert main(["dashboards", "upload", "--grafana-url", f"http://127.0.0.1:{port}",
                 "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach Grafana at http://127.0.0.1:{port}" in err


def usage_error(argv: list[str], capsys) -> str:
    """The stderr of a command line that argparse refuses (exit 2), which must be one line
    after the usage and name no secret."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("lightkeeper dashboards upload: error: "), err
    return err.splitlines()[-1]


def test_not_a_url(monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    err = usage_error(["dashboards", "upload", "--grafana-url", "grafana:3000"], capsys)
    assert "argument --grafana-url: must be http(s)://" in err


def test_token_with_a_trailing_newline_works(grafana, monkeypatch):
    """A Kubernetes Secret made with --from-file ends in a newline."""
    monkeypatch.setenv("GRAFANA_TOKEN", f"  {TOKEN}\n")
    assert main(["dashboards", "upload", "--grafana-url", grafana.url]) == 0
    assert set(grafana.dashboards) == set(DASHBOARDS)


def test_token_with_a_control_character_is_refused_and_not_shown(grafana, monkeypatch,
                                                                 capsys):
    monkeypatch.setenv("MY_TOKEN", "glsa_secret\r\nX-Injected: 1")
    assert main(["dashboards", "upload", "--grafana-url", grafana.url,
                 "--token-env", "MY_TOKEN"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: $MY_TOKEN holds a control") and len(err.splitlines()) == 1
    assert "secret" not in err and not grafana.requests


def test_token_never_appears_in_an_error(monkeypatch, capsys):
    """Whatever an answer quotes back (here a 500 repeating the Authorization header), the
    token is redacted from the message."""
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    with FakeGrafana(echo_auth=True) as g:
        assert main(["dashboards", "upload", "--grafana-url", g.url]) == 1
    err = capsys.readouterr().err
    assert "answered with an error: Server Error 500: bad Bearer ***" in err
    assert TOKEN not in err


@pytest.mark.parametrize("slash", ["", "/"])
def test_grafana_under_a_sub_path(monkeypatch, slash):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    with FakeGrafana(prefix="/grafana") as g:
        assert main(["dashboards", "upload", "--grafana-url", g.url + slash]) == 0
    assert {p for _, p, _ in g.requests} == {"/grafana/api/folders/lightkeeper",
                                            "/grafana/api/folders", "/grafana/api/dashboards/db"}
    assert set(g.dashboards) == set(DASHBOARDS)


def test_messages_name_the_token_env_given(grafana, monkeypatch, capsys):
    monkeypatch.delenv("MY_TOKEN", raising=False)
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)  # not the one asked for
    argv = ["dashboards", "upload", "--grafana-url", grafana.url, "--token-env", "MY_TOKEN"]
    assert main(argv) == 1
    assert "no Grafana token: set $MY_TOKEN " in capsys.readouterr().err
    monkeypatch.setenv("MY_TOKEN", "glsa_wrong_token")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "(401 Unauthorized): check $MY_TOKEN " in err and "GRAFANA_TOKEN" not in err


@pytest.mark.parametrize("args, message", [
    (["--timeout", "inf"], "argument --timeout: expected a number of seconds in (0, 3600], got 'inf'"),
    (["--timeout", "0"], "argument --timeout: expected a number of seconds in (0, 3600], got '0'"),
    (["--timeout", "-1"], "argument --timeout: expected a number of seconds in (0, 3600], got '-1'"),
    (["--timeout", "nan"], "argument --timeout: expected a number of seconds in (0, 3600], got 'nan'"),
    (["--token-env", ""], "argument --token-env: expected the name of an environment variable "
                          "that holds the token (not the token itself)"),
    # a token pasted where its variable's name goes: refused, never shown
    (["--token-env", "glsa_pasted_token_0123"], "argument --token-env: expected the name of an "
     "environment variable that holds the token (not the token itself)"),
    (["--timeout", "1e10"], "argument --timeout: expected a number of seconds in (0, 3600], "
                            "got '1e10'"),
    (["--folder", ""], "argument --folder: must not be empty"),
    (["--folder-uid", ""], "argument --folder-uid: expected a Grafana uid (1 to 40 of A-Z a-z "
                           "0-9 _ -), got ''"),
    (["--folder-uid", "a/b"], "argument --folder-uid: expected a Grafana uid (1 to 40 of A-Z "
                              "a-z 0-9 _ -), got 'a/b'"),
    (["--dir", "no/such/dir"], "argument --dir: 'no/such/dir' does not exist"),
])
def test_bad_flags_are_usage_errors(grafana, monkeypatch, capsys, args, message):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    err = usage_error(["dashboards", "upload", "--grafana-url", grafana.url, *args], capsys)
    assert err.endswith(message) and not grafana.requests


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:99999", "is not a valid URL: Port out of range 0-65535"),
    ("http://::1:3000", "is not a valid URL: Port could not be cast to integer"),
    ("http://admin:hunter2@127.0.0.1:99999", "'http://***@127.0.0.1:99999' is not a valid URL"),
])
def test_bad_grafana_url_is_a_usage_error(monkeypatch, capsys, url, message):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    err = usage_error(["dashboards", "upload", "--grafana-url", url], capsys)
    assert "argument --grafana-url: " in err and message in err and "hunter2" not in err


def test_credentials_in_the_url_are_never_shown(grafana, monkeypatch, capsys):
    monkeypatch.setenv("GRAFANA_TOKEN", "glsa_wrong_token")
    url = grafana.url.replace("http://", "http://admin:hunter2@")
    assert main(["dashboards", "upload", "--grafana-url", url]) == 1
    err = capsys.readouterr().err
    assert f"Grafana at {grafana.url.replace('http://', 'http://***@')} rejected" in err
    assert "hunter2" not in err
    port = 1  # and where nobody answers: nothing listens on port 1
    assert main(["dashboards", "upload", "--grafana-url",
                 f"http://admin:hunter2@127.0.0.1:{port}", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach Grafana at http://***@127.0.0.1:{port}" in err and "hunter2" not in err


@pytest.mark.parametrize("content, message", [
    (b'{"uid": "x", "title": ', "not valid JSON: Expecting value: line 1"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    (b'{"title": "no uid"}', 'not a dashboard: a JSON object with a non-empty "uid" and "title"'),
    (b'{"uid": "x", "title": ""}', "not a dashboard"),
    (b'{"uid": 7, "title": "t"}', "not a dashboard"),
    (b'[{"uid": "x", "title": "t"}]', "not a dashboard"),
])
def test_dir_with_a_file_that_is_not_a_dashboard(grafana, monkeypatch, capsys, tmp_path,
                                                  content, message):
    """Every file is checked before the first request: no folder made, nothing uploaded."""
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    (tmp_path / "a.json").write_text(json.dumps(next(iter(DASHBOARDS.values()))))
    (tmp_path / "b.json").write_bytes(content)
    assert main(["dashboards", "upload", "--grafana-url", grafana.url,
                 "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'b.json'}: {message}"), err
    assert len(err.splitlines()) == 1 and not grafana.requests


def test_two_files_with_one_uid_are_refused_before_any_request(grafana, monkeypatch, capsys,
                                                                tmp_path):
    """The second replaced the first in Grafana and both said 'uploaded'."""
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    (tmp_path / "a.json").write_text(json.dumps({"uid": "same", "title": "A"}))
    (tmp_path / "b.json").write_text(json.dumps({"uid": "same", "title": "B"}))
    assert main(["dashboards", "upload", "--grafana-url", grafana.url,
                 "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'b.json'}: uid 'same' is also "
                          f"{tmp_path / 'a.json'}'s"), err
    assert not grafana.requests


def test_a_dashboard_grafana_refuses_is_named_with_those_saved_before_it(grafana, monkeypatch,
                                                                         capsys, tmp_path):
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    (tmp_path / "a.json").write_text(json.dumps({"uid": "first", "title": "A"}))
    (tmp_path / "b.json").write_text(json.dumps({"uid": "second", "title": "B"}))
    route = grafana.route

    def refusing(method, path, body):
        if path == "/api/dashboards/db" and body["dashboard"]["uid"] == "second":
            return 400, {"message": "Dashboard uid too long"}
        return route(method, path, body)

    grafana.route = refusing
    assert main(["dashboards", "upload", "--grafana-url", grafana.url,
                 "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "dashboard 'second' (B): " in err and "Dashboard uid too long" in err, err
    assert "(uploaded before it: first)" in err
    assert set(grafana.dashboards) == {"first"}
