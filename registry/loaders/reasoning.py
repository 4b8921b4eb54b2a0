"""A reasoning model's thinking, read out of its text: what it writes between its tags
goes apart from its answer, as vLLM's reasoning parsers put it in `reasoning_content`:

- "think": `<think>` and `</think>` (DeepSeek-R1, Qwen3, QwQ, GLM-4.5, MiniMax, ...);
- "mistral": `[THINK]` and `[/THINK]` (Magistral);
- "seed_oss": `<seed:think>` and `</seed:think>` (Seed-OSS);
- "granite": the prose "Here is my thought process:" and "Here is my response:" (or
  "Here's ...") of Granite 3.2 with its template's `thinking` on (vLLM's `granite`).

Some templates open the thinking themselves (their generation prompt ends with the
opening tag: DeepSeek-R1-0528, Qwen3's thinking-only models): the output then starts
inside it, and only the closing tag comes. Others leave the model to open it (Qwen3's
hybrid models), or to answer at once, or write an empty thinking into the prompt
(Qwen3's with `enable_thinking` false). Each prompt's end says which. A model's loader
option `reasoning_format` names its tags, or "none", where the template does not: a
template that writes a closing tag reasons so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelpool.registry.loaders.marks import partial_mark
from modelpool.registry.spec import ModelSpec


@dataclass(frozen=True)
class ThinkingTags:
    name: str
    opens: str
    closes: str
    other_opens: tuple[str, ...] = ()  # other ways the model writes them
    other_closes: tuple[str, ...] = ()

    @property
    def openings(self) -> tuple[str, ...]:
        return (self.opens, *self.other_opens)

    @property
    def closings(self) -> tuple[str, ...]:
        return (self.closes, *self.other_closes)


FORMATS = {t.name: t for t in (ThinkingTags("think", "<think>", "</think>"),
                               ThinkingTags("mistral", "[THINK]", "[/THINK]"),
                               ThinkingTags("seed_oss", "<seed:think>", "</seed:think>"),
                               ThinkingTags("granite", "Here is my thought process:",
                                            "Here is my response:",
                                            ("Here's my thought process:",),
                                            ("Here's my response:",)))}
# vLLM's --reasoning-parser names for the tags read here
FORMATS |= {name: FORMATS["think"] for name in ("deepseek_r1", "qwen3", "glm45", "minimax_m2")}
PROMPT_TAIL = 8  # tokens: a prompt's end, decoded, shows whether it opens the thinking


def thinking_tags(template: str | None, configured: str | None,
                  key: str) -> ThinkingTags | None:
    """The model's tags: those its options name, else those its template writes; None:
    it does not reason."""
    if configured is not None:
        if configured != "none" and configured not in FORMATS:
            raise ValueError(f"model {key!r}: reasoning_format {configured!r} is not one of "
                             f"{[*FORMATS, 'none']}")
        return FORMATS.get(configured)
    template = template or ""
    # the rarer tags first: a template naming them may name </think> too
    for tags in (FORMATS["seed_oss"], FORMATS["mistral"], FORMATS["granite"],
                 FORMATS["think"]):
        if tags.closes in template:
            return tags
    return None


def structured_in_reasoning(spec: ModelSpec) -> bool:
    """The option: a structured output's language holds the thinking too."""
    held = spec.options.get("structured_in_reasoning", False)
    if not isinstance(held, bool):
        raise ValueError(f"model {spec.key!r}: structured_in_reasoning must be true or "
                         f"false, not {held!r}")
    return held


def one_token(tokenizer: Any, text: str) -> int | None:
    """The token that is this whole text (a tag the vocabulary has), else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def opens_thinking(prompt_tail: str, tags: ThinkingTags) -> bool:
    """Whether a prompt ending so opened the thinking (the output starts inside it)."""
    return prompt_tail.rstrip().endswith(tags.openings)


class ReasoningReader:
    """One output's text split into its thinking and its answer, as it streams. Text that
    may be the start of a tag is held until it is known not to be; the whitespace around
    the tags (the templates' newlines) belongs to neither. An output cut short inside the
    thinking has only thinking, as vLLM's DeepSeek-R1 parser reads it."""

    def __init__(self, inside: bool, tags: ThinkingTags = FORMATS["think"]) -> None:
        self.tags = tags
        self.state = "inside" if inside else "start"  # start, inside, after, answer
        self.pending = ""
        self.thought = False  # some thinking has been passed on

    @property
    def thinking(self) -> bool:
        """Inside the thinking (its opening tag read, its closing tag not)."""
        return self.state == "inside"

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
        for opens in self.tags.openings:
            if start.startswith(opens):
                self.state, self.pending = "inside", start.removeprefix(opens)
                return True
        if not any(opens.startswith(start) for opens in self.tags.openings):
            self.state = "answer"
            return True
        return False  # maybe the tag: wait for more

    def _thinking(self) -> tuple[str, bool]:
        """The thinking that may be passed on, and whether its closing tag was reached."""
        found = [(at, closes) for closes in self.tags.closings
                 if (at := self.pending.find(closes)) >= 0]
        if found:
            at, closes = min(found)
            text, self.pending = self.pending[:at], self.pending[at + len(closes):]
            self.state = "after"
            return self._passed(text.rstrip()), True
        cut = len(self.pending) - partial_mark(self.pending, self.tags.closings)
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
