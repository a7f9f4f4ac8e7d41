"""The stop-string rule (deltafin_mlx/generation/stops.py), as a run, a chat, a batch and
`generate` apply it: the text ends just before the earliest occurrence of any stop
string, however the text was cut into segments as it streamed."""

from hypothesis import given
from hypothesis import strategies as st

from deltafin_mlx.generation.stops import StopMatcher


def stream(stops, segments):
    """(what was shown, segment by segment and at the end, the matcher)."""
    m = StopMatcher(stops)
    shown = [m.add(s) for s in segments]
    return shown + [m.flush()], m


def test_without_stops_every_segment_is_shown_as_it_comes():
    shown, m = stream([], ["Hel", "lo", " world"])
    assert shown == ["Hel", "lo", " world", ""]
    assert m.text == "Hello world" and not m.stopped


def test_the_text_ends_before_the_stop_and_the_stop_is_not_shown():
    shown, m = stream(["END"], ["one two END three"])
    assert "".join(shown) == m.text == "one two "
    assert m.stopped


def test_a_stop_split_across_segments_is_found():
    shown, m = stream(["</s>"], ["answer<", "/", "s", ">more"])
    assert "".join(shown) == m.text == "answer"
    assert m.stopped


def test_only_what_could_start_a_stop_is_held_back():
    m = StopMatcher(["STOP"])
    assert m.add("a ST") == "a "  # "ST" may begin "STOP"
    assert m.add("x") == "STx"  # "STx" cannot: released
    assert m.add("yz") == "yz"  # nothing in it begins a stop


def test_what_is_held_back_is_released_at_flush():
    m = StopMatcher(["STOP"])
    assert m.add("the end: STO") == "the end: "
    assert m.flush() == "STO"
    assert m.text == "the end: STO" and not m.stopped


def test_with_several_stops_any_of_them_ends_the_text():
    for stop in ("\n\n", "User:"):
        _, m = stream(["\n\n", "User:"], ["reply", stop, "rest"])
        assert m.text == "reply" and m.stopped


def test_the_earliest_match_wins_whatever_the_order_of_the_stops():
    for stops in (["cd", "bc"], ["bc", "cd"]):
        _, m = stream(stops, ["xabcd"])
        assert m.text == "xa"


def test_empty_stop_strings_are_ignored():
    shown, m = stream(["", "END"], ["text", " END"])
    assert m.text == "text " and m.stopped
    _, m = stream([""], ["text"])
    assert m.text == "text" and not m.stopped


def test_after_a_stop_later_segments_are_ignored():
    m = StopMatcher(["."])
    assert m.add("First. Second") == "First"
    assert m.add(" and more.") == ""
    assert m.flush() == ""
    assert m.text == "First"


def test_a_longer_stop_starting_earlier_wins_over_a_shorter_one_found_first():
    # "b" is complete at 1 before "aba", begun at 0, is: the text ends at 0.
    m = StopMatcher(["b", "aba"])
    assert m.add("ab") == ""
    assert m.add("a") == ""
    assert m.stopped and m.text == ""
    # When the longer one never completes, the shorter one ends the text.
    m = StopMatcher(["b", "abc"])
    assert m.add("ab") + m.add("x") == "a"
    assert m.stopped and m.text == "a"
    m = StopMatcher(["b", "abc"])
    assert m.add("ab") + m.flush() == "a" and m.stopped


def cut_at_earliest_stop(text, stops):
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@st.composite
def segmented(draw):
    """A text from a small alphabet (so stops occur often), cut anywhere."""
    text = draw(st.text(alphabet="ab\n", max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, [text[i:j] for i, j in zip(bounds, bounds[1:])]


@given(segmented(), st.lists(st.text(alphabet="ab\n", max_size=4), max_size=4))
def test_any_segmentation_gives_the_text_cut_at_the_earliest_stop(text_segments, stops):
    text, segments = text_segments
    shown, m = stream(stops, segments)
    expected, stopped = cut_at_earliest_stop(text, stops)
    assert "".join(shown) == m.text == expected
    assert m.stopped == stopped
