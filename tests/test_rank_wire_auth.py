"""The signature of the monitor's calls to a rank (rank_wire.auth), both sides of the wire: pinned
vectors any reimplementation must reproduce, and every signed field bound.

The first vector is checkable without Python:
``printf 'lightkeeper-rank-call-v1\\nPOST\\n/v1/exit\\n2/1/train_0:abc\\n<sha256 of the body>'
| openssl dgst -sha256 -hmac s3cret-token``.
"""

from __future__ import annotations

import pytest

from rank_wire import auth

TOKEN = "s3cret-token"
BODY = b'{"reason": "evicted"}'
CALL = ("POST", "/v1/exit", "2/1/train_0:abc", BODY)
PINNED = "296f3ce115f2be996cfb8b1e67ac20a50e2098a21d85baea712d9df03579943b"
# a rank with no replica id yet, an empty body
PINNED_NO_ID = ("POST", "/v1/probe", "0/0/", b"",
                "20c6e4061a28b7668dc1dc51f579a33a08e5f42af8dc7a0f2b7322c07b812c02")


def test_pinned_vectors():
    assert auth.sign(TOKEN, *CALL) == PINNED
    *call, sig = PINNED_NO_ID
    assert auth.sign(TOKEN, *call) == sig
    assert auth.verify(TOKEN, *CALL, PINNED)
    assert auth.verify(TOKEN, *call, sig)
    assert auth.header(TOKEN, *CALL) == f"Lightkeeper-HMAC-SHA256 {PINNED}"


def test_the_identity_a_rank_serves():
    assert auth.identity(2, 1, "train_0:abc") == "2/1/train_0:abc"
    assert auth.identity(0, 0, None) == "0/0/"  # no replica id before the first quorum
    assert auth.identity_of({"replica_group": 2, "group_rank": 1, "replica_id": "r/x",
                             "rank": 5}) == "2/1/r/x"
    assert auth.identity_of(None) == "//"


@pytest.mark.parametrize("changed", [
    ("GET", "/v1/exit", "2/1/train_0:abc", BODY),
    ("POST", "/v1/abort", "2/1/train_0:abc", BODY),
    ("POST", "/v1/exit?x=1", "2/1/train_0:abc", BODY),
    ("POST", "/v1/exit", "2/5/train_0:abc", BODY),  # a stranger claiming group 2 rank 5
    ("POST", "/v1/exit", "3/1/train_0:abc", BODY),
    ("POST", "/v1/exit", "2/1/train_0:abd", BODY),
    ("POST", "/v1/exit", "2/1/", BODY),
    ("POST", "/v1/exit", "2/1/train_0:abc", b'{"reason": "evicted!"}'),
])
def test_any_field_changed_is_refused(changed):
    assert not auth.verify(TOKEN, *changed, PINNED)


def test_a_wrong_token_or_signature_is_refused():
    assert not auth.verify("other-token", *CALL, PINNED)
    assert not auth.verify(None, *CALL, PINNED)
    assert not auth.verify(" ", *CALL, PINNED)
    assert not auth.verify(TOKEN, *CALL, None)
    assert not auth.verify(TOKEN, *CALL, PINNED[:-1])
    assert not auth.verify(TOKEN, *CALL, "é" * 64)
    assert auth.verify(TOKEN + "\n", *CALL, PINNED.upper())  # a secret file's newline; hex case
    with pytest.raises(ValueError):
        auth.sign(" \n", *CALL)


def test_the_header_and_the_bearer_form():
    assert auth.signature_of(f"lightkeeper-hmac-sha256  {PINNED} ") == PINNED
    assert auth.signature_of(f"Bearer {TOKEN}") is None
    assert auth.signature_of(None) is None
    # signed for the route the rank serves, with its query
    assert auth.authorization(TOKEN, "hmac", "/v1/exit", BODY, "2/1/train_0:abc") == \
        f"Lightkeeper-HMAC-SHA256 {PINNED}"
    assert auth.authorization(TOKEN + "\n", "bearer", "/v1/exit", BODY, "2/1/x") == \
        f"Bearer {TOKEN}"
    assert auth.authorization(TOKEN, "hmac", "/v1/x?a=1&b=2", b"", "//") == \
        auth.header(TOKEN, "POST", "/v1/x?a=1&b=2", "//", b"")
