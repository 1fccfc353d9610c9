"""Stop strings on streamed text: nothing of a stop string reaches the client, text that
might begin one waits for the next piece, and held text goes out at the end."""

from __future__ import annotations

from python_backends.gateway.stops import StopMatcher


def _run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped


def test_a_stop_string_split_across_pieces_is_never_sent() -> None:
    out, stopped = _run(["END"], ["Hello E", "N", "D and more"])
    assert stopped and "".join(out) == "Hello " and out[0] == "Hello "


def test_text_that_was_not_a_stop_string_goes_out_once_decided() -> None:
    out, stopped = _run(["END"], ["Hello E", "lse"])
    assert not stopped and out == ["Hello ", "Else", ""]


def test_held_text_goes_out_at_the_end() -> None:
    out, stopped = _run(["\n\n"], ["one\n"])
    assert not stopped and out == ["one", "\n"]


def test_the_earliest_of_several_stops_wins() -> None:
    out, stopped = _run(["b", "a"], ["xxab"])
    assert stopped and out == ["xx"]


def test_no_stops_passes_text_through() -> None:
    assert _run([], ["a", "b"]) == (["a", "b", ""], False)


def test_nothing_after_a_stop() -> None:
    m = StopMatcher(["."])
    assert m.feed("Hi. More") == "Hi" and m.feed("text") == "" and m.flush() == ""


def test_include_ends_the_text_with_the_stop_string() -> None:
    first = StopMatcher(["b", "ab"], include=True)
    assert first.feed("xxab and more") == "xxab" and first.stopped  # the earliest start wins
    assert first.feed("more") == "" and first.flush() == ""
    other = StopMatcher(["END"], include=True)
    assert other.feed("Hello E") + other.feed("N") + other.feed("D more") == "Hello END"
