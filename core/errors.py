"""The error tree. Every message names the file, node or field at fault and how to fix it."""

from __future__ import annotations


class ClusterError(Exception):
    """A failure the user can act on; rendered as one line, never a traceback."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class InventoryError(ClusterError):
    """The inventory file is missing, malformed or inconsistent (bad usage: exit 2)."""

    exit_code = 2


class ConnectError(ClusterError):
    """A node, worker or the controller could not be reached."""


class WorkerDown(ConnectError):
    """Nothing listens on a worker's port (or a forward to it): the worker is down or restarting, not hung."""


class DeployError(ClusterError):
    """A worker binary could not be built, found or started."""


class MissingDevice(DeployError):
    """A worker lacks the device of the backend it was built for (a driver missing or unreachable): it would serve
    the CPU alone. It does not pass by itself, so the node waits for the next `up` instead of a timer."""


class WorkerError(ClusterError):
    """A worker answered wrongly (protocol version, memory query) or died."""


class PlanError(ClusterError):
    """The model cannot be placed on the nodes that are available."""


class RequestError(ClusterError):
    """A generation request failed."""


class Busy(RequestError):
    """Every slot generates and the queue is full: the request is refused at once, to be tried again later."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, f"retry in {retry_after}s")
        self.retry_after = retry_after  # seconds, at least 1: when a place is likely to be free


class PromptError(RequestError):
    """The request itself cannot be served (too long for the context, no chat template): the caller's to fix."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None, field: str | None = None) -> None:
        super().__init__(message, hint)
        self.field = field  # the request field at fault, when one is


class ProfileError(ClusterError):
    """A node's speed could not be measured (the planner then falls back to memory shares)."""
