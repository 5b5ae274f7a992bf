"""``lightkeeper dashboards build|validate`` and ``python -m dashboards.render`` given bad input:
a one-line error naming the flag, and nothing written before the input is checked.

``build`` runs with ``write_all`` replaced by a recorder and without the Kubernetes generator, so
these tests never rewrite the checkout's generated files; the copies come from them.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

from dashboards import build, render
from dashboards import cli as dashboards_cli
from lightkeeper.cli import main
from tests.support.http_stub import HttpStub

DASHBOARDS = sorted(p.name for p in build.GENERATED_DIR.glob("*.json"))


@pytest.fixture
def writes(monkeypatch) -> list[str]:
    """Calls of build.write_all (which writes nothing here and reports nothing changed)."""
    calls: list[str] = []
    monkeypatch.setattr(build, "write_all", lambda: calls.append("write_all") or [])
    monkeypatch.setattr(dashboards_cli, "_kubernetes_generator", lambda: None)
    return calls


@contextmanager
def serve(answer):
    """An HTTP server on 127.0.0.1 whose GETs are answered by ``answer(path, query)`` ->
    (status, content type, body); yields its base URL."""

    def get(req):
        status, ctype, body = answer(req.path, req.query)
        return status, body, {"Content-Type": ctype}

    with HttpStub({"GET": get}) as server:
        yield server.url


def usage_error(argv: list[str], capsys, run=main) -> str:
    with pytest.raises(SystemExit) as e:
        run(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


# --- build ------------------------------------------------------------------------------------
@pytest.mark.parametrize("out, reason", [
    ("afile", "not a directory"),
    ("/proc/nope", "No such file or directory"),
    (str(build.GENERATED_DIR), "is where the dashboards are generated"),
])
def test_build_out_that_cannot_take_the_copies(writes, capsys, tmp_path, monkeypatch, out,
                                               reason):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine\n")
    assert main(["dashboards", "build", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out}: {reason}") and len(err.splitlines()) == 1, err
    assert not writes, "files written before --out was checked"
    assert (tmp_path / "afile").read_text() == "mine\n"


@pytest.mark.parametrize("edit", [b" ", b"\xff"])
def test_check_names_a_hand_edited_dashboard_stale(tmp_path, monkeypatch, capsys, edit):
    """A committed dashboard edited by hand (a trailing space, a byte that is no UTF-8) is
    stale (exit 1), though the Kubernetes generator cannot restate it as it stands (its YAML
    block refuses the space; it reads UTF-8), and the build rewrites it."""
    import shutil

    generated = tmp_path / "generated"
    shutil.copytree(build.GENERATED_DIR, generated)
    edited = generated / DASHBOARDS[0]
    edited.write_bytes(edited.read_bytes() + edit)
    k8s = dashboards_cli._kubernetes_generator()
    for name in ("PROMETHEUS_RULE", "DASHBOARD_CONFIGMAPS"):
        shutil.copy(getattr(k8s, name), tmp_path / getattr(k8s, name).name)
        monkeypatch.setattr(k8s, name, tmp_path / getattr(k8s, name).name)
    monkeypatch.setattr(k8s, "DASHBOARDS_DIR", generated)
    monkeypatch.setattr(dashboards_cli, "_kubernetes_generator", lambda: k8s)
    monkeypatch.setattr(build, "GENERATED_DIR", generated)
    assert main(["dashboards", "build", "--check"]) == 1
    assert f"stale: {edited}" in capsys.readouterr().err
    assert build.stale_files() == [edited]
    assert build.write_all() == [edited] and build.stale_files() == []


def test_build_out_cannot_be_empty_or_combined_with_check(writes, capsys):
    assert usage_error(["dashboards", "build", "--out", ""], capsys).endswith(
        "error: argument --out: must not be empty")
    assert usage_error(["dashboards", "build", "--check", "--out", "x"], capsys).endswith(
        "error: argument --out: not allowed with argument --check")
    assert not writes


def test_build_says_what_it_copied_replaced_or_that_all_is_up_to_date(writes, capsys,
                                                                      tmp_path):
    assert main(["dashboards", "build"]) == 0
    assert capsys.readouterr().out == "generated files are up to date\n"

    out = tmp_path / "provisioned"
    assert main(["dashboards", "build", "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"copied {n} to {out}" for n in DASHBOARDS]

    (out / DASHBOARDS[0]).write_text("{}\n")  # someone's edit, replaced by the build's
    assert main(["dashboards", "build", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"replaced {out / DASHBOARDS[0]} (it differed)\n"
    assert sorted(p.name for p in out.iterdir()) == DASHBOARDS
    for n in DASHBOARDS:
        assert (out / n).read_bytes() == (build.GENERATED_DIR / n).read_bytes()

    assert main(["dashboards", "build", "--out", str(out)]) == 0
    assert capsys.readouterr().out == (f"generated files are up to date, as are the copies in "
                                       f"{out}\n")


# --- validate ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ctype, body", [
    ("text/html", "<!DOCTYPE html>\n<html><body>Grafana</body></html>\n"),
    ("application/json", json.dumps({"status": "ok", "metrics": []}, indent=2)),
    ("text/plain", ""),
])
def test_validate_metrics_url_that_is_not_a_metrics_page(capsys, ctype, body):
    with serve(lambda path, query: (200, ctype, body)) as url:
        assert main(["dashboards", "validate", "--no-promtool", "--metrics-url", url]) == 2
    assert capsys.readouterr().err == (f"error: --metrics-url {url}: no Prometheus metrics "
                                       "found\n")


# --- render -----------------------------------------------------------------------------------
# nothing listens on port 1 (refused): a port picked with bind(0) and let go may be another
# test's server by the time it is asked
CLOSED_PORT = 1


def test_render_without_prometheus_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the old default, docs/img, would have been written
    url = f"http://127.0.0.1:{CLOSED_PORT}"
    err = usage_error(["--prometheus-url", url, "--out", "img"], capsys, run=render.main)
    assert err == f"python -m dashboards.render: error: --prometheus-url {url}: cannot connect"
    with serve(lambda path, query: (200, "text/html", "<html></html>")) as page:
        err = usage_error(["--prometheus-url", page, "--out", "img"], capsys, run=render.main)
    assert f"error: --prometheus-url {page}: not a Prometheus query API" in err
    assert list(tmp_path.iterdir()) == []


def test_render_needs_out(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = usage_error(["--prometheus-url", f"http://127.0.0.1:{CLOSED_PORT}"], capsys,
                      run=render.main)
    assert err.endswith("error: the following arguments are required: --out")
    assert list(tmp_path.iterdir()) == []


def test_render_panel_errors_go_to_stderr(capsys, tmp_path):
    """A Prometheus that answers the probe but fails every panel's query: pictures with the
    errors drawn, the errors on stderr, exit 1."""
    def answer(path, query):
        if query.get("query") == ["1"]:
            return 200, "application/json", json.dumps(
                {"status": "success", "data": {"resultType": "scalar", "result": [0, "1"]}})
        return 400, "application/json", json.dumps(
            {"status": "error", "errorType": "bad_data", "error": "no such metric"})

    with serve(answer) as url:
        assert render.main(["--prometheus-url", url, "--out", str(tmp_path),
                            "--job", "train"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"wrote {tmp_path / n.replace('.json', '.png')}"
                                for n in build.build_dashboards()]
    assert err and all(line.startswith("panel error: ") for line in err.splitlines())
    assert "no such metric" in err


def _prometheus_with_jobs(jobs: list[str], seen: list[str], asked: list | None = None):
    """A Prometheus stand-in: the probe answers, ``job`` label values of lightkeeper_step are
    ``jobs`` (each such query kept in ``asked``), and every other query fails (recorded in
    ``seen``)."""
    def answer(path, query):
        if query.get("query") == ["1"]:
            return 200, "application/json", json.dumps(
                {"status": "success", "data": {"resultType": "scalar", "result": [0, "1"]}})
        if path == "/api/v1/label/job/values" and query.get("match[]") == ["lightkeeper_step"]:
            if asked is not None:
                asked.append(query)
            return 200, "application/json", json.dumps({"status": "success", "data": jobs})
        seen.extend(query.get("query", []))
        return 400, "application/json", json.dumps(
            {"status": "error", "errorType": "bad_data", "error": "no such metric"})
    return answer


def test_render_without_job_and_none_in_prometheus_writes_nothing(capsys, tmp_path):
    """The dashboards match $job exactly, so there is no "every job" to fall back on."""
    seen: list[str] = []
    with serve(_prometheus_with_jobs([], seen)) as url:
        err = usage_error(["--prometheus-url", url, "--out", str(tmp_path / "img")], capsys,
                          run=render.main)
    assert err == (f"python -m dashboards.render: error: --job: no job has lightkeeper_step "
                   f"series at {url} in the time range; name the job")
    assert seen == [] and list(tmp_path.iterdir()) == []


def test_render_of_a_job_prometheus_does_not_have_writes_nothing(capsys, tmp_path):
    """A mistyped --job drew empty panels over the pictures and exited 0 (--out docs/img)."""
    seen: list[str] = []
    with serve(_prometheus_with_jobs(["a.b", "train-1"], seen)) as url:
        err = usage_error(["--prometheus-url", url, "--out", str(tmp_path / "img"), "--job",
                           "trian-1"], capsys, run=render.main)
    assert err == (f"python -m dashboards.render: error: --job trian-1: no lightkeeper_step "
                   f"series of it at {url} in the time range (jobs: a.b, train-1)")
    assert seen == [] and list(tmp_path.iterdir()) == []


def test_render_defaults_to_the_first_job_prometheus_has_in_the_range():
    """In Grafana's natural order (train-9 before train-10), of the jobs with series between
    start and end: a job of last month has none in a 15-minute picture."""
    seen: list[str] = []
    with serve(_prometheus_with_jobs(["train-b", "a.b"], seen)) as url:
        assert render.Prom(url).first_job(100.0, 200.0) == "a.b"
    asked: list[dict] = []
    with serve(_prometheus_with_jobs(["train-10", "Zeta", "train-9"], seen, asked)) as url:
        assert render.Prom(url).first_job(100.0, 200.0) == "train-9"
    assert asked and asked[-1]["start"] == ["100.0"] and asked[-1]["end"] == ["200.0"]
    with serve(_prometheus_with_jobs([], seen)) as url:
        assert render.Prom(url).first_job(100.0, 200.0) is None


def test_a_folder_where_a_dashboard_goes_is_stale_and_a_one_line_build_error(
        tmp_path, monkeypatch, capsys):
    import shutil

    generated = tmp_path / "generated"
    shutil.copytree(build.GENERATED_DIR, generated)
    taken = generated / DASHBOARDS[0]
    taken.unlink()
    taken.mkdir()
    monkeypatch.setattr(build, "GENERATED_DIR", generated)
    monkeypatch.setattr(dashboards_cli, "_kubernetes_generator", lambda: None)
    assert main(["dashboards", "build", "--check"]) == 1
    assert f"stale: {taken}" in capsys.readouterr().err
    assert main(["dashboards", "build"]) == 2
    assert capsys.readouterr().err == f"lightkeeper dashboards build: {taken}: Is a directory\n"
