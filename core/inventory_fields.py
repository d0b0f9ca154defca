"""The inventory's field types: names, users and hosts as ssh may see them, sizes, paths, ports and a node's
environment, each validated with a one-line reason (core.inventory_errors places it in the file)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from core.inventory_errors import SHORT, shown_key

NAME_PATTERN = r"^[A-Za-z0-9._-]+$"
# Users and hosts reach ssh's own config expansion (ProxyCommand's %r and %h run through a shell), so they
# may hold only what a POSIX login name, a host name, an IPv4/IPv6 address (with a %zone) or an alias holds.
USER_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]*$"
HOST_PATTERN = r"^([A-Za-z0-9_.:%][A-Za-z0-9_.:%-]*)?$"  # empty: a local node
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}

# `speculative: {draft_model: …}`'s default p_min, llama-server's --draft-p-min: a draft model's draft ends at a token
# it gives less than this probability (a guess that unlikely costs the cluster a row and the head a decode).
DRAFT_P_MIN = 0.75

# Larger is a typo, not a machine's memory; the bound also keeps every size exact and far from overflow.
MAX_SIZE = 1 << 60


def parse_size(value: object) -> int:
    """Parse a memory size such as ``6GiB``, ``512 MB`` or a plain byte count into bytes (at most 1 EiB)."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 6GiB or 512MiB")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*([A-Za-z]*)\s*", value)
        if not match or match.group(3).lower() not in _SIZE_UNITS:
            raise ValueError(f"{SHORT.repr(value)} is not a size; write it like 6GiB, 512MiB or 8GB")
        whole, fraction, unit = match.group(1).lstrip("0"), match.group(2) or "", _SIZE_UNITS[match.group(3).lower()]
        if len(whole) > len(str(MAX_SIZE)):
            raise ValueError(_too_large(value))
        # Exact: a byte is at most 2**-40 of the unit (TiB), which has 40 decimal digits; later ones add no byte.
        digits = fraction[:40]
        size = int(whole or "0") * unit + int(digits or "0") * unit // 10 ** len(digits)
    else:
        raise ValueError("expected a size such as 6GiB or 512MiB")
    if size <= 0:
        raise ValueError("a size must be positive")
    if size > MAX_SIZE:
        raise ValueError(_too_large(value))
    return size


def _too_large(value: object) -> str:
    return f"{SHORT.repr(value)} is more than 1 EiB (2**60 bytes); write the node's memory like 6GiB or 512MiB"


ENV_NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*"
# Set by ggml-cluster itself on the worker (its tensor cache): a node's env may not change it.
RESERVED_ENV = frozenset({"LLAMA_CACHE"})


def _environment(value: object) -> object:
    """A node's ``env:``: variable names to text values, as the worker process gets them."""
    if not isinstance(value, dict):
        return value  # pydantic's own "expected a mapping"
    for name, text in value.items():
        if not isinstance(name, str) or not re.fullmatch(ENV_NAME_PATTERN, name):
            raise ValueError(f"{SHORT.repr(name)} is not an environment variable name: use letters, digits and "
                             "'_', not starting with a digit")
        shown = shown_key(name)  # a valid name may still be too long for a one-line message
        if name in RESERVED_ENV:
            raise ValueError(f"{shown} is set by ggml-cluster (the worker's tensor cache); remove it")
        if not isinstance(text, str):
            quote = "; quote it" if isinstance(text, int | float) else ""  # YAML reads 0 or 1.5 as a number
            raise ValueError(f"{shown}: expected text, got {SHORT.repr(text)}{quote}")
        # The command that holds it is read back line by line to adopt a running worker.
        if not text.isprintable():
            raise ValueError(f"{shown}: {SHORT.repr(text)} holds an unprintable character (a newline, a tab, NUL, …)")
    return value


def _slots(value: object) -> object:
    """``api.parallel``: "auto" or a whole number (whose bounds pydantic checks, with its own messages)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{SHORT.repr(value)} is neither 'auto' nor a whole number of slots (1 to 64)")


def speculative_switch(value: object) -> object:
    """``speculative``'s value before its type: YAML 1.1 reads a bare ``off`` (``no``, ``false``) as false and ``on``
    as true, which mean off and ngram; anything but those words or a mapping (``{draft_model: PATH}``) is refused."""
    value = {False: "off", True: "ngram"}.get(value, value) if isinstance(value, bool) else value
    if not isinstance(value, dict) and value not in ("ngram", "off"):
        raise ValueError(f"got {SHORT.repr(value)}; expected ngram, off or {{draft_model: PATH}}")
    return value


def _no_nul(value: object) -> object:
    if isinstance(value, str) and "\0" in value:
        raise ValueError("a path cannot contain a NUL character")
    return value


Size = Annotated[int, BeforeValidator(parse_size)]
Name = Annotated[str, Field(pattern=NAME_PATTERN, min_length=1, max_length=64)]
User = Annotated[str, Field(pattern=USER_PATTERN, min_length=1, max_length=64)]
Host = Annotated[str, Field(pattern=HOST_PATTERN, max_length=255)]
PathText = Annotated[str, BeforeValidator(_no_nul), Field(min_length=1, max_length=4096)]
Port = Annotated[int, Field(ge=1, le=65535, strict=True)]
Environment = Annotated[dict[str, str], BeforeValidator(_environment)]
Slots = Annotated[Annotated[int, Field(ge=1, le=64, strict=True)] | Literal["auto"], BeforeValidator(_slots)]
