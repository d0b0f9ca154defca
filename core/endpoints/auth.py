"""The API key as a Bearer token: the one check the OpenAI-compatible API and the metrics endpoint share."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (the scheme in any case, RFC 7235).

    Compared in constant time: how long a wrong guess takes says nothing about how much of it was right.
    """
    scheme, _, token = authorization.strip().partition(" ")
    # A non-ASCII header cannot match a key (visible ASCII), but must not raise: encode it however it comes.
    offered = token.strip().encode("utf-8", "backslashreplace")
    return scheme.lower() == "bearer" and hmac.compare_digest(offered, key.encode())
