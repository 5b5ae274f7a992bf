"""Bearer tokens: the one check that guards every state-changing route.

Compared with :func:`hmac.compare_digest` on UTF-8 bytes, so the time taken does not depend on
how much of the token a caller guessed right, and a header with characters outside ASCII is a
mismatch (401) rather than the ``TypeError`` that ``compare_digest`` raises on such ``str``.
An empty or unset expected token never matches: a route without a token stays off.
"""

from __future__ import annotations

import hmac


def bearer_token_matches(authorization: str | None, expected: str | None) -> bool:
    """True when the ``Authorization`` header value is ``Bearer <expected>``."""
    expected = (expected or "").strip()
    if not expected:
        return False
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # a token read from a secret file often ends in a newline: neither side's spaces count
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"),
                               expected.encode("utf-8", "surrogatepass"))
