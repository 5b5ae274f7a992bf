"""Upload the generated dashboards to a Grafana server through its HTTP API (``grafana-client``).

Idempotent: the folder is looked up by uid (created when missing) and every dashboard is saved
with ``overwrite: true`` under its fixed uid, so uploading again replaces it in place. Errors
(bad or missing token, Grafana unreachable, API refusals) become :class:`UploadError` with a
message a person can act on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .build import GENERATED_DIR

TOKEN_ENV = "GRAFANA_TOKEN"
DEFAULT_FOLDER = "Lightkeeper"
DEFAULT_FOLDER_UID = "lightkeeper"


class UploadError(RuntimeError):
    """The upload failed; the message says why and what to check."""


@dataclass
class Uploaded:
    uid: str
    title: str
    url: str
    version: int | None


def load_dashboards(directory: Path = GENERATED_DIR) -> list[dict]:
    files = sorted(Path(directory).glob("*.json"))
    if not files:
        raise UploadError(f"no dashboards in {directory}: run `lightkeeper dashboards build`")
    return [json.loads(f.read_text()) for f in files]


def _api(url: str, token: str, timeout: float):
    from grafana_client import GrafanaApi

    return GrafanaApi.from_url(url.rstrip("/"), credential=token, timeout=timeout)


def _describe(e: Exception, url: str) -> str:
    from grafana_client.client import (
        GrafanaClientError,
        GrafanaException,
        GrafanaServerError,
        GrafanaTimeoutError,
        GrafanaUnauthorizedError,
    )

    if isinstance(e, GrafanaUnauthorizedError):
        return (f"Grafana at {url} rejected the token (401 Unauthorized): check ${TOKEN_ENV} "
                "(a service account token with the Editor role)")
    if isinstance(e, GrafanaClientError) and e.status_code == 403:
        return (f"Grafana at {url} refused the request (403 Forbidden): the token's service "
                "account needs permission to create folders and dashboards (Editor role)")
    if isinstance(e, GrafanaTimeoutError):
        return f"Grafana at {url} did not answer in time: {e.message}"
    if isinstance(e, (GrafanaClientError, GrafanaServerError)):
        return f"Grafana at {url} answered with an error: {e.message}"
    if isinstance(e, GrafanaException):
        return f"cannot talk to Grafana at {url}: {e.message}"
    if isinstance(e, (KeyError, TypeError, ValueError)):
        return f"unexpected answer from {url} (is it a Grafana?): {e!r}"
    return f"cannot reach Grafana at {url}: {e}"


def _errors() -> tuple[type[BaseException], ...]:
    """What a failed API call can raise: grafana_client's errors, the HTTP library's (e.g.
    connection refused, which grafana_client lets through), and a malformed answer."""
    import niquests
    from grafana_client.client import GrafanaException

    return (GrafanaException, niquests.exceptions.RequestException, KeyError, TypeError,
            ValueError)


def _ensure_folder(api, title: str, uid: str) -> str:
    from grafana_client.client import GrafanaClientError

    try:
        folder = api.folder.get_folder(uid)
        return folder["uid"]
    except GrafanaClientError as e:
        if e.status_code != 404:
            raise
    folder = api.folder.create_folder(title, uid=uid)
    return folder["uid"]


def upload(url: str, token: str | None, *, folder: str = DEFAULT_FOLDER,
           folder_uid: str = DEFAULT_FOLDER_UID, dashboards: list[dict] | None = None,
           timeout: float = 10.0, message: str = "lightkeeper dashboards upload"
           ) -> list[Uploaded]:
    """Create/overwrite every dashboard in ``folder`` on the Grafana at ``url``."""
    if not token:
        raise UploadError(f"no Grafana token: set ${TOKEN_ENV} to a service account token "
                          "(Administration > Users and access > Service accounts)")
    if not url.startswith(("http://", "https://")):
        raise UploadError(f"--grafana-url must be http(s)://host[:port][/path], got {url!r}")
    dashboards = dashboards if dashboards is not None else load_dashboards()
    api = _api(url, token, timeout)
    done: list[Uploaded] = []
    try:
        fuid = _ensure_folder(api, folder, folder_uid)
        for d in dashboards:
            body = {**d, "id": None}
            r = api.dashboard.update_dashboard({"dashboard": body, "folderUid": fuid,
                                                "overwrite": True, "message": message})
            done.append(Uploaded(d["uid"], d.get("title", ""), str(r.get("url", "")),
                                 r.get("version")))
    except _errors() as e:
        raise UploadError(_describe(e, url)) from e
    return done
