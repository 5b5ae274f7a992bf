"""``http://host:port`` for every kind of host, and back.

An IPv6 literal in a URL or a ``host:port`` address goes in brackets (RFC 3986: ``[::1]:9400``),
else its colons read as the port's: ``http://::1:9400`` is no URL, and a Kubernetes pod whose
``status.podIP`` is IPv6 would register an address no one can poll. A zone (``fe80::1%eth0``) is
written ``%25`` inside the brackets (RFC 6874). Names and IPv4 addresses are left as they are.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import unquote, urlsplit

__all__ = ["failure_reason", "host_for_url", "http_url", "is_http_url", "is_monitor_url",
           "redact_url", "split_host_port"]

# ``scheme://user:password@``, up to the authority's last ``@``: a password with a raw ``/``
# (base64) is no valid URL, but the message refusing it must not show it either
_PASSWORD = re.compile(r"(://[^/?#@\s\"]*):[^\s\"]*?@(?=[^@/?#\s\"]*(?:[/?#\s\"]|$))")
# ``scheme://TOKEN@``: a user name alone is how some services take a token
_USER_ONLY = re.compile(r"(://)[^/?#@\s\":]+@(?=[^@/?#\s\"]*(?:[/?#\s\"]|$))")
# ``?token=...``, ``&api_key=...``: a query parameter whose name says it holds a secret
_QUERY_SECRET = re.compile(r"([?&;][^=&#\s\"]*(?:token|secret|passw|pwd|key|sig|auth|credential)"
                           r"[^=&#\s\"]*=)[^&#\s\"]+", re.IGNORECASE)


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host.split("%", 1)[0]), ipaddress.IPv6Address)
    except ValueError:
        return False


def host_for_url(host: str) -> str:
    """``::1`` -> ``[::1]``, ``fe80::1%eth0`` -> ``[fe80::1%25eth0]``; anything else (a name,
    an IPv4 address, a host already in brackets) unchanged."""
    if host.startswith("[") or not _is_ipv6(host):
        return host
    addr, sep, zone = host.partition("%")
    return f"[{addr}%25{zone}]" if sep else f"[{addr}]"


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback address (no name is resolved)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def http_url(host: str, port: int, scheme: str = "http") -> str:
    """``scheme://host:port`` with the host bracketed when it is an IPv6 literal."""
    return f"{scheme}://{host_for_url(host)}:{int(port)}"


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``http(s)://host:port[/path]`` -> ``(host, port)``, the
    host without brackets (``::1``, a zone as ``%eth0``), as ``socket`` and ``asyncio`` take it.

    Raises ValueError saying what is wrong: no port, a bad port, or an IPv6 literal without
    brackets (``::1:9400`` cannot say where the address ends).
    """
    text = address.strip()
    bare = text.split("://", 1)[1] if "://" in text else text
    netloc = bare.split("/", 1)[0].rsplit("@", 1)[-1]
    if not netloc.startswith("[") and netloc.count(":") > 1:
        raise ValueError(f"{address!r}: an IPv6 address needs brackets, e.g. [::1]:9400")
    parts = urlsplit(text if "://" in text else "http://" + text)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{address!r}: bad port") from None
    if not parts.hostname or port is None:
        raise ValueError(f"{address!r}: expected host:port")
    host = unquote(parts.hostname) if "%" in parts.hostname else parts.hostname
    return host, port


def is_http_url(url: str) -> bool:
    """``url`` is ``http(s)://host[:port][/path]`` with a host and, if given, a valid port."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def is_monitor_url(url: str) -> bool:
    """:func:`is_http_url` with a port, which only ``https`` may leave out (443: a monitor behind
    a TLS ingress): ``http://mon`` is port 80, a monitor's ``:19400`` forgotten."""
    return is_http_url(url) and (urlsplit(url).port is not None or urlsplit(url).scheme == "https")


def url_list(raw: str | None) -> list[str] | None:
    """``raw``'s comma-separated entries, blanks skipped (``"$A,$B"`` with one unset); None
    where it has text but names no entry at all (both unset: a monitor was meant)."""
    urls = [u.strip() for u in (raw or "").split(",") if u.strip()]
    return None if not urls and raw and raw.strip() else urls


def redact_url(text: str | None) -> str | None:
    """A URL, or a message holding URLs, with each one's password shown as ``***``
    (``http://user:***@host``; a user name alone, which may be a token: ``http://***@host``;
    a query parameter named for a secret: ``?token=***``): for whatever is shown; requests keep
    the real URL."""
    if not text:
        return text
    return _QUERY_SECRET.sub(r"\1***", _USER_ONLY.sub(r"\1***@", _PASSWORD.sub(r"\1:***@", text)))


def redact_entry(url: str) -> str:
    """:func:`redact_url` of one URL as given, a scheme left out too (``u:pw@mon:1``): a
    password is found after ``://`` only."""
    return redact_url(url) if "://" in url else redact_url("x://" + url)[len("x://"):]


def failure_reason(e: Exception) -> str | None:
    """A connection failure in a few words (``Connection refused``), or None: the text of a
    requests/urllib3 error holds object reprs and retry counts."""
    for pattern in (r"\[Errno -?\d+\] ([^'\")]+)", r"(Name or service not known)",
                    r"(timed out)", r"(Invalid URL[^:]*)"):
        if m := re.search(pattern, str(e)):
            return m.group(1).strip()
    return None
