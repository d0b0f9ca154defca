"""Stop strings over streamed text: what may be sent now, what is held back, and where the text ends.

A leaf: plain text in, plain text out, so that the controller can keep one per request across coordinator restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class _Piece(Generic[T]):
    start: int  # character offsets of the piece's text in everything pushed
    end: int
    item: T


class StopText(Generic[T]):
    """The text of one generation as its client may see it, ending before the first of ``stops``.

    Pieces (each token's text) come in as the model makes them, each with an optional item (its logprobs) that
    travels with its text. ``push`` answers the text that is safe to send now and the items whose text has gone
    out. Text that could still become a stop string is held back until a later piece settles it, so a stop string
    is never sent, also when it spans several pieces; once one is complete, the text before it is the last sent
    and `stopped` is set.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        """``stops``: the stop strings (none: every piece passes at once)."""
        if any(not stop for stop in stops):
            raise ValueError("a stop string must not be empty")
        self._stops = tuple(stops)
        self._held = ""      # pushed, not sent yet
        self._sent = 0       # characters sent (offset of _held in everything pushed)
        self._pushed = 0     # characters pushed
        self._pieces: list[_Piece[T]] = []  # pieces with an item that is not sent yet
        self.stopped = False

    @property
    def pushed(self) -> int:
        """Characters pushed so far (the offset the next piece starts at)."""
        return self._pushed

    def push(self, text: str, item: T | None = None) -> tuple[str, list[T]]:
        """Add a piece; the text and the items that may be sent now (nothing once stopped)."""
        if self.stopped:
            return "", []
        start = self._pushed
        self._pushed += len(text)
        self._held += text
        if item is not None:
            self._pieces.append(_Piece(start, self._pushed, item))
        found = [at for at in (self._held.find(stop) for stop in self._stops) if at >= 0]
        if found:
            self.stopped = True
            cut = self._sent + min(found)
            # A piece whose text begins before the stop string was (partly) sent: its item goes with it.
            return self._release(cut, lambda piece: piece.start < cut)
        sent = self._pushed - self._partial()
        # An item goes once all its text is sent; one of a piece without text (part of a character) once text
        # after it is, so that it is never sent ahead of a stop string that its bytes begin.
        return self._release(sent, lambda piece: piece.end <= sent and piece.start < sent)

    def finish(self) -> tuple[str, list[T]]:
        """The generation ended (without a stop string, unless `stopped`): everything held back may go."""
        if self.stopped:
            return "", []
        return self._release(self._pushed, lambda _: True)

    def _partial(self) -> int:
        """Length of the longest end of the held text that begins a stop string (which a later piece may
        complete)."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _release(self, upto: int, goes: Callable[[_Piece[T]], bool]) -> tuple[str, list[T]]:
        text = self._held[:upto - self._sent]
        self._held = self._held[upto - self._sent:] if not self.stopped else ""
        self._sent = upto
        items = [piece.item for piece in self._pieces if goes(piece)]
        self._pieces = [piece for piece in self._pieces if not goes(piece)] if not self.stopped else []
        return text, items
