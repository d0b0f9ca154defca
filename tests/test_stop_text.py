"""Stop strings over streamed pieces of text: nothing of a stop string is ever sent, whatever the pieces."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from core.stop_text import StopText


def stream(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """What a client is sent, push by push (then the finish), and whether a stop string ended the text."""
    text = StopText[int](stops)
    sent = [text.push(piece)[0] for piece in pieces]
    sent.append(text.finish()[0])
    return sent, text.stopped


def test_without_stop_strings_every_piece_passes_at_once() -> None:
    assert stream([], ["a", "b", ""]) == (["a", "b", "", ""], False)


def test_a_stop_string_split_across_three_pieces_is_held_back_and_never_sent() -> None:
    sent, stopped = stream(["END"], ["The e", "xit: E", "N", "D and after", "more"])
    assert sent == ["The e", "xit: ", "", "", "", ""]
    assert stopped and "".join(sent) == "The exit: "


def test_held_text_that_turns_out_not_to_be_a_stop_string_is_sent_with_the_next_piece() -> None:
    sent, stopped = stream(["END"], ["x E", "N", "o"])
    assert sent == ["x ", "", "ENo", ""]
    assert not stopped


def test_the_end_of_the_text_releases_what_was_held_back() -> None:
    assert stream(["END"], ["x EN"]) == (["x ", "EN"], False)


def test_the_earliest_of_several_stop_strings_wins_and_the_text_before_it_goes() -> None:
    sent, _ = stream(["world", "o w"], ["hello world"])
    assert sent == ["hell", ""]
    sent, _ = stream(["\n\n", "###"], ["a\n", "#", "##\n\n"])
    assert "".join(sent) == "a\n"


def test_multi_byte_text_and_pieces_without_text() -> None:
    # A character split over tokens reaches the controller whole with the last of its tokens; the others bring "".
    sent, stopped = stream(["é!"], ["caf", "", "é", "", "!", "x"])
    assert "".join(sent) == "caf" and stopped
    sent, stopped = stream(["𠮷野"], ["𠮷", "", "", "家 𠮷", "野家"])
    assert sent == ["", "", "", "𠮷家 ", "", ""]
    assert stopped


def test_items_travel_with_their_text_and_those_of_a_stop_string_never_go() -> None:
    text = StopText[str](["STOP"])
    assert text.push("a", "t1") == ("a", ["t1"])
    assert text.push("bS", "t2") == ("b", [])        # part of its text is held back: its item waits
    assert text.push("T", "t3") == ("", [])
    assert text.push("", "t4") == ("", [])           # a token without text (part of a character) waits too
    assert text.push("x", "t5") == ("STx", ["t2", "t3", "t4", "t5"])
    assert text.push("", "t6") == ("", [])           # nothing after it yet: it could begin a stop string
    assert text.push("ST", "t7") == ("", [])
    assert text.push("OP!", "t8") == ("", [])        # the stop string begins where t6 and t7 do: never sent
    assert text.stopped
    assert text.push("more", "t9") == ("", []) and text.finish() == ("", [])


def test_at_a_stop_the_piece_it_begins_in_goes_with_the_text_before_it() -> None:
    text = StopText[str](["STOP"])
    assert text.push("abSTO", "t1") == ("ab", [])
    assert text.push("P", "t2") == ("", ["t1"])


def test_finish_sends_every_waiting_item() -> None:
    text = StopText[str](["STOP"])
    assert text.push("xS", "t1") == ("x", [])
    assert text.push("", "t2") == ("", [])
    assert text.finish() == ("S", ["t1", "t2"])


def test_pushed_counts_the_characters_in() -> None:
    text = StopText[None](["zz"])
    text.push("é𠮷")
    text.push("z")
    assert text.pushed == 3


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopText(["a", ""])


@given(st.lists(st.text(alphabet="abé𠮷", max_size=4), max_size=12),
       st.lists(st.text(alphabet="abé𠮷", min_size=1, max_size=3), min_size=1, max_size=3))
@example(["𠮷a", "𠮷"], ["a", "𠮷a𠮷"])  # found by CI: the stop is the first one complete, not the first one begun
def test_what_is_sent_is_the_text_up_to_the_first_stop_string(pieces: list[str], stops: list[str]) -> None:
    sent, stopped = stream(stops, pieces)
    # Generation ends with the piece that completes a stop string: a longer one that starts earlier but would only
    # be complete later (stops 'a' and '𠮷a𠮷' over '𠮷a', '𠮷') never is, as with llama-server.
    text, found = "", []
    for piece in pieces:
        text += piece
        found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
        if found:
            break
    assert "".join(sent) == (text[:min(found)] if found else text)
    assert stopped == bool(found)
