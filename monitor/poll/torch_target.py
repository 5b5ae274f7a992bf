"""A rank on torch's own per-rank server, spelled ``torch+http://host:port``: a WorkerServer
started with ``server="torch"`` serves its read-only endpoints as handlers there. Such a target
is asked ``POST /handler/lightkeeper_state`` where another is asked ``GET /v1/state`` (and so on
for :data:`HANDLERS`), with the same query and the same bytes back.
"""

from __future__ import annotations

PREFIX = "torch+"
SCHEME = PREFIX + "http"
#: the WorkerServer's path -> its handler on torch's server
HANDLERS = {
    "/v1/state": "lightkeeper_state",
    "/v1/fr_trace": "lightkeeper_fr_trace",
    "/v1/stacks": "lightkeeper_stacks",
    "/metrics": "lightkeeper_metrics",
}


def is_torch(url: str) -> bool:
    """``url`` names a rank on torch's server (``torch+http://``)."""
    return url[:len(SCHEME) + 3].lower() == SCHEME + "://"


def base_url(url: str) -> str:
    """The ``http://`` address of torch's server behind a ``torch+http://`` target (a browser
    or ``curl`` reaches it there: ``POST {base}/handler/<name>``); other URLs unchanged."""
    return url[len(PREFIX):] if is_torch(url) else url


def torch_url(address: str) -> str:
    """The target spelling of torch's server at ``address`` (``http://h:p`` or ``h:p``)."""
    address = base_url(address.strip())
    return PREFIX + (address if "://" in address else "http://" + address)


def handler_path(path: str) -> str:
    """``/v1/fr_trace?last=5`` -> ``/handler/lightkeeper_fr_trace?last=5``; a path with no
    handler is returned unchanged."""
    base, sep, query = path.partition("?")
    name = HANDLERS.get(base)
    return f"/handler/{name}{sep}{query}" if name else path
