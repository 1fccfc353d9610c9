"""OpenAI `stop` strings, matched on the text as it streams. Text that could still become the
start of a stop string is held back until the next piece decides it, so a client never sees
part of a stop string."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str], include: bool = False) -> None:
        """`include`: the matched stop string ends the text (vLLM's include_stop_str_in_output)
        instead of being cut."""
        self.stops = [s for s in stops if s]
        self.include = include
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that can go to the client now. After a stop string is found, `stopped` is
        set and nothing more is emitted (the stop string itself only with `include`)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        pending = self._held + text
        found = [(i, s) for i, s in ((pending.find(s), s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            self._held = ""
            start, stop = min(found, key=lambda f: f[0])  # the first to start; ties: listed first
            return pending[:start + len(stop)] if self.include else pending[:start]
        keep = partial_suffix(pending, self.stops)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        """The generation ended without a stop string: what was held back goes out."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def partial_suffix(text: str, marks: list[str]) -> int:
    """The length of the longest end of `text` that begins one of `marks` (and is not all of
    it)."""
    best = 0
    for mark in marks:
        for n in range(min(len(mark) - 1, len(text)), best, -1):
            if text.endswith(mark[:n]):
                best = n
                break
    return best
