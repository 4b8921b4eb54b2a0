"""A reasoning model's thinking, read out of its text: what it writes between `<think>`
and `</think>` (DeepSeek-R1, Qwen3, QwQ, GLM-4.5, ...) goes apart from its answer, as
vLLM's reasoning parsers put it in `reasoning_content`.

Some templates open the thinking themselves (their generation prompt ends with
`<think>`: DeepSeek-R1-0528, Qwen3's thinking-only models): the output then starts
inside it, and only `</think>` comes. Others leave the model to open it (Qwen3's hybrid
models), or to answer at once, or write an empty thinking into the prompt (Qwen3's with
`enable_thinking` false). Each prompt's end says which. A model's loader option
`reasoning_format` says "think" or "none" where the template does not: a template that
writes `</think>` reasons.
"""

from __future__ import annotations

FORMATS = ("think", "none")
OPENS, CLOSES = "<think>", "</think>"
PROMPT_TAIL = 8  # tokens: a prompt's end, decoded, shows whether it opens the thinking


def reasons(template: str | None, configured: str | None, key: str) -> bool:
    """Whether the model thinks in `<think>`: what its options say, else its template."""
    if configured is not None:
        if configured not in FORMATS:
            raise ValueError(f"model {key!r}: reasoning_format {configured!r} is not one of "
                             f"{list(FORMATS)}")
        return configured == "think"
    return CLOSES in (template or "")


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending so opened the thinking (the output starts inside it)."""
    return prompt_tail.rstrip().endswith(OPENS)


class ReasoningReader:
    """One output's text split into its thinking and its answer, as it streams. Text that
    may be the start of a tag is held until it is known not to be; the whitespace around
    the tags (the templates' newlines) belongs to neither. An output cut short inside the
    thinking has only thinking, as vLLM's DeepSeek-R1 parser reads it."""

    def __init__(self, inside: bool) -> None:
        self.state = "inside" if inside else "start"  # start, inside, after, answer
        self.pending = ""
        self.thought = False  # some thinking has been passed on

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) that may be passed on now."""
        self.pending += text
        thinking, answer = "", ""
        while self.pending:
            if self.state == "start":
                if not self._opened():
                    break
            elif self.state == "inside":
                more, closed = self._thinking()
                thinking += more
                if not closed:
                    break
            elif self.state == "after":
                self.pending = self.pending.lstrip()
                if self.pending:
                    self.state = "answer"
            else:
                answer, self.pending = answer + self.pending, ""
        return thinking, answer

    def _opened(self) -> bool:
        """At the answer's start: True once it is known whether `<think>` opens it."""
        start = self.pending.lstrip()
        if start.startswith(OPENS):
            self.state, self.pending = "inside", start.removeprefix(OPENS)
            return True
        if not OPENS.startswith(start):
            self.state = "answer"
            return True
        return False  # maybe the tag: wait for more

    def _thinking(self) -> tuple[str, bool]:
        """The thinking that may be passed on, and whether `</think>` was reached."""
        at = self.pending.find(CLOSES)
        if at >= 0:
            text, self.pending = self.pending[:at], self.pending[at + len(CLOSES):]
            self.state = "after"
            return self._passed(text.rstrip()), True
        kept = next((n for n in range(min(len(CLOSES) - 1, len(self.pending)), 0, -1)
                     if CLOSES.startswith(self.pending[-n:])), 0)
        cut = len(self.pending) - kept
        stripped = self.pending[:cut].rstrip()  # trailing space may precede the tag
        text, self.pending = stripped, self.pending[len(stripped):]
        return self._passed(text), False

    def _passed(self, text: str) -> str:
        if not self.thought:
            text = text.lstrip()
            self.thought = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """At the output's end: the thinking and the answer still held."""
        text, self.pending = self.pending, ""
        if self.state == "inside":
            return self._passed(text.rstrip()), ""
        if self.state == "after":
            return "", ""
        return "", text
