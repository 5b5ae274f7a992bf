"""Upload the generated dashboards to a Grafana server through its HTTP API (``grafana-client``).

Idempotent: the folder is looked up by uid (created when missing) and every dashboard is saved
with ``overwrite: true`` under its fixed uid, so uploading again replaces it in place. Errors
(bad or missing token, Grafana unreachable, API refusals) become :class:`UploadError` with a
message a person can act on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

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
    """The dashboards in ``directory``; every file is checked before any is uploaded."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise UploadError(f"{directory}: {what}")
    files = sorted(directory.glob("*.json"))
    if not files:
        raise UploadError(f"no dashboards in {directory}: run `lightkeeper dashboards build`")
    dashboards, seen = [], {}
    for f in files:
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UploadError(f"{f}: not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise UploadError(f"{f}: not valid JSON: {e}") from None
        except OSError as e:
            raise UploadError(f"{f}: cannot read it: {e.strerror}") from None
        # without a uid Grafana makes up a new one on every upload: a duplicate each time
        if not (isinstance(d, dict) and all(isinstance(d.get(k), str) and d[k].strip()
                                            for k in ("uid", "title"))):
            raise UploadError(f'{f}: not a dashboard: a JSON object with a non-empty "uid" '
                              'and "title" is needed')
        if d["uid"] in seen:  # the second would replace the first in Grafana, unsaid
            raise UploadError(f"{f}: uid {d['uid']!r} is also {seen[d['uid']]}'s: each "
                              "dashboard needs a uid of its own")
        seen[d["uid"]] = f
        dashboards.append(d)
    return dashboards


_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)@")


def redact(text: str, url: str, token: str = "") -> str:
    """``text`` with the token and the user:password of ``url`` replaced by ``***``."""
    userinfo = _USERINFO.match(url)
    for secret in (token, userinfo and userinfo.group(1)):
        if secret:
            text = text.replace(secret, "***")
    return text


def check_url(url: str) -> str:
    """``url`` if Grafana can be reached at it (http(s), a host, a valid port), else a
    ValueError whose message shows the URL without its credentials."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
    except ValueError as e:
        raise ValueError(redact(f"{url!r} is not a valid URL: {e}", url)) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(redact(f"must be http(s)://host[:port][/path], got {url!r}", url))
    return url


def _api(url: str, token: str, timeout: float):
    try:
        from grafana_client import GrafanaApi
    except ImportError as e:  # an extra, kept out of ranks' environments (docs/install.md)
        raise UploadError(f"dashboards upload needs grafana-client ({e}): "
                          "pip install 'lightkeeper[grafana]'") from None

    # grafana_client puts "api" right after the path: a sub-path must end in "/"
    parts = urlsplit(url)
    url = parts._replace(path=parts.path.rstrip("/") + "/").geturl()
    return GrafanaApi.from_url(url, credential=token, timeout=timeout)


def _describe(e: Exception, url: str, token_env: str) -> str:
    from grafana_client.client import (
        GrafanaClientError,
        GrafanaException,
        GrafanaServerError,
        GrafanaTimeoutError,
        GrafanaUnauthorizedError,
    )

    if isinstance(e, GrafanaUnauthorizedError):
        return (f"Grafana at {url} rejected the token (401 Unauthorized): check ${token_env} "
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
           timeout: float = 10.0, message: str = "lightkeeper dashboards upload",
           token_env: str = TOKEN_ENV) -> list[Uploaded]:
    """Create/overwrite every dashboard in ``folder`` on the Grafana at ``url``; ``token``
    was read from ``$token_env`` (named in the messages)."""
    token = (token or "").strip()  # a Secret made --from-file ends in a newline
    if not token:
        raise UploadError(f"no Grafana token: set ${token_env} to a service account token "
                          "(Administration > Users and access > Service accounts)")
    if not (token.isascii() and token.isprintable()):
        raise UploadError(f"${token_env} holds a control or non-ASCII character, which no "
                          "token has (its value is not shown)")
    try:
        check_url(url)
    except ValueError as e:
        raise UploadError(f"--grafana-url {e}") from None
    dashboards = dashboards if dashboards is not None else load_dashboards()
    api = _api(url, token, timeout)
    done: list[Uploaded] = []
    d = None
    try:
        fuid = _ensure_folder(api, folder, folder_uid)
        for d in dashboards:
            body = {**d, "id": None}
            r = api.dashboard.update_dashboard({"dashboard": body, "folderUid": fuid,
                                                "overwrite": True, "message": message})
            done.append(Uploaded(d["uid"], d.get("title", ""), str(r.get("url", "")),
                                 r.get("version")))
    except _errors() as e:
        said = redact(_describe(e, url, token_env), url, token)
        if d is not None:  # which one, and what Grafana holds already
            said = (f"dashboard {d['uid']!r} ({d.get('title', '')}): {said}"
                    + (f" (uploaded before it: {', '.join(u.uid for u in done)})" if done else ""))
        raise UploadError(said) from e
    return done
