"""``lightkeeper dashboards build|validate|upload``."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from http_serving import on_command_line


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 3600):  # a socket timeout overflows past ~1e10
        raise argparse.ArgumentTypeError(f"expected a number of seconds in (0, 3600], got "
                                         f"{text!r}")
    return value


def _folder_uid(text: str) -> str:
    """Grafana's uid rule: it goes into the URL's path as it is."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", text):
        raise argparse.ArgumentTypeError("expected a Grafana uid (1 to 40 of A-Z a-z 0-9 _ -), "
                                         f"got {text!r}")
    return text


def _variable_name(text: str) -> str:
    """An environment variable's name; a pasted token is refused without being shown."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) or text.startswith(("glsa_", "glc_")):
        raise argparse.ArgumentTypeError("expected the name of an environment variable that "
                                         "holds the token (not the token itself)")
    return text


def _directory(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory" if Path(text).exists()
                                         else f"{text!r} does not exist")
    return text


def _grafana_url(text: str) -> str:
    from .upload import check_url

    try:
        return check_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="dashboards_command", metavar="ACTION")
    sub.required = True

    b = sub.add_parser("build", help="generate the dashboards and Prometheus files from code",
                       description="Write dashboards/generated/*.json and "
                                   "dashboards/prometheus/{prometheus,rules,rules_test}.yml; "
                                   "in a checkout, also the Kubernetes PrometheusRule and "
                                   "dashboard ConfigMaps that restate them "
                                   "(deploy/kubernetes/generate.py).")
    only = b.add_mutually_exclusive_group()
    only.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 if the committed files are stale")
    only.add_argument("--out", metavar="DIR", type=_nonempty,
                      help="also copy the dashboard JSON files to DIR (e.g. the path a "
                           "Grafana dashboard provider reads)")

    v = sub.add_parser("validate", help="check the dashboards (schema, PromQL, metric names)",
                       description="Type-check the generated dashboards against Grafana's "
                                   "dashboard model (the npm package @grafana/schema, with "
                                   "tsc), parse every query, check that the files are not "
                                   "stale and (with promtool on PATH) the Prometheus files.")
    v.add_argument("--schema-dir", metavar="DIR",
                   help="the installed schema project: dashboards/schema with its node_modules "
                        "(default; bin/bootstrap installs it in a checkout), or "
                        "$LIGHTKEEPER_GRAFANA_SCHEMA_DIR (from a pip install: a copy of "
                        "dashboards/schema where `npm ci` ran)")
    v.add_argument("--metrics-url", metavar="URL", action="append", default=[],
                   help="a live /metrics page (WorkerServer or monitor; repeatable): every "
                        "metric a query names must be exported by one of them")
    v.add_argument("--no-promtool", action="store_true",
                   help="skip promtool check config/rules and test rules")

    u = sub.add_parser("upload", help="upload the dashboards to Grafana (overwrites, idempotent)",
                       description="Create or overwrite the dashboards in a Grafana folder. The "
                                   "token is read from the environment ($GRAFANA_TOKEN by "
                                   "default), never from the command line.")
    u.add_argument("--grafana-url", default=os.environ.get("GRAFANA_URL"), type=_grafana_url,
                   help="Grafana base URL, e.g. http://grafana:3000 (env GRAFANA_URL)")
    u.add_argument("--token-env", default="GRAFANA_TOKEN", metavar="NAME", type=_variable_name,
                   help="environment variable holding the service account token "
                        "(default GRAFANA_TOKEN)")
    u.add_argument("--folder", default="Lightkeeper", type=_nonempty,
                   help="folder title (default Lightkeeper)")
    u.add_argument("--folder-uid", default="lightkeeper", type=_folder_uid,
                   help="folder uid (default lightkeeper)")
    u.add_argument("--dir", metavar="DIR", type=_directory,
                   help="upload the dashboards in DIR instead of the generated ones")
    u.add_argument("--timeout", type=_seconds, default=10.0, help="HTTP timeout, seconds")


def _kubernetes_generator():
    """deploy/kubernetes/generate.py of this checkout, which restates the rules and dashboards
    as Kubernetes objects; None where the package runs without its repository (a wheel)."""
    from .build import PACKAGE_DIR

    path = PACKAGE_DIR.parent / "deploy" / "kubernetes" / "generate.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("lightkeeper_k8s_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _out_dir(out: Path) -> str | None:
    """Why ``out`` cannot take the copies (None: it can; created if missing), checked before
    anything is written."""
    from .build import GENERATED_DIR

    if out.resolve() == GENERATED_DIR.resolve():
        return "is where the dashboards are generated; copy them elsewhere"
    if out.exists() and not out.is_dir():
        return "not a directory"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return None


def _copy(out: Path) -> int:
    """Copy the dashboard JSON files into ``out``, saying which were added or replaced; how
    many were."""
    from .build import GENERATED_DIR

    n = 0
    for f in sorted(GENERATED_DIR.glob("*.json")):
        dest = out / f.name
        if dest.is_file() and dest.read_bytes() == f.read_bytes():
            continue
        line = f"replaced {dest} (it differed)" if dest.exists() else f"copied {f.name} to {out}"
        shutil.copyfile(f, dest)
        print(line)
        n += 1
    return n


def _build(args: argparse.Namespace) -> int:
    from .build import stale_files, write_all

    if args.out:
        why = _out_dir(Path(args.out))
        if why:
            print(f"error: --out {args.out}: {why}", file=sys.stderr)
            return 2
    k8s = _kubernetes_generator()
    source_error = k8s.SourceError if k8s else ()  # a rules file the generator cannot read
    try:
        if args.check:
            stale = stale_files()
            try:
                stale += k8s.stale_files() if k8s else []
            except source_error:
                if not stale:
                    raise
                # the manifests restate a stale source: they follow once it is rebuilt
            for p in stale:
                print(f"stale: {p}", file=sys.stderr)
            if stale:
                print("run `lightkeeper dashboards build`", file=sys.stderr)
                return 1
            print("generated files are up to date")
            return 0
        written = write_all()
        # after write_all: the manifests restate the files just written
        written += k8s.write_all() if k8s else []
    except source_error as e:
        print(f"lightkeeper dashboards build: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a generated file's path taken by a folder, or unwritable
        print(f"lightkeeper dashboards build: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    for p in written:
        print(f"wrote {p}")
    copied = 0
    if args.out:
        try:
            copied = _copy(Path(args.out))
        except OSError as e:
            print(f"error: --out {args.out}: {e.strerror or e}"
                  + (f": {e.filename}" if e.filename else ""), file=sys.stderr)
            return 2
    if not written and not copied:
        print("generated files are up to date" + (f", as are the copies in {args.out}"
                                                   if args.out else ""))
    return 0


def _promtool_checks() -> list[str]:
    from .build import PROMETHEUS_DIR

    promtool = shutil.which("promtool")
    if promtool is None:
        print("note: promtool not on PATH, Prometheus files not checked", file=sys.stderr)
        return []
    problems = []
    for cmd in (["check", "config", "--syntax-only", "prometheus.yml"],
                ["check", "rules", "rules.yml"], ["test", "rules", "rules_test.yml"]):
        # the rules' unit tests take promtool ~20 s of one core: minutes on a busy machine
        r = subprocess.run([promtool, *cmd], cwd=PROMETHEUS_DIR, capture_output=True, text=True,
                           timeout=600)
        if r.returncode != 0:
            problems.append(f"promtool {' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return problems


def _validate(args: argparse.Namespace) -> int:
    from .schema_check import SchemaCheckError, SchemaPackageMissing, schema_project
    from .validate import ParserMissing, names_from_exposition, validate_all

    known = None
    if args.metrics_url:
        import requests
        from prometheus_client.parser import text_string_to_metric_families

        known = set()
        for url in args.metrics_url:
            try:
                r = requests.get(url, timeout=5)
                r.raise_for_status()
            except requests.RequestException as e:
                print(f"error: cannot scrape {url}: {e}", file=sys.stderr)
                return 2
            try:  # an HTML or JSON page would count every metric as not exported
                found = any(True for _ in text_string_to_metric_families(r.text))
            except ValueError:
                found = False
            if not found:
                print(f"error: --metrics-url {url}: no Prometheus metrics found",
                      file=sys.stderr)
                return 2
            known |= names_from_exposition(r.text)
    try:
        schemas = schema_project(args.schema_dir)
    except SchemaPackageMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        problems = validate_all(schemas=schemas, known_metrics=known)
    except (ParserMissing, SchemaCheckError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.no_promtool:
        problems += _promtool_checks()
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"dashboards valid (schema: {schemas})")
    return 0


def _upload(args: argparse.Namespace) -> int:
    from .build import GENERATED_DIR
    from .upload import UploadError, load_dashboards, upload

    if not args.grafana_url:
        print("error: --grafana-url (or GRAFANA_URL) is required", file=sys.stderr)
        return 2
    if urlsplit(args.grafana_url).password and on_command_line(args.grafana_url):
        print("warning: --grafana-url's password on the command line: every user of this host "
              "can read it (ps); set GRAFANA_URL instead", file=sys.stderr)
    try:  # every file checked before the first request
        dashboards = load_dashboards(Path(args.dir) if args.dir else GENERATED_DIR)
    except UploadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        done = upload(args.grafana_url, os.environ.get(args.token_env), folder=args.folder,
                      folder_uid=args.folder_uid, dashboards=dashboards, timeout=args.timeout,
                      token_env=args.token_env)
    except UploadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for d in done:
        print(f"uploaded {d.uid} ({d.title}) version {d.version}: {d.url}")
    return 0


def run(args: argparse.Namespace) -> int:
    return {"build": _build, "validate": _validate, "upload": _upload}[args.dashboards_command](args)
