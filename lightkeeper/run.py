"""``lightkeeper run -- <command>``: run a torchft job with a WorkerServer on every rank, no code
change (docs/run.md).

It replaces itself (``exec``) with the command, in an environment where every Python process
the command starts (torchrun's workers included) loads :mod:`worker_server.autostart`'s hook:
``LIGHTKEEPER_AUTOSTART=1`` and the hook's directory first on ``PYTHONPATH``. Signals reach the
command directly and its exit status is the command's own. A command that is not found exits
127 with one line, as a shell would.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import sys

from http_serving import is_monitor_url, redact_entry, redact_url, url_list
from worker_server.autostart import ENV_AUTOSTART, SITE_DIR, torchft_missing
from worker_server.timing import cuda_timing_mode

FR_BUFFER_DEFAULT = "2000"  # Flight Recorder entries kept per process unless the job sets its own
TOKEN_ENV = "LIGHTKEEPER_REGISTER_TOKEN"
_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "lightkeeper run [options] -- COMMAND [ARG ...]"
    p.add_argument("--monitor", metavar="URL", default=None,
                   help="register every rank with this monitor (env LIGHTKEEPER_MONITOR)")
    p.add_argument("--register-token", "--token", dest="register_token", default=None,
                   help="the monitor's registration token; better in env "
                        "LIGHTKEEPER_REGISTER_TOKEN: a flag is shown to every user of this host "
                        "(ps); --token is its old name")
    p.add_argument("--job", default=None, help="job name in labels and state (env LIGHTKEEPER_JOB)")
    p.add_argument("--worker-host", default=None,
                   help="address the WorkerServers bind (env LIGHTKEEPER_WORKER_HOST; "
                        "default 127.0.0.1); lightkeeper train binds torchft's servers there too")
    p.add_argument("--worker-port", type=int, default=None,
                   help="first WorkerServer port, + LOCAL_RANK per rank (env "
                        "LIGHTKEEPER_WORKER_PORT; default 0: ephemeral)")
    p.add_argument("--worker-server", choices=("flask", "torch"), default=None,
                   help="flask: Lightkeeper's own server (the default); torch: the read-only "
                        "endpoints as handlers on torch's own per-rank server, one port per rank "
                        "(torch 2.10+, else flask with one line; env LIGHTKEEPER_WORKER_SERVER)")
    p.add_argument("--planned-stops", action="store_true",
                   help="a rank sent SIGTERM (a rolling restart) says it stopped before it goes, "
                        "so a monitor does not count it dead (env LIGHTKEEPER_PLANNED_STOPS=1; "
                        "docs/run.md)")
    p.add_argument("--print-env", action="store_true",
                   help="print the variables that turn the hook on (for a container spec; "
                        "never the token) and exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the command to run, after --")


def hook_env(args: argparse.Namespace, base: dict[str, str]) -> dict[str, str]:
    """The variables ``run`` adds to ``base`` (only those)."""
    out = {ENV_AUTOSTART: "1"}
    path = base.get("PYTHONPATH", "")
    # an empty entry is the current directory (":/opt/x"), kept; none given adds none
    parts = [p for p in path.split(os.pathsep) if p != str(SITE_DIR)] if path else []
    out["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR), *parts])
    for value, name in ((args.monitor, "LIGHTKEEPER_MONITOR"),
                        (args.register_token, TOKEN_ENV),
                        (args.job, "LIGHTKEEPER_JOB"), (args.worker_host, "LIGHTKEEPER_WORKER_HOST"),
                        (args.worker_port, "LIGHTKEEPER_WORKER_PORT"),
                        (getattr(args, "worker_server", None), "LIGHTKEEPER_WORKER_SERVER")):
        if value is not None:
            out[name] = str(value)
    if args.planned_stops:
        out["LIGHTKEEPER_PLANNED_STOPS"] = "1"
    if "TORCH_FR_BUFFER_SIZE" not in base and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in base:
        out["TORCH_FR_BUFFER_SIZE"] = FR_BUFFER_DEFAULT  # Flight Recorder is off at size 0
    return out


def secret_flags(args: argparse.Namespace) -> dict[str, str]:
    """The flags given that hold a secret, each with the variable to give it in instead."""
    out = {"--register-token": TOKEN_ENV} if args.register_token is not None else {}
    if args.monitor and redact_url(args.monitor) != args.monitor:
        out["--monitor's password"] = "LIGHTKEEPER_MONITOR"
    return out


def bad_worker_host(flag: str | None, env: str | None) -> str | None:
    """Why every rank would refuse to bind the worker host given (``--worker-host`` or
    ``LIGHTKEEPER_WORKER_HOST``; ``host:port``, as the Lighthouse's ``--bind`` takes, is one),
    naming where it came from; None when it is an address or a host name."""
    value, name = (flag, "--worker-host") if flag is not None else (env, "LIGHTKEEPER_WORKER_HOST")
    if not value or _HOST_NAME.match(value):
        return None
    try:
        ipaddress.ip_address(value.removeprefix("[").removesuffix("]"))
        return None
    except ValueError:
        return f"{name} {value!r} is not an address or host name (the port is --worker-port)"


def bad_monitor_url(flag: str | None, env: str | None) -> str | None:
    """Why the monitor URL(s) given (``--monitor`` or ``LIGHTKEEPER_MONITOR``, comma-separated,
    blanks skipped) cannot be registered with, naming where it came from; None when they can.
    A list of blanks alone (``--monitor "$A,$B"`` with both unset) is refused: every rank would
    train unmonitored, though a monitor was meant."""
    value, name = (flag, "--monitor") if flag is not None else (env, "LIGHTKEEPER_MONITOR")
    urls = url_list(value)  # as the ranks read it
    if urls is None:
        return f"{name} {value!r} names no monitor URL"
    for url in urls:
        if not is_monitor_url(url):
            return f"{name} {redact_entry(url)!r} is not an http(s)://host:port URL"
    return None


def run(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    # the job's variables too: else every rank says so in a line and trains unobserved
    port, name = ((args.worker_port, "--worker-port") if args.worker_port is not None
                  else (os.environ.get("LIGHTKEEPER_WORKER_PORT") or "0", "LIGHTKEEPER_WORKER_PORT"))
    digits = str(port).strip()
    if not (digits.isascii() and digits.isdigit()) or int(digits) > 65535:  # "²" is a digit
        sys.stderr.write(f"lightkeeper run: {name} {port!r} is not a port (0-65535)\n")
        return 2
    try:  # each rank's step timer would refuse it, and its WorkerServer with it
        cuda_timing_mode()
    except ValueError as e:
        sys.stderr.write(f"lightkeeper run: {e}\n")
        return 2
    kind = args.worker_server or os.environ.get("LIGHTKEEPER_WORKER_SERVER") or "flask"
    if kind.strip().lower() not in ("flask", "torch"):
        sys.stderr.write(f"lightkeeper run: LIGHTKEEPER_WORKER_SERVER={kind!r} is not flask or "
                         "torch\n")
        return 2
    bad = bad_monitor_url(args.monitor, os.environ.get("LIGHTKEEPER_MONITOR"))
    if not args.print_env:  # a container spec may say --worker-host '$(POD_IP)'
        bad = bad or bad_worker_host(args.worker_host, os.environ.get("LIGHTKEEPER_WORKER_HOST"))
    if bad:
        sys.stderr.write(f"lightkeeper run: {bad}\n")
        return 2
    added = hook_env(args, dict(os.environ))
    secret = secret_flags(args)
    if args.print_env:  # a container spec is shared and kept: a secret comes from a secret
        for name, value in added.items():
            if name not in secret.values():
                print(f"{name}={value}")
        for name in secret.values():
            sys.stderr.write(f"lightkeeper run: {name} not printed: set it from a secret "
                             "(Kubernetes: valueFrom.secretKeyRef, docs/kubernetes.md)\n")
        return 0
    if not command:
        sys.stderr.write("lightkeeper run: no command: lightkeeper run [options] -- COMMAND "
                         "[ARG ...]\n")
        return 2
    # a path is run as it is (bash's way: an existing file that is not executable is 126)
    exe = command[0] if "/" in command[0] and os.path.exists(command[0]) \
        else shutil.which(command[0])
    if exe is None:
        sys.stderr.write(f"lightkeeper run: {command[0]}: command not found\n")
        return 127
    if secret:
        sys.stderr.write(f"lightkeeper run: {' and '.join(secret)} on the command line: every user "
                         f"of this host can read it (ps); set {' and '.join(secret.values())} "
                         "instead\n")
    missing = torchft_missing()  # the job may run another Python: a warning only
    if missing:
        sys.stderr.write(f"lightkeeper run: {missing}; a job on this Python is not observed\n")
    env = {**os.environ, **added}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(exe, command, env)
    except OSError as e:  # not executable, bad interpreter line...
        sys.stderr.write(f"lightkeeper run: {command[0]}: {e.strerror or e}\n")
        return 126
    return 0  # not reached
