"""``lightkeeper dashboards build|validate|upload``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="dashboards_command", metavar="ACTION")
    sub.required = True

    b = sub.add_parser("build", help="generate the dashboards and Prometheus files from code",
                       description="Write dashboards/generated/*.json and "
                                   "dashboards/prometheus/{prometheus,rules,rules_test}.yml; "
                                   "in a checkout, also the Kubernetes PrometheusRule and "
                                   "dashboard ConfigMaps that restate them "
                                   "(deploy/kubernetes/generate.py).")
    b.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the committed files are stale")
    b.add_argument("--out", metavar="DIR",
                   help="also copy the dashboard JSON files to DIR (e.g. the path a Grafana "
                        "dashboard provider reads)")

    v = sub.add_parser("validate", help="check the dashboards (schema, PromQL, metric names)",
                       description="Type-check the generated dashboards against Grafana's "
                                   "dashboard model (the npm package @grafana/schema, with "
                                   "tsc), parse every query, check that the files are not "
                                   "stale and (with promtool on PATH) the Prometheus files.")
    v.add_argument("--schema-dir", metavar="DIR",
                   help="the installed schema project: dashboards/schema with its node_modules "
                        "(default; bin/bootstrap installs it), or $LIGHTKEEPER_GRAFANA_SCHEMA_DIR")
    v.add_argument("--metrics-url", metavar="URL", action="append", default=[],
                   help="a live /metrics page (WorkerServer or monitor; repeatable): every "
                        "metric a query names must be exported by one of them")
    v.add_argument("--no-promtool", action="store_true",
                   help="skip promtool check config/rules and test rules")

    u = sub.add_parser("upload", help="upload the dashboards to Grafana (overwrites, idempotent)",
                       description="Create or overwrite the dashboards in a Grafana folder. The "
                                   "token is read from the environment ($GRAFANA_TOKEN by "
                                   "default), never from the command line.")
    u.add_argument("--grafana-url", default=os.environ.get("GRAFANA_URL"),
                   help="Grafana base URL, e.g. http://grafana:3000 (env GRAFANA_URL)")
    u.add_argument("--token-env", default="GRAFANA_TOKEN", metavar="NAME",
                   help="environment variable holding the service account token "
                        "(default GRAFANA_TOKEN)")
    u.add_argument("--folder", default="Lightkeeper", help="folder title (default Lightkeeper)")
    u.add_argument("--folder-uid", default="lightkeeper", help="folder uid (default lightkeeper)")
    u.add_argument("--dir", metavar="DIR", help="upload the dashboards in DIR instead of the "
                                                "generated ones")
    u.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout, seconds")


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


def _build(args: argparse.Namespace) -> int:
    from .build import GENERATED_DIR, stale_files, write_all

    k8s = _kubernetes_generator()
    source_error = k8s.SourceError if k8s else ()  # a rules file the generator cannot read
    try:
        if args.check:
            stale = stale_files() + (k8s.stale_files() if k8s else [])
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
    for p in written:
        print(f"wrote {p}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(GENERATED_DIR.glob("*.json")):
            shutil.copyfile(f, out / f.name)
            print(f"copied {f.name} to {out}")
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
        r = subprocess.run([promtool, *cmd], cwd=PROMETHEUS_DIR, capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            problems.append(f"promtool {' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return problems


def _validate(args: argparse.Namespace) -> int:
    from .schema_check import SchemaCheckError, SchemaPackageMissing, schema_project
    from .validate import ParserMissing, names_from_exposition, validate_all

    try:
        schemas = schema_project(args.schema_dir)
    except SchemaPackageMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    known = None
    if args.metrics_url:
        import requests

        known = set()
        for url in args.metrics_url:
            try:
                r = requests.get(url, timeout=5)
                r.raise_for_status()
            except requests.RequestException as e:
                print(f"error: cannot scrape {url}: {e}", file=sys.stderr)
                return 2
            known |= names_from_exposition(r.text)
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
    from .upload import UploadError, load_dashboards, upload

    if not args.grafana_url:
        print("error: --grafana-url (or GRAFANA_URL) is required", file=sys.stderr)
        return 2
    try:
        dashboards = load_dashboards(Path(args.dir)) if args.dir else None
        done = upload(args.grafana_url, os.environ.get(args.token_env), folder=args.folder,
                      folder_uid=args.folder_uid, dashboards=dashboards, timeout=args.timeout)
    except UploadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for d in done:
        print(f"uploaded {d.uid} ({d.title}) version {d.version}: {d.url}")
    return 0


def run(args: argparse.Namespace) -> int:
    return {"build": _build, "validate": _validate, "upload": _upload}[args.dashboards_command](args)
