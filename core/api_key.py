"""The API key that guards the OpenAI API and the metrics endpoint: read from the inventory's ``api.key_file`` (checked
as ssh checks a private key) or from ``$GGML_CLUSTER_API_KEY``. Never written anywhere, never shown."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

from core.errors import InventoryError
from core.inventory_errors import Locator

API_KEY_ENV = "GGML_CLUSTER_API_KEY"
# A key is a Bearer token in a header: visible ASCII. Shorter than this, it can be guessed over the network (the API
# does not slow down wrong guesses); longer than the bound, it is the wrong file.
MIN_API_KEY_CHARS = 16
MAX_API_KEY_BYTES = 4096
API_KEY_FIX = ("fix: generate one, e.g. `openssl rand -hex 32 > api.key && chmod 600 api.key`, and name the file in "
               "api.key_file")


def read_api_key(path: Path | None, locate: Locator) -> str | None:
    """The API key: what ``path`` (the inventory's ``api.key_file``, resolved) holds, else ``$GGML_CLUSTER_API_KEY``,
    else None. InventoryError, located at api.key_file, when the file or the key will not do."""
    if path is None:
        return environment_key()
    at = ("api", "key_file")
    try:
        info = path.stat()
    except FileNotFoundError:
        raise InventoryError(locate.at(at, f"no such file {path}"), API_KEY_FIX) from None
    except OSError as exc:  # a folder on the way without permission, a name too long
        raise InventoryError(locate.at(at, f"cannot read {path}: {exc.strerror or exc}")) from None
    if not stat.S_ISREG(info.st_mode):
        raise InventoryError(locate.at(at, f"{path} is not a file"), API_KEY_FIX)
    # As ssh refuses a private key that others can read: a key others can read (or replace) guards nothing.
    if info.st_mode & 0o077:
        raise InventoryError(locate.at(at, f"{path} is open to group or others (mode {info.st_mode & 0o777:04o})"),
                             f"fix: chmod 600 {path}")
    if info.st_size > MAX_API_KEY_BYTES:
        raise InventoryError(locate.at(at, f"{path} has {info.st_size} bytes: not an API key"), API_KEY_FIX)
    try:
        text = path.read_bytes().decode("ascii")
    except OSError as exc:
        raise InventoryError(locate.at(at, f"cannot read {path}: {exc.strerror or exc}")) from None
    except UnicodeDecodeError:
        raise InventoryError(locate.at(at, f"{path} holds a character that is not ASCII"), API_KEY_FIX) from None
    key = text.strip()  # the newline that `echo` and editors leave
    problem = _key_problem(key)
    if problem:
        raise InventoryError(locate.at(at, f"{path} {problem}"), API_KEY_FIX)
    return key


def environment_key() -> str | None:
    """``$GGML_CLUSTER_API_KEY`` when it is set; InventoryError when it is set to something that is not a key."""
    key = os.environ.get(API_KEY_ENV)
    if key is None:
        return None
    problem = _key_problem(key)
    if problem:  # set but empty or garbled (`$(cat missing-file)`): never silently an open API
        raise InventoryError(f"${API_KEY_ENV} {problem}", f"{API_KEY_FIX}, or unset ${API_KEY_ENV}")
    return key


def _key_problem(key: str) -> str:
    """What makes ``key`` unusable as a Bearer token ('' when nothing does); the key itself is never shown."""
    if not key:
        return "is empty"
    if not all("!" <= char <= "~" for char in key):
        return "holds a space, a control or a non-ASCII character (a key is visible ASCII)"
    if len(key) < MIN_API_KEY_CHARS:
        return f"holds {len(key)} characters: a key needs at least {MIN_API_KEY_CHARS}"
    return ""


# Beyond loopback, the API and the metrics endpoint need a key (core.inventory checks the inventory for it).
def is_loopback(host: str) -> bool:
    """Whether a listener on ``host`` is reachable from this machine only: 127.0.0.0/8, ::1 or localhost."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or "" (every address)
        return False
