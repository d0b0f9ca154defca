"""The API key as a Bearer token: the one check the OpenAI-compatible API and the metrics endpoint share; and the
web dashboard's session cookie, which a browser sends where it cannot send a header (a page, an EventSource)."""

from __future__ import annotations

import hashlib
import hmac

SESSION_COOKIE = "ggml_cluster_session"


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (the scheme in any case, RFC 7235).

    Compared in constant time: how long a wrong guess takes says nothing about how much of it was right.
    """
    scheme, _, token = authorization.strip().partition(" ")
    # A non-ASCII header cannot match a key (visible ASCII), but must not raise: encode it however it comes.
    offered = token.strip().encode("utf-8", "backslashreplace")
    return scheme.lower() == "bearer" and hmac.compare_digest(offered, key.encode())


def session_token(key: str) -> str:
    """The dashboard's cookie value for ``key``: derived from it, never the key itself, so a cookie read off a
    browser opens the dashboard (status, read only) but not the API; a new key ends every session."""
    return hmac.new(key.encode(), b"ggml-cluster web dashboard session", hashlib.sha256).hexdigest()


def session_matches(cookie: str, key: str) -> bool:
    """Whether a session cookie's value was made from ``key`` (compared in constant time)."""
    return hmac.compare_digest(cookie.encode("utf-8", "backslashreplace"), session_token(key).encode())
