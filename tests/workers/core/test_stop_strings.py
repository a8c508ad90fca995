"""Stop strings: split across deltas, held back while ambiguous, earliest match wins."""

from __future__ import annotations

from hybridserve.workers.core.stop_strings import StopMatch, StopStringMatcher

# -- stop strings -------------------------------------------------------------------------------


def feed_all(matcher, deltas):
    return [matcher.feed(delta) for delta in deltas]


def test_stop_string_split_across_chunks():
    matcher = StopStringMatcher(["STOP"])
    assert feed_all(matcher, ["hello S", "TO", "P world", "more"]) == [
        StopMatch("hello ", False),
        StopMatch("", False),
        StopMatch("", True, "STOP"),
        StopMatch("", True),  # nothing more once stopped
    ]


def test_held_text_is_released_when_it_cannot_be_a_stop():
    matcher = StopStringMatcher(["STOP"])
    assert feed_all(matcher, ["ab ST", "AR", "t"]) == [
        StopMatch("ab ", False),
        StopMatch("STAR", False),
        StopMatch("t", False),
    ]


def test_overlapping_prefixes_and_earliest_stop_wins():
    matcher = StopStringMatcher(["aab"])
    # "aaab" holds "aa" (a prefix of "aab"), then finds "aab" starting at the second "a".
    assert feed_all(matcher, ["aaa", "b"]) == [StopMatch("a", False), StopMatch("", True, "aab")]
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.feed("hello world") == StopMatch("hel", True, "lo")


def test_stop_inside_one_delta_and_flush():
    matcher = StopStringMatcher(["\n\n", "###"])
    assert matcher.feed("line one\nline") == StopMatch("line one\nline", False)
    assert matcher.feed(" two #") == StopMatch(" two ", False)
    assert matcher.flush() == "#"
    assert matcher.flush() == ""
    assert StopStringMatcher(["x"]).feed("abc\n\nx") == StopMatch("abc\n\n", True, "x")


def test_no_stops_passes_everything_through():
    matcher = StopStringMatcher([])
    assert feed_all(matcher, ["a", "b"]) == [StopMatch("a", False), StopMatch("b", False)]
