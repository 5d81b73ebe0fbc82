"""Reasoning parsers: split a thinking model's ``<think>...</think>`` block from its answer.

``--reasoning-parser qwen3`` (vLLM's name) turns on :class:`Qwen3ReasoningParser` for chat
completions: the text inside the think block becomes the message's ``reasoning_content`` and the
rest its ``content``. Qwen3 opens the block itself (its chat template does not), so an output
that does not start with ``<think>`` is all content, and one whose block never closed (cut off
by max_tokens) is all reasoning. The streaming form, :class:`ReasoningStream`, holds back
text that may be the start of a tag, so a tag split over two deltas is still recognised.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"

REASONING_PARSERS = ("qwen3",)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished output; None for an empty part. ``opened``: the prompt ended
    inside a think block (a template that opens it for the model), so the output starts in it."""
    stripped = THINK_START + text if opened else text.lstrip()
    if not stripped.startswith(THINK_START):
        return None, text or None
    reasoning, _, content = stripped[len(THINK_START):].partition(THINK_END)
    reasoning = reasoning.strip("\n")
    content = content.lstrip("\n")
    return reasoning or None, content or None


def think_state(prompt: str) -> str:
    """Where the prompt's last turn leaves the think block: "open" (the template opened it for the model),
    "closed" (Qwen3's enable_thinking false: an empty block) or "none"."""
    turn = prompt[max(prompt.rfind("<|im_start|>"), 0):]
    start, end = turn.rfind(THINK_START), turn.rfind(THINK_END)
    return "open" if start > end else "closed" if end >= 0 else "none"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Incremental :func:`split_reasoning`: feed text deltas, get (reasoning, content) deltas.

    States: "start" (nothing but whitespace seen: a think block may still open), "thinking"
    (inside the block) and "answer" (after it, or there was none).
    """

    def __init__(self, opened: bool = False) -> None:
        self.state = "thinking" if opened else "start"  # opened: as split_reasoning's
        self._held = ""  # text not yet assigned: possibly part of a tag, or newlines next to one
        self._skip_newlines = opened  # just passed a tag: drop the newlines that follow it

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        out = ReasoningDelta()
        text = self._held + delta
        self._held = ""
        while text:
            if self._skip_newlines:
                text = text.lstrip("\n")
                if not text:
                    break
                self._skip_newlines = False
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_START):
                    self.state, self._skip_newlines, text = "thinking", True, stripped[len(THINK_START):]
                    continue
                if not final and (not stripped or THINK_START.startswith(stripped)):
                    self._held = text  # whitespace or the start of "<think>": wait for more
                    break
                self.state = "answer"
                continue
            if self.state == "thinking":
                before, found, after = text.partition(THINK_END)
                if found:
                    out.reasoning += before.rstrip("\n")
                    self.state, self._skip_newlines, text = "answer", True, after
                    continue
                keep = 0 if final else partial_suffix(text, THINK_END)
                rest = text[: len(text) - keep]
                if not final:  # newlines just before </think> are not reasoning
                    keep += len(rest) - len(rest.rstrip("\n"))
                out.reasoning += text[: len(text) - keep]
                self._held = text[len(text) - keep:]
                break
            out.content += text
            break
        return out
