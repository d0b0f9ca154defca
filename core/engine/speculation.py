"""Speculative decoding's drafts: tokens a sequence will likely generate next, verified in one cluster step.

Per token, the coordinator waits once for every device boundary the step crosses; over a network that wait, not
the arithmetic, is most of a token's time. A slot that sends its next token together with tokens drafted after it
gets the model's choice at every one of those positions from that one step: the drafts up to the first one the
model would not have chosen are kept (core.engine.slots verifies them), with the model's own token after them, so
the text is what decoding one token at a time gives, several tokens per wait.

``NgramDraft`` drafts from the sequence itself (prompt-lookup decoding; llama.cpp's ``ngram-simple``): where the
last few tokens occurred before, what followed them then is the draft. It costs no model and shines where the
output copies its input (edit this text, repeat, code that reuses names) and drafts nothing where nothing repeats.
"""

from __future__ import annotations

from core.model import DRAFT_MAX

# The n-grams looked up, longest first: a longer match predicts its continuation better; shorter than three
# tokens matches common phrases whose continuations differ, which costs verification for nothing.
NGRAM_SIZES = (5, 4, 3)


class NgramDraft:
    """Drafts for one sequence from the n-grams of its own tokens (the prompt, then each token it generates).

    After a draft, its length follows how much of the last one was kept: about twice as many as were kept, so a
    request that copies runs at ``limit`` while one that does not verifies one drafted token at most.
    """

    def __init__(self, tokens: list[int], limit: int = DRAFT_MAX) -> None:
        """``tokens``: the sequence so far; ``limit``: the most tokens a draft may hold."""
        self.tokens: list[int] = []
        self._follows: dict[tuple[int, ...], int] = {}  # n-gram → where the token after its latest occurrence is
        self.limit = limit
        self._next = limit  # the next draft's length at most
        for token in tokens:
            self.add(token)

    def add(self, token: int) -> None:
        """``token`` follows the sequence."""
        tokens = self.tokens
        for size in NGRAM_SIZES:
            if len(tokens) >= size:
                self._follows[tuple(tokens[-size:])] = len(tokens)
        tokens.append(token)

    def propose(self, room: int) -> list[int]:
        """At most ``room`` tokens likely to follow (none where the sequence's end never occurred before).

        A match close to the end continues into the draft itself, so a repeating pattern drafts whole periods.
        """
        room = min(room, self._next)
        tokens = self.tokens
        for size in NGRAM_SIZES:
            start = self._follows.get(tuple(tokens[-size:])) if len(tokens) >= size else None
            if start is not None:
                draft: list[int] = []
                for offset in range(start, start + room):
                    draft.append(tokens[offset] if offset < len(tokens) else draft[offset - len(tokens)])
                return draft
        return []

    def judged(self, drafted: int, accepted: int) -> None:
        """Of ``drafted`` tokens, the model chose the first ``accepted``."""
        if drafted:
            self._next = min(self.limit, 2 * accepted + 1)

    def release(self) -> None:
        """Nothing to free: its n-grams go with it."""
