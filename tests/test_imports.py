"""Who may import whom, checked on the source with ``ast`` (README, "Layout and data flow").

Every import counts: at module level, inside functions and under ``TYPE_CHECKING``. The rules:

- ``http_serving`` and ``rank_wire`` (the wire form of a rank's timings, shared by the
  WorkerServer and the monitor) are at the bottom: they import no Lightkeeper package;
- the libraries (``worker_server``, ``monitor``, ``dashboards``, ``trainer``) never import the
  application package ``lightkeeper`` (CLI, demo, local cluster);
- ``worker_server`` imports neither ``monitor`` nor ``trainer`` (ranks know nothing of their
  readers); ``monitor`` imports neither ``worker_server`` nor ``trainer`` (it reads ranks over
  HTTP only);
- the modules of ``monitor`` import each other one way: no cycle;
- ``monitor``'s stages import only the stages before them, as the data flows (MONITOR_STAGES).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("http_serving", "rank_wire", "worker_server", "monitor", "dashboards", "trainer",
            "lightkeeper")
LIBRARIES = ("http_serving", "rank_wire", "worker_server", "monitor", "dashboards", "trainer")
FORBIDDEN = {  # package -> top-level packages it must not import
    "http_serving": set(PACKAGES) - {"http_serving"},
    "rank_wire": set(PACKAGES) - {"rank_wire"},
    "worker_server": {"lightkeeper", "monitor", "trainer", "dashboards"},
    "monitor": {"lightkeeper", "worker_server", "trainer"},
    "dashboards": {"lightkeeper"},
    "trainer": {"lightkeeper"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool,
                     known: set[str]) -> set[str]:
    """Absolute names of every module ``source`` imports (relative imports resolved).

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module in
    ``known``, else of ``pkg``.
    """
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return out


def project_modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mods[module_name(path)] = (path, path.name == "__init__.py")
    return mods


def extension_modules() -> set[str]:
    """The project's C extensions (a ``.c`` file builds the module of its name, setup.py):
    ``from . import _frpickle`` imports that module, not its package."""
    return {module_name(path.with_suffix(".py")) for pkg in PACKAGES
            for path in (ROOT / pkg).rglob("*.c")}


@functools.cache  # read-only after: the tests only read it, and parsing the tree costs ~1 s
def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    known = set(mods) | extension_modules()
    return {name: imported_modules(path.read_text(), name, is_pkg, known)
            for name, (path, is_pkg) in mods.items()}


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, imports in sorted(graph.items()):
        top = mod.split(".")[0]
        for imp in sorted(imports):
            if imp.split(".")[0] in FORBIDDEN.get(top, ()):
                out.append(f"{mod} imports {imp}")
    return out


def cycles(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """Import cycles among the modules whose names start with ``prefix`` (one per cycle)."""
    nodes = {m for m in graph if m == prefix or m.startswith(prefix + ".")}
    edges = {m: sorted(i for i in graph[m] if i in nodes and i != m) for m in nodes}
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in edges[m]:
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(nodes):
        if m not in state:
            visit(m)
    return found


def test_every_package_is_parsed():
    graph = import_graph()
    for pkg in PACKAGES:
        assert pkg in graph, f"{pkg} not found under {ROOT}"
    assert "monitor.service" in graph and "worker_server.server" in graph
    assert not (ROOT / "lightkeeper" / "wsgi.py").exists()


def test_libraries_never_import_upwards():
    assert violations(import_graph()) == []


# Known cycles, each with its reason; the list must not grow.
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycle_between_monitor_modules():
    found = cycles(import_graph(), "monitor")
    assert [c for c in found if c not in KNOWN_CYCLES] == []


def test_the_application_package_uses_the_libraries():
    """The other direction is the allowed one, and it is there (the check is not vacuous)."""
    graph = import_graph()
    assert "trainer.faults" in graph["lightkeeper.demo"]
    assert "dashboards.promconfig" in graph["lightkeeper.demo_processes"]
    assert "http_serving" in graph["monitor.service"]
    assert "monitor.api.app" in graph["monitor.service"]


@pytest.mark.parametrize("source,module,expected", [
    ("from lightkeeper.wsgi import BackgroundWSGIServer", "worker_server.server",
     ["worker_server.server imports lightkeeper.wsgi"]),
    ("def f():\n    from worker_server import WorkerServer", "monitor.cli",
     ["monitor.cli imports worker_server"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trainer.loop",
     "monitor.app", ["monitor.app imports trainer.loop"]),
    ("from monitor.evidence import view", "http_serving.wsgi",
     ["http_serving.wsgi imports monitor.evidence.view"]),
    ("import monitor.view", "lightkeeper.demo", []),
])
def test_the_rules_catch_a_violation(source, module, expected):
    known = set(project_modules())
    graph = {module: imported_modules(source, module, False, known)}
    assert violations(graph) == expected


# monitor's stages in the order the data flows: a module may import its own stage and the stages
# before it, never one after it. The base (config dataclasses, the SQLite store, the Flight
# Recorder engine that `lightkeeper analyze` also runs alone) is below every stage; the loop
# (service), what it plans and polls from the last sweep (schedule, polling), its start-up
# checks, sharding (its etcd leases) and the CLI wire them all. A subpackage names its modules;
# each top-level module is named itself: a new one has no stage until it is given one.
MONITOR_STAGES: list[tuple[str, ...]] = [
    ("monitor.config", "monitor.locks", "monitor.store", "monitor.store_goodput",
     "monitor.store_hosts", "monitor.analysis"),
    ("monitor.poll",),
    ("monitor.evidence",),
    ("monitor.detect",),
    ("monitor.act",),
    ("monitor.goodput",),
    ("monitor.api",),
    ("monitor", "monitor.schedule", "monitor.polling", "monitor.startup", "monitor.lease",
     "monitor.shard_leader", "monitor.shard_proposals", "monitor.shard", "monitor.service",
     "monitor.cli"),
]


def stage_of(module: str) -> int | None:
    best = None
    for i, prefixes in enumerate(MONITOR_STAGES):
        for p in prefixes:
            within = p != "monitor" and module.startswith(p + ".")  # monitor: the package alone
            if (module == p or within) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return best[0] if best else None


def stage_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, imports in sorted(graph.items()):
        here = stage_of(mod) if mod.startswith("monitor") else None
        if here is None:
            continue
        for imp in sorted(imports):
            there = stage_of(imp) if imp.startswith("monitor") else None
            if there is not None and there > here:
                out.append(f"{mod} imports {imp}")
    return out


def test_every_monitor_module_has_a_stage():
    missing = [m for m in import_graph() if m.startswith("monitor") and stage_of(m) is None]
    assert missing == []
    # a new top-level module, or a new subpackage, has none until MONITOR_STAGES gives it one
    assert stage_of("monitor.new_module") is None and stage_of("monitor.new_stage.x") is None
    assert stage_of("monitor.poll.new_module") == 1
    assert all(stage_of(m) != len(MONITOR_STAGES) - 1 or m.count(".") <= 1
               for m in import_graph() if m.startswith("monitor"))


def test_monitor_stages_import_only_earlier_stages():
    assert stage_violations(import_graph()) == []


def test_the_stage_check_catches_a_backward_import():
    known = set(project_modules())
    graph = {"monitor.poll.poller": imported_modules("from ..detect import detectors",
                                                     "monitor.poll.poller", False, known),
             "monitor.detect.detectors": imported_modules("from ..poll import poller",
                                                          "monitor.detect.detectors", False,
                                                          known)}
    assert stage_violations(graph) == ["monitor.poll.poller imports monitor.detect.detectors"]


def test_the_cycle_check_catches_a_cycle():
    known = {"monitor.app", "monitor.service", "monitor.view"}
    graph = {
        "monitor.app": imported_modules("from typing import TYPE_CHECKING\n"
                                        "if TYPE_CHECKING:\n    from .service import Monitor",
                                        "monitor.app", False, known),
        "monitor.service": imported_modules("from .app import create_app\nfrom . import view",
                                            "monitor.service", False, known),
        "monitor.view": set(),
    }
    assert cycles(graph, "monitor") == [["monitor.app", "monitor.service", "monitor.app"]]
