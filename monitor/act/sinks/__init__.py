"""Sinks: what carries out a host quarantine or release that :mod:`monitor.act.hosts` decided.

Every sink has ``quarantine(event)`` and ``release(event)``, one attempt each, returning an
:class:`ActionResult` and never raising; ``event`` is the JSON of docs/quarantine.md (Actions).
``--action`` (repeatable) picks them: ``k8s``, ``slurm``, ``exec:CMD``, ``webhook:URL``.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess

from http_serving import is_http_url
from monitor.config import QuarantineConfig, shown_action

from .base import ActionResult, Sink, SinkConfigError

__all__ = ["ACTION_FORMS", "ActionResult", "Sink", "SinkConfigError", "build_sink",
           "validate_action"]

ACTION_FORMS = "k8s, slurm, exec:CMD or webhook:URL"

log = logging.getLogger(__name__)


def validate_action(spec: str) -> None:
    """SinkConfigError when ``spec`` is not one of ACTION_FORMS (nothing built)."""
    kind, _, arg = spec.partition(":")
    if spec in ("k8s", "kubernetes", "slurm"):
        return
    if kind == "exec" and arg.strip():
        try:
            if not shlex.split(arg):
                raise SinkConfigError(f"--action {shown_action(spec)!r}: empty command")
        except ValueError as e:
            raise SinkConfigError(f"--action {shown_action(spec)!r}: {e}") from None
        return
    if kind == "webhook" and is_http_url(arg):
        return
    raise SinkConfigError(f"--action {shown_action(spec)!r}: expected {ACTION_FORMS}")


def build_sink(spec: str, q: QuarantineConfig | None = None) -> Sink:
    """The sink an ``--action`` names, with ``q``'s timeout, webhook secret and Kubernetes
    settings. SinkConfigError: a bad spec, a program (``scontrol``, an exec hook's) that is not
    an executable on PATH, a ``scontrol`` that cannot read Slurm's configuration, or for
    ``k8s`` no lightkube or no cluster configuration."""
    validate_action(spec)
    q = q or QuarantineConfig()
    kind, _, arg = spec.partition(":")
    if spec in ("k8s", "kubernetes"):
        from .kubernetes import KubernetesSink
        return KubernetesSink.from_env(q.k8s_namespace, q.k8s_pod_selector, q.action_timeout_s)
    from .hooks import SCONTROL, ExecSink, SlurmSink, WebhookSink
    if kind in ("slurm", "exec"):  # said at start-up, not at the first quarantine days later
        program = SCONTROL if spec == "slurm" else shlex.split(arg)[0]
        if shutil.which(program) is None:
            raise SinkConfigError(f"--action {shown_action(spec)!r}: {program!r} is not an "
                                  "executable on PATH")
    if spec == "slurm":
        _check_slurm_config(SCONTROL, q.action_timeout_s)
        return SlurmSink(timeout_s=q.action_timeout_s)
    if kind == "exec":
        return ExecSink(arg, timeout_s=q.action_timeout_s)
    return WebhookSink(arg, secret=q.webhook_secret, timeout_s=q.action_timeout_s)


def _check_slurm_config(scontrol: str, timeout_s: float) -> None:
    """SinkConfigError when ``scontrol`` cannot read Slurm's configuration: every drain would
    fail so, retried for days. ``--version`` reads it and asks slurmctld nothing, so a
    controller down now stops nothing (configless Slurm's fetch of it from the controller
    failing included)."""
    conf = os.environ.get("SLURM_CONF")
    if conf is not None and not os.path.isfile(conf):  # scontrol would wait 60 s for it
        raise SinkConfigError(f"--action slurm: SLURM_CONF={conf} is not a file")
    try:
        r = subprocess.run([scontrol, "--version"], capture_output=True, text=True,
                           timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        log.warning("--action slurm: %s --version did not finish within %gs: Slurm's "
                    "configuration not checked", scontrol, timeout_s)
        return
    except OSError as e:
        raise SinkConfigError(f"--action slurm: cannot run {scontrol!r}: {e}") from None
    if r.returncode != 0 and "failed to fetch remote configs" not in r.stderr:
        said = " ".join(r.stderr.strip().splitlines()[-2:])[-300:]
        raise SinkConfigError(f"--action slurm: scontrol cannot read Slurm's configuration "
                              f"(set SLURM_CONF?): {said or f'exited {r.returncode}'}")
