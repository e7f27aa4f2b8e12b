"""Incremental detokenization against the real tokenizer, and stop strings over streams."""

from __future__ import annotations

import copy
import random
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.output.detokenizer import IncrementalDetokenizer, backend_decode
from pagedserve.engine.output.stop import StopChecker

TEXTS = [
    "Hello, world! How are you today?",
    " leading space and  double  spaces",
    "line one\nline two\n\n\tindented\r\nwindows",
    "Emoji: 😀👍🏽🇫🇷 family 👨‍👩‍👧 done",
    "中文测试，日本語のテキスト、한국어 문장",
    "Accents: café naïve résumé Ångström Øresund œuvre",
    "Mixed 😀中文 é\n😀😀😀",
    "def f(x):\n    return x ** 2  # comment\n",
    "Ωμέγα και Русский текст",
]


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


def stream(tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = [detok.decode_next(t) for t in output]
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_streams_exactly(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("User said:", add_special_tokens=False)
    deltas = stream(tokenizer, prompt, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert deltas[-1] == ""  # nothing was left waiting for flush
    assert not any("\ufffd" in d for d in deltas)  # a split character is never emitted half-done


def test_emoji_split_across_tokens_is_held_back(tokenizer) -> None:
    ids = tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test"
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.decode_next(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == " 😀"


def test_chat_prompt_tail_does_not_leak_into_output(tokenizer) -> None:
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    out = tokenizer.encode("Sure! 👍", add_special_tokens=False)
    assert "".join(stream(tokenizer, prompt, out)) == "Sure! 👍"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(tokenizer, skip: bool) -> None:
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [2, 0]
    ids = [1] + ids[:1] + [9, 9] + ids[1:]
    text = "".join(stream(tokenizer, [1], ids, skip=skip))
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is (not skip)


def test_random_token_sequences_match_full_decode(tokenizer) -> None:
    rng = random.Random(1234)
    vocab = len(tokenizer)
    # Byte-level tokens of multi-byte characters make random sequences full of split and
    # invalid UTF-8; mix them in on purpose.
    pieces = tokenizer.encode("😀👍🏽中文é测试ÅŁ", add_special_tokens=False)
    for _ in range(150):
        ids = [
            rng.choice(pieces) if rng.random() < 0.4 else rng.randrange(vocab)
            for _ in range(rng.randint(1, 40))
        ]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        for skip in (True, False):
            got = "".join(stream(tokenizer, prompt, ids, skip=skip))
            assert got == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_window_stays_small_over_long_outputs(tokenizer) -> None:
    ids = tokenizer.encode("word 😀 " * 400, add_special_tokens=False)
    calls: list[int] = []

    class Counting:
        is_fast = True
        all_special_ids = tokenizer.all_special_ids
        added_tokens_decoder = tokenizer.added_tokens_decoder

        def decode(self, token_ids, **kw):
            calls.append(len(token_ids))
            return tokenizer.decode(token_ids, **kw)

    detok = IncrementalDetokenizer(Counting(), [])
    for t in ids:
        detok.decode_next(t)
    assert detok.output_text == "word 😀 " * 400
    assert max(calls) <= 8  # constant work per token, not the whole output


def test_fast_tokenizer_decodes_through_its_backend_only_where_the_text_is_the_same(
    tokenizer,
) -> None:
    # The default model's tokenizer: the Rust decode, called directly, is what the
    # wrapper returns (the random-sequence test above compares streams through it).
    fast = backend_decode(tokenizer, True)
    assert fast is not None
    ids = tokenizer.encode(TEXTS[3] + TEXTS[4], add_special_tokens=False) + [2, 0, 1]
    for skip in (True, False):
        assert backend_decode(tokenizer, skip)(ids) == tokenizer.decode(ids, skip_special_tokens=skip)
    # Clean-up of tokenization spaces on, or a class with its own decode: the wrapper.
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert backend_decode(cleaning, True) is None

    class OwnDecode(type(tokenizer)):
        def decode(self, token_ids, **kw):
            return super().decode(token_ids, **kw).upper()

    own = copy.copy(tokenizer)
    own.__class__ = OwnDecode
    assert backend_decode(own, True) is None
    ids = tokenizer.encode("Hello there, world", add_special_tokens=False)
    assert "".join(stream(own, [], ids)) == "HELLO THERE, WORLD"


# ---------------------------------------------------------------------------------- stop


def feed_all(checker: StopChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    emitted: list[str] = []
    matched = None
    for d in deltas:
        out, m = checker.feed(d)
        emitted.append(out)
        if m is not None:
            matched = m
            break
    if matched is None:
        emitted.append(checker.flush())
    return emitted, matched


def test_stop_split_across_many_deltas_never_leaks() -> None:
    c = StopChecker(["###"])
    assert c.feed("Answer: 42#") == ("Answer: 42", None)
    assert c.feed("#") == ("", None)
    assert c.feed("#trailing") == ("", "###")
    assert c.feed("more") == ("", None)
    assert c.flush() == ""


def test_stop_inside_single_delta_with_trailing_text() -> None:
    assert StopChecker(["END"]).feed("abcENDxyz") == ("abc", "END")
    assert StopChecker(["END"], include_stop_str_in_output=True).feed("abcENDxyz") == (
        "abcEND",
        "END",
    )


def test_false_alarm_is_released() -> None:
    c = StopChecker(["\nUser:"])
    assert c.feed("hi\nUs") == ("hi", None)
    assert c.feed("ually") == ("\nUsually", None)
    assert c.feed(" ok\nU") == (" ok", None)
    assert c.flush() == "\nU"


def test_stop_begun_before_matching_starts() -> None:
    """Before ``min_tokens`` nothing matches, but a stop string completed later may begin
    in that text: its start is held back. One completed while matching was off never
    matches afterwards."""
    c = StopChecker(["Paris."])
    assert c.feed("It is Par", match=False) == ("It is ", None)
    assert c.feed("is.", match=True) == ("", "Paris.")
    c = StopChecker(["ab", "xaby"])
    assert c.feed("1xab", match=False) == ("1", None)  # "xab" may still become "xaby"
    assert c.feed("z") == ("xabz", None)  # the "ab" inside it was completed too early
    c = StopChecker(["ab"])
    assert c.feed("ab", match=False) == ("ab", None)
    assert c.feed("ab") == ("", "ab")


def test_overlapping_candidates() -> None:
    c = StopChecker(["abcd", "bcx"])
    assert c.feed("zab") == ("z", None)
    assert c.feed("c") == ("", None)
    assert c.feed("x!") == ("a", "bcx")  # "z" went out with the first delta


def test_first_completed_stop_wins() -> None:
    # "c" completes before "bcd" does: generation would already have stopped there.
    assert feed_all(StopChecker(["bcd", "c"]), list("abcd")) == (["a", "", "b"], "c")
    assert StopChecker(["bcd", "c"]).feed("abcd") == ("ab", "c")
    # Completed by the same character: the one starting earlier wins.
    assert StopChecker(["b", "ab"]).feed("xab") == ("x", "ab")


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, s = min(hits, key=lambda h: h[:2])
    return text[: end if include else start], s


alphabet = st.sampled_from("ab\nc")


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet, max_size=40),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=12),
    include=st.booleans(),
)
def test_stop_streaming_matches_reference(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in pairwise(bounds)]
    checker = StopChecker(stops, include_stop_str_in_output=include)
    emitted = ""
    matched = None
    for d in deltas:
        out, m = checker.feed(d)
        emitted += out
        if m is None and not include:
            # Nothing emitted so far may contain a stop string.
            assert not any(s in emitted for s in stops)
        if m is not None:
            matched = m
            break
    if matched is None:
        emitted += checker.flush()
    assert (emitted, matched) == reference(text, stops, include)
    if not include:
        assert not any(s in emitted for s in stops)
