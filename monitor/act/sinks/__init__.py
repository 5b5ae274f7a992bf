"""Sinks: what carries out a host quarantine or release that :mod:`monitor.act.hosts` decided.

The policy decides, a sink only carries out. Every sink has the same two calls,
``quarantine(event)`` and ``release(event)``, each one attempt that returns an
:class:`ActionResult` and never raises; the ledger retries a failed attempt with backoff
(bounded), records every attempt and shows the last one on ``GET /v1/hosts``.

``event`` is the JSON document an exec hook reads on stdin and a webhook receives::

    {"event": "quarantine" | "release", "host": ..., "node": ..., "devices": [...],
     "kind": ..., "reason": ..., "finding": {...} | null, "job": ..., "at": <unix>,
     "expires_at": <unix> | null, "action_id": N, "attempt": N}

Sinks, chosen with ``--action`` (repeatable): ``k8s`` (:mod:`monitor.act.sinks.kubernetes`),
``slurm`` (:mod:`monitor.act.sinks.slurm`), ``exec:CMD`` and ``webhook:URL``
(:mod:`monitor.act.sinks.hooks`). The Lighthouse kill of a replica group is the eviction's own
action (:mod:`monitor.act.actions`): it is decided per group by :mod:`monitor.act.decisions`, not per
host, and keeps its own path.
"""

from __future__ import annotations

from typing import Any

from .base import ActionResult, Sink, SinkConfigError

__all__ = ["ACTION_FORMS", "ActionResult", "Sink", "SinkConfigError", "build_sink",
           "validate_action"]

ACTION_FORMS = "k8s, slurm, exec:CMD or webhook:URL"


def validate_action(spec: str) -> None:
    """Raise SinkConfigError when ``spec`` is not one of :data:`ACTION_FORMS` (nothing built)."""
    kind, _, arg = spec.partition(":")
    if spec in ("k8s", "kubernetes", "slurm"):
        return
    if kind == "exec" and arg.strip():
        import shlex
        try:
            if not shlex.split(arg):
                raise SinkConfigError(f"--action {spec!r}: empty command")
        except ValueError as e:
            raise SinkConfigError(f"--action {spec!r}: {e}") from None
        return
    if kind == "webhook" and arg.startswith(("http://", "https://")):
        return
    raise SinkConfigError(f"--action {spec!r}: expected {ACTION_FORMS}")


def build_sink(spec: str, *, timeout_s: float = 10.0, webhook_secret: str | None = None,
               k8s_namespace: str | None = None, k8s_pod_selector: str | None = None,
               k8s_client: Any = None) -> Sink:
    """The sink an ``--action`` names. Raises SinkConfigError on a bad spec, and for ``k8s``
    when lightkube (``lightkeeper[kubernetes]``) is missing or no cluster configuration is found
    (in-cluster service account, ``KUBECONFIG`` or ``~/.kube/config``)."""
    validate_action(spec)
    kind, _, arg = spec.partition(":")
    if spec in ("k8s", "kubernetes"):
        from .kubernetes import KubernetesSink
        return KubernetesSink.from_env(namespace=k8s_namespace, pod_selector=k8s_pod_selector,
                                       timeout_s=timeout_s, client=k8s_client)
    if spec == "slurm":
        from .slurm import SlurmSink
        return SlurmSink(timeout_s=timeout_s)
    from .hooks import ExecSink, WebhookSink
    if kind == "exec":
        return ExecSink(arg, timeout_s=timeout_s)
    return WebhookSink(arg, secret=webhook_secret, timeout_s=timeout_s)
