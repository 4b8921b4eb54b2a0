"""Text that streams in pieces and may be cut inside a tag: what to hold back."""

from __future__ import annotations


def partial_mark(text: str, marks: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin one of `marks` (a tag cut
    between two pieces): those are held until the next piece tells."""
    longest = max((len(mark) for mark in marks), default=1)
    return next((n for n in range(min(longest - 1, len(text)), 0, -1)
                 if any(mark.startswith(text[-n:]) for mark in marks)), 0)
