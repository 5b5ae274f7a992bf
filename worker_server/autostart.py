"""Zero-code instrumentation: a WorkerServer for every torchft ``Manager`` a process creates.

``lightkeeper run -- <command>`` (see docs/run.md) starts the command with
``LIGHTKEEPER_AUTOSTART=1`` and :data:`SITE_DIR` first on ``PYTHONPATH``; Python then runs that
directory's ``sitecustomize.py``, which calls :func:`install_if_enabled`. A container whose
command line is fixed sets ``LIGHTKEEPER_AUTOSTART=1`` and loads the hook through the
``lightkeeper-autostart.pth`` file a wheel install puts in site-packages (a no-op without the
variable), or by putting :data:`SITE_DIR` on ``PYTHONPATH`` itself.

The hook is this module's stable interface (TorchTitan and other integrations rely on it):

- :func:`install` adds an import hook (a ``sys.meta_path`` finder) that does nothing until the
  module ``torchft.manager`` is loaded, then wraps ``torchft.manager.Manager.__init__``. Nothing
  here imports torch or torchft: a process that never imports torchft serves nothing (DCP's
  saves, wrapped when imported, only pass the call on there).
- After a ``Manager`` is constructed, :func:`on_manager` starts one WorkerServer for the process
  (identity below) and instruments that Manager, as ``WorkerServer.start(manager)`` would. A
  second Manager in the same process is attached to the same server.
- Identity comes from the Manager and the environment torchrun and torchft set:
  ``group_rank`` and ``group_world_size`` from the Manager (its ``rank``/``world_size`` or
  ``RANK``/``WORLD_SIZE``); the replica group from ``REPLICA_GROUP_ID``, else from the trailing
  digits of the ``replica_id`` given to the Manager (torchft's own convention for its global rank;
  TorchTitan passes ``torchtitan_ft_<replica_id>``), else 0 with a line saying so; the Lighthouse
  from the Manager's ``lighthouse_addr`` or ``TORCHFT_LIGHTHOUSE``; the job from
  ``LIGHTKEEPER_JOB``. ``LIGHTKEEPER_WORKER_HOST`` binds (default 127.0.0.1);
  ``LIGHTKEEPER_WORKER_PORT`` (default 0: ephemeral) is offset by ``LOCAL_RANK`` so the ranks of
  one node do not collide. ``LIGHTKEEPER_MONITOR`` registers the rank with a monitor.
- torchft 0.2.x's ``DistributedDataParallel`` fails its comm hook (``assert fut._fut``) when the
  all-reduce fails, so a lost peer ends this rank too; its first construction with that hook
  (:func:`patch_ddp`) says so in one line (docs/run.md, Limits with torchft 0.2.0).
- A process that already serves an explicit WorkerServer (the two-line API called before the
  Manager existed, as ``lightkeeper train`` does) is left to it; an explicit
  ``WorkerServer.start(manager)`` after the hook started one returns the hook's server.

Failures: the job never fails because of Lightkeeper. Anything that goes wrong in the hook
(port taken, ``worker_server``'s dependencies missing) writes one ``[lightkeeper] ...`` line to
stderr and training goes on unobserved; a torchft whose ``Manager`` looks different gets what can
be instrumented and one line naming the rest (:mod:`worker_server.instrument`).
"""

from __future__ import annotations

import _thread
import os
import sys

# loaded at every interpreter start (every DataLoader worker, every tool): stdlib's typing,
# re and pathlib cost a fresh interpreter about 12 ms, so they are imported only where used
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ENV_AUTOSTART = "LIGHTKEEPER_AUTOSTART"
TARGET_MODULE = "torchft.manager"
SAVER = "torch.distributed.checkpoint.state_dict_saver"
DDP = "torchft.ddp"
_MARK = "_lightkeeper_autostart_wrapped"

_lock = _thread.allocate_lock()
_server: Any = None  # the WorkerServer this hook started in this process
_ddp_checked = False  # torchft's DDP hook was checked in this process (once: it reads metadata)


def __getattr__(name: str):
    if name == "SITE_DIR":  # the directory lightkeeper run puts first on PYTHONPATH
        from pathlib import Path

        return Path(__file__).resolve().parent / "autostart_site"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def enabled(env: dict[str, str] | None = None, name: str = ENV_AUTOSTART) -> bool:
    """``name`` (``LIGHTKEEPER_AUTOSTART``) is set to 1/true/yes/on."""
    value = (os.environ if env is None else env).get(name, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def say(message: str) -> None:
    """One line on stderr, the hook's only way to speak (logging may not be configured)."""
    try:
        sys.stderr.write(f"[lightkeeper] {message}\n")
        sys.stderr.flush()
    except Exception:
        pass


def torchft_missing() -> str | None:
    """One line when this Python cannot import torchft, else None (nothing is imported)."""
    import importlib.util

    if importlib.util.find_spec("torchft") is not None:
        return None
    return (f"torchft is not installed in {sys.executable}: install torchft 0.2.x or "
            "torchft-nightly into the job's environment (lightkeeper[worker] does not)")


def install_if_enabled() -> bool:
    """:func:`install` when ``LIGHTKEEPER_AUTOSTART`` is on; returns whether it did."""
    if not enabled():
        return False
    install()
    if enabled(name="LIGHTKEEPER_PLANNED_STOPS"):  # else not even signal's import (5 ms)
        from .stop_signal import arm_from_env

        arm_from_env()
    return True


def install() -> None:
    """Wrap ``torchft.manager.Manager.__init__`` now if torchft is imported, else when it is;
    and DCP's saves when they are imported (a pass-through until a Manager is served), so a
    name bound before the Manager exists (``from torch.distributed.checkpoint import save``)
    marks its saves too."""
    if SAVER not in sys.modules:
        hook_import(SAVER, _patch_saver)
    ddp = sys.modules.get(DDP)
    if ddp is None:
        hook_import(DDP, patch_ddp)
    else:
        patch_ddp(ddp)
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        patch_module(module)
        return
    hook_import(TARGET_MODULE, patch_module, ManagerFinder)


def _patch_saver(module: Any) -> bool:
    from .checkpoint import patch

    return patch(module)


def hook_import(name: str, patch, finder: type | None = None) -> None:
    """Call ``patch(module)`` right after module ``name`` is first imported (once hooked)."""
    if not any(isinstance(f, ImportPatcher) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, (finder or ImportPatcher)(name, patch))


class ImportPatcher:  # a sys.meta_path finder (importlib.abc costs 10 ms to import)
    """Finds nothing itself: when module ``name`` is imported it asks the other finders for it
    and wraps the loader so the module is patched right after it runs."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = PatchingLoader(spec.loader, self.patch)
                return spec
        return None


class ManagerFinder(ImportPatcher):
    """The hook on ``torchft.manager`` (:func:`install`)."""


class PatchingLoader:
    """Delegates to the module's own loader, then patches the module it executed."""

    def __init__(self, loader, patch) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and tools
        return getattr(self._loader, name)


def patch_module(module: Any) -> bool:
    """Wrap ``module.Manager.__init__``; returns whether it is wrapped (idempotent)."""
    try:
        cls = module.Manager
        original = cls.__init__
        if getattr(original, _MARK, False):
            return True

        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            on_manager(self, kwargs)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        __init__.__doc__ = original.__doc__
        setattr(__init__, _MARK, True)
        cls.__init__ = __init__
        return True
    except Exception as e:
        say(f"autostart: cannot hook torchft's Manager ({type(e).__name__}: {e}); "
            "training goes on without a WorkerServer")
        return False


def patch_ddp(module: Any) -> bool:
    """Wrap ``torchft.ddp.DistributedDataParallel.__init__``: once constructed, check whether
    it uses torchft 0.2.x's comm hook (:func:`check_ddp`). Never says anything itself."""
    try:
        cls = module.DistributedDataParallel
        original, hook = cls.__init__, getattr(cls, "_comm_hook", None)
        if getattr(original, _MARK, False):
            return True

        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            check_ddp(type(self), hook)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        __init__.__doc__ = original.__doc__
        setattr(__init__, _MARK, True)
        cls.__init__ = __init__
        return True
    except Exception:  # a torchft whose DDP looks different: nothing to warn about
        return False


def check_ddp(cls: type, hook: Any) -> None:
    """One line, once per process, when a DDP of class ``cls`` uses ``hook`` (torchft's own
    ``_comm_hook``, not a subclass's or a patched one) and the imported torchft is 0.2.x."""
    global _ddp_checked
    try:
        if _ddp_checked or hook is None or getattr(cls, "_comm_hook", None) is not hook:
            return
        _ddp_checked = True
        from .state import module_version

        version = module_version("torchft")  # nightly beside 0.2.0 reads as nightly
        # "0.2.0|2026.10.26" (a mixed install) or "unknown": which hook runs is not known
        if all(v.startswith("0.2.") for v in version.split("|")):
            say(f"torchft {version}'s DistributedDataParallel: a lost peer (a crash, a stopped "
                "or evicted group, /v1/abort) fails its comm hook's assert and ends this rank "
                "too; use torchft-nightly, or Manager.allreduce for the gradients (docs/run.md, "
                "Limits with torchft 0.2.0)")
    except Exception:
        pass


def replica_group_of(manager: Any, env: dict[str, str] | None = None) -> tuple[int, str]:
    """(replica group, where it came from): ``REPLICA_GROUP_ID``, else the trailing digits of
    the Manager's ``replica_id``, else (0, "default")."""
    env = os.environ if env is None else env
    raw = env.get("REPLICA_GROUP_ID", "").strip()
    if raw:
        if raw.isascii() and raw.isdigit():
            return int(raw), "REPLICA_GROUP_ID"
        say(f"REPLICA_GROUP_ID={raw!r} is not a replica group (an integer >= 0): ignored")
    import re

    m = re.search(r"(\d+)$", str(getattr(manager, "_replica_id", None) or ""))
    if m:
        return int(m.group(1)), "replica_id"
    return 0, "default"


def worker_port(env: dict[str, str] | None = None) -> int:
    """``LIGHTKEEPER_WORKER_PORT`` + ``LOCAL_RANK`` (0 stays 0: ephemeral)."""
    from .server import port_number

    env = os.environ if env is None else env
    base = port_number(env.get("LIGHTKEEPER_WORKER_PORT") or 0, "LIGHTKEEPER_WORKER_PORT")
    if not base:
        return 0
    from .state import env_local_rank

    return port_number(base + env_local_rank(env), "LIGHTKEEPER_WORKER_PORT + LOCAL_RANK")


def on_manager(manager: Any, kwargs: dict[str, Any] | None = None) -> Any:
    """Serve ``manager``'s rank (see the module doc); returns the server or None. Never raises."""
    global _server
    try:
        from .server import WorkerServer, serving

        with _lock:
            if _server is not None:
                _server.attach(manager)
                manager._lightkeeper_server = _server
                return _server
            if any(not getattr(s, "autostarted", False) for s in serving()):
                return None  # the process's own explicit WorkerServer decides what to attach
            group, source = replica_group_of(manager)
            if source == "default":
                say("autostart: no REPLICA_GROUP_ID and no digits in the Manager's replica_id: "
                    "reporting replica group 0")
            env = os.environ
            server = WorkerServer.start(
                manager,
                replica_group=group,
                group_rank=int(getattr(manager, "_group_rank", env.get("RANK", 0))),
                group_world_size=int(getattr(manager, "_group_world_size",
                                             env.get("WORLD_SIZE", 1))),
                lighthouse=(kwargs or {}).get("lighthouse_addr") or env.get("TORCHFT_LIGHTHOUSE"),
                port=worker_port(),
            )
            server.autostarted = True
            manager._lightkeeper_server = server
            _server = server
            finish_at_clean_exit(server)
        ident = server.state.identity
        say(f"replica_group={ident.replica_group} group_rank={ident.group_rank} "
            f"worker_server={server.url} (lightkeeper run)")
        stops = sys.modules.get(f"{__package__}.stop_signal")
        if getattr(stops, "unarmed_no_rank", False) and not stops._armed:
            say("--planned-stops: not armed in this rank, which had neither RANK nor LOCAL_RANK "
                "set when it started: SIGTERM ends it unsaid (start it with RANK set)")
        return server
    except BaseException as e:  # the job must never fail because of the hook
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        say(f"WorkerServer not started ({type(e).__name__}: {e}); training goes on "
            "without it")
        return None


def finish_at_clean_exit(server: Any) -> None:
    """At a normal interpreter exit, say the rank finished (``server.finish()``, so a monitor
    counts it ended, not dead), unless the process ends by an error: an uncaught exception
    (Python sets ``sys.last_type`` before exit handlers run), one in a thread
    (``threading.excepthook``), or a non-zero ``sys.exit()``. A ``raise SystemExit(1)`` written
    as such is not seen (Python 3.11 keeps no exit status); a kill or ``os._exit`` runs nothing."""
    import atexit
    import threading

    pid, seen = os.getpid(), {"status": None, "thread_error": False}
    original_exit, original_hook = sys.exit, threading.excepthook

    def exit(*args):
        seen["status"] = args[0] if args else None
        original_exit(*args)

    def excepthook(args):
        if not issubclass(args.exc_type, SystemExit):
            seen["thread_error"] = True
        original_hook(args)

    def at_exit() -> None:
        from .server import serving

        if (os.getpid() != pid or server not in serving() or server.state.finished
                or getattr(sys, "last_type", None) is not None or seen["thread_error"]
                or seen["status"] not in (None, 0)):
            return  # a fork's child, stopped, said already, or an error: found dead
        try:
            server.finish()
        except Exception as e:
            say(f"could not say this rank finished ({type(e).__name__}: {e})")

    exit.__doc__ = original_exit.__doc__
    sys.exit, threading.excepthook = exit, excepthook
    atexit.register(at_exit)


def started_server() -> Any:
    """The WorkerServer this hook started in this process, or None."""
    return _server


if __name__ == "__main__":  # python -m worker_server.autostart: where the hook lives
    print(__getattr__("SITE_DIR"))
