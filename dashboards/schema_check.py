"""Dashboards checked against Grafana's dashboard model from the npm package ``@grafana/schema``.

Grafana publishes its dashboard model (and the options and field config of every core panel
kind) as TypeScript types in ``@grafana/schema``. ``dashboards/schema/`` is a small npm project
that pins it and the TypeScript compiler (``package.json``, ``package-lock.json``; ``bin/bootstrap``
runs ``npm ci`` there) and says what a Lightkeeper dashboard is in those types
(``dashboards/schema/dashboard.ts``). :func:`schema_errors` writes each dashboard as a TypeScript
constant of that type, one JSON property per line, runs ``tsc --noEmit`` once over all of them
and maps every compile error back to the dashboard's JSON path (and the panel's title).

Failures: without Node.js or without the installed packages, :func:`schema_project` raises
:class:`SchemaPackageMissing` saying how to install them; when the compiler cannot run, or
reports an error that is not about a dashboard (a broken ``dashboard.ts``, a module it cannot
resolve), :func:`schema_errors` raises :class:`SchemaCheckError`. A check that did not run is
never reported as a dashboard without problems.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_ENV = "LIGHTKEEPER_GRAFANA_SCHEMA_DIR"
PROJECT_DIR = Path(__file__).resolve().parent / "schema"
# The packages the check needs from the project's node_modules (versions pinned in package.json).
REQUIRED_PACKAGES = ("@grafana/schema", "typescript")
TSC_TIMEOUT_S = 120

JsonPath = tuple[str | int, ...]


class SchemaPackageMissing(FileNotFoundError):
    """Node.js or the npm packages of the check are not installed."""


class SchemaCheckError(RuntimeError):
    """The type check could not run, or failed for a reason that is not a dashboard's."""


def install_hint(project: Path) -> str:
    if (Path(__file__).resolve().parent.parent / "bin" / "bootstrap").is_file():  # a checkout
        return (f"run bin/bootstrap (it runs `npm ci` in {project}; Node.js and npm come from "
                f"Debian's nodejs and npm packages, which `bin/bootstrap --system` installs as "
                f"root)")
    # a pip install: node_modules inside site-packages would outlive `pip uninstall`
    return (f"copy {project} to a directory of your own, run `npm ci` there (Node.js and npm "
            f"needed) and pass it as --schema-dir DIR")


def _pinned(project: Path) -> dict[str, str]:
    try:
        deps = json.loads((project / "package.json").read_text()).get("dependencies", {})
    except (OSError, ValueError, AttributeError) as e:
        raise SchemaPackageMissing(f"cannot read {project}/package.json: {e}") from e
    return {name: deps[name] for name in REQUIRED_PACKAGES if name in deps}


@dataclass(frozen=True)
class SchemaProject:
    """An installed copy of dashboards/schema: its directory and the pinned package versions."""

    dir: Path
    node: str
    versions: dict[str, str]

    @property
    def grafana_schema_version(self) -> str:
        return self.versions["@grafana/schema"]

    def __str__(self) -> str:
        return f"@grafana/schema {self.grafana_schema_version} in {self.dir}"


def schema_project(explicit: str | os.PathLike | None = None) -> SchemaProject:
    """The installed schema project: ``explicit``, else $LIGHTKEEPER_GRAFANA_SCHEMA_DIR, else
    ``dashboards/schema``. Raises SchemaPackageMissing, naming how to install, when Node.js,
    the directory or a pinned package (at its pinned version) is missing."""
    # An explicit choice is the only candidate: a typo must not fall back to another copy.
    project = Path(explicit or os.environ.get(SCHEMA_ENV) or PROJECT_DIR)
    node = shutil.which("node")
    if node is None:
        raise SchemaPackageMissing(
            "Node.js (`node`) not found on PATH: the dashboard schema check runs the TypeScript "
            f"compiler on Grafana's @grafana/schema types; {install_hint(project)}")
    if not (project / "package.json").is_file() or not (project / "dashboard.ts").is_file():
        raise SchemaPackageMissing(
            f"{project} is not the dashboard schema project (no package.json and dashboard.ts); "
            f"the project is dashboards/schema in the repository")
    pinned = _pinned(project)
    missing = [name for name in REQUIRED_PACKAGES if name not in pinned]
    if missing:
        raise SchemaPackageMissing(f"{project}/package.json does not pin {missing}")
    versions = {}
    for name, want in pinned.items():
        manifest = project / "node_modules" / name / "package.json"
        try:
            have = json.loads(manifest.read_text())["version"]
        except (OSError, ValueError, KeyError):
            raise SchemaPackageMissing(
                f"the npm package {name} is not installed in {project}/node_modules; "
                f"{install_hint(project)}") from None
        if have != want:
            raise SchemaPackageMissing(
                f"{name} {have} is installed in {project}/node_modules but package.json pins "
                f"{want}; {install_hint(project)}")
        versions[name] = have
    return SchemaProject(project, node, versions)


# --- dashboards as TypeScript -------------------------------------------------------------------
def to_typescript(value: Any, prefix: str = "", suffix: str = "", indent: int = 0,
                  path: JsonPath = ()) -> list[tuple[str, JsonPath]]:
    """``value`` as a TypeScript literal, one JSON property or array item per line, each line
    with the JSON path of what starts on it (a compile error's line gives its path)."""
    pad = "  " * indent
    if isinstance(value, (dict, list)) and value:
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
        lines = [(f"{pad}{prefix}{opening}", path)]
        for i, (key, item) in enumerate(items):
            key_text = f"{json.dumps(key)}: " if isinstance(value, dict) else ""
            comma = "," if i < len(items) - 1 else ""
            lines += to_typescript(item, key_text, comma, indent + 1, (*path, key))
        lines.append((f"{pad}{closing}{suffix}", path))
        return lines
    return [(f"{pad}{prefix}{json.dumps(value, allow_nan=False)}{suffix}", path)]


HEADER = ('import type { LightkeeperDashboard } from "./dashboard";\n\n'
          "export const dashboard: LightkeeperDashboard = ")
HEADER_LINES = HEADER.count("\n")


def dashboard_source(dashboard: dict) -> tuple[str, list[JsonPath]]:
    """The TypeScript module for one dashboard, and the JSON path of each of its lines (1-based
    line n is ``paths[n - 1]``)."""
    body = to_typescript(dashboard, suffix=";")
    text = HEADER + "\n".join(line for line, _ in body) + "\n"
    paths: list[JsonPath] = [()] * HEADER_LINES + [p for _, p in body]
    return text, paths


def describe(dashboard: dict, path: JsonPath) -> str:
    """``panels/3/options/graphMode (panel 'Step rate')`` for a JSON path in ``dashboard``."""
    where = "/".join(map(str, path)) or "<root>"
    node: Any = dashboard
    title = None
    for i, key in enumerate(path):
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            break
        if i and path[i - 1] == "panels" and isinstance(node, dict) and "title" in node:
            title = node["title"]
    return f"{where} (panel {title!r})" if title is not None else where


# A type the compiler prints in full (a whole dashboard, a union of panels) says nothing the
# JSON path does not; the message keeps the names and the short types.
_LONG_TYPE = re.compile(r"'[^']{80,}'")
_DIAGNOSTIC = re.compile(r"^(?P<file>.+?)\((?P<line>\d+),(?P<col>\d+)\): error (?P<code>TS\d+): "
                         r"(?P<msg>.*)$")


@dataclass
class Diagnostic:
    file: str
    line: int
    code: str
    message: str  # first line and the compiler's elaboration, joined


def parse_diagnostics(output: str) -> tuple[list[Diagnostic], list[str]]:
    """tsc's ``--pretty false`` output: located diagnostics, and any other error lines."""
    found: list[Diagnostic] = []
    other: list[str] = []
    for line in output.splitlines():
        m = _DIAGNOSTIC.match(line)
        if m:
            found.append(Diagnostic(m["file"], int(m["line"]), m["code"], m["msg"]))
        elif line.startswith(" ") and found:
            found[-1].message += " " + line.strip()
        elif line.strip():
            other.append(line)
    return found, other


def schema_errors(dashboards: dict[str, dict], project: SchemaProject) -> dict[str, list[str]]:
    """Type-check every dashboard (name -> JSON) against Grafana's model; name -> problems,
    one readable line each (a valid dashboard maps to an empty list)."""
    with tempfile.TemporaryDirectory(prefix="lightkeeper-schema-") as tmp:
        work = Path(tmp)
        # The modules resolve @grafana/schema from the installed project, next to the types.
        (work / "node_modules").symlink_to(project.dir / "node_modules", target_is_directory=True)
        shutil.copyfile(project.dir / "dashboard.ts", work / "dashboard.ts")
        sources: dict[str, tuple[str, list[JsonPath]]] = {}  # file -> dashboard, line paths
        for i, (name, dashboard) in enumerate(sorted(dashboards.items())):
            file_name = f"dashboard_{i}.ts"
            text, paths = dashboard_source(dashboard)
            (work / file_name).write_text(text)
            sources[file_name] = (name, paths)
        (work / "tsconfig.json").write_text(json.dumps({
            "compilerOptions": {"strict": True, "noEmit": True, "module": "esnext",
                                "moduleResolution": "bundler", "target": "es2022",
                                "skipLibCheck": True, "types": []},
            "files": ["dashboard.ts", *sources],
        }))
        tsc = project.dir / "node_modules" / "typescript" / "bin" / "tsc"
        try:
            r = subprocess.run([project.node, str(tsc), "-p", str(work / "tsconfig.json"),
                                "--pretty", "false"], cwd=work, capture_output=True, text=True,
                               timeout=TSC_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SchemaCheckError(f"could not run the TypeScript compiler ({tsc}): {e}") from e
    output = r.stdout + r.stderr
    diagnostics, other = parse_diagnostics(output)
    problems: dict[str, list[str]] = {name: [] for name in dashboards}
    not_ours = [d for d in diagnostics if Path(d.file).name not in sources] + [
        d for d in diagnostics if d.code == "TS2307"]  # a module that does not resolve
    if not_ours or other or (r.returncode != 0 and not diagnostics):
        raise SchemaCheckError(
            f"the TypeScript compiler failed for a reason that is not a dashboard's "
            f"(exit status {r.returncode}); {install_hint(project.dir)}:\n{output[-4000:]}")
    for d in diagnostics:
        name, paths = sources[Path(d.file).name]
        path = paths[d.line - 1] if 0 < d.line <= len(paths) else ()
        message = _LONG_TYPE.sub("'…'", d.message)
        problems[name].append(f"{describe(dashboards[name], path)}: {message}")
    if r.returncode != 0 and not any(problems.values()):
        raise SchemaCheckError(f"tsc exited with {r.returncode} and no diagnostics:\n{output}")
    return problems
