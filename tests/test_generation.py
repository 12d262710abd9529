"""The generation state machine on hand-made logits: end of generation, stop strings and the text held back
for them, limits, logprobs, the allowed-token mask, and the slot table."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from barellm.generate.generation import Generation
from barellm.generate.sampling import SamplingParams, allowed_mask
from barellm.generate.slots import SlotTable, common_prefix
from barellm.generate.timings import Timings

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?\n"
V = len(ALPHABET) + 3   # 0: end of generation; 1..32: one character each; 33, 34: the two halves of "é"


class Tok:
    eog_ids = {0}

    def stream_decoder(self) -> Any:
        class D:
            def __init__(self) -> None:
                self.partial = b""

            def feed(self, i: int) -> str:
                if i == 33:
                    self.partial = "é".encode()[:1]
                    return ""
                if i == 34:
                    out = (self.partial + "é".encode()[1:]).decode()
                    self.partial = b""
                    return out
                return ALPHABET[i - 1] if i else ""

            def flush(self) -> str:
                out = self.partial.decode("utf-8", errors="replace")
                self.partial = b""
                return out

        return D()


def ids_of(text: str) -> list[int]:
    return [ALPHABET.index(c) + 1 for c in text]


def onehot(tok: int) -> np.ndarray:
    row = np.zeros(V, np.float32)
    row[tok] = 10.0
    return row


def run(script: list[int], **kw: Any) -> tuple[Generation, list[Any]]:
    """Drives a greedy Generation whose logits pick script's tokens in order."""
    kw.setdefault("max_tokens", 100)
    kw.setdefault("n_ctx", 1000)
    g = Generation([1, 2, 3], Tok(), params=SamplingParams(temperature=0), n_vocab=V, **kw)
    deltas = []
    for tok in script:
        if g.done:
            break
        d = g.step(onehot(tok))
        if d is not None:
            deltas.append(d)
        if not g.done:
            assert g.next_token == tok and g.position == 3 + len(g.generated) - 1
    return g, deltas


def text_of(deltas: list[Any]) -> str:
    return "".join(d.text for d in deltas)


def test_end_of_generation_token_stops_and_is_not_reported():
    g, deltas = run(ids_of("hello") + [0] + ids_of("more"))
    assert g.finish_reason == "stop" and text_of(deltas) == "hello"
    assert g.generated == ids_of("hello") and deltas[-1].finish_reason == "stop"
    assert [t for d in deltas for t in d.token_ids] == ids_of("hello")


def test_max_tokens_and_context_end_with_length():
    g, deltas = run(ids_of("abcdefgh"), max_tokens=5)
    assert g.finish_reason == "length" and text_of(deltas) == "abcde" and g.next_token is None
    g, deltas = run(ids_of("abcdefgh"), n_ctx=3 + 4)   # the prompt takes 3 positions
    assert g.finish_reason == "length" and text_of(deltas) == "abcd"
    g, _ = run([], max_tokens=0)
    assert g.done and g.finish_reason == "length"


def test_stop_string_across_tokens_cuts_before_it_and_holds_back_its_start():
    g, deltas = run(ids_of("one two. three"), stops=["o. t"])
    assert g.finish_reason == "stop" and text_of(deltas) == "one tw"
    # the "o" of "two" was held back from the moment it could begin the stop string
    texts = [d.text for d in deltas]
    assert "o" not in "".join(texts[:-1])[4:], texts
    # tokens that begin inside the stop string are not reported; every token of "one tw" is
    assert [t for d in deltas for t in d.token_ids] == ids_of("one tw")


def test_held_text_is_released_when_it_cannot_be_a_stop_and_at_the_end():
    g, deltas = run(ids_of("abxab"), stops=["abc"])
    assert not g.done and text_of(deltas) == "abx"   # "ab" may still become "abc"
    g, deltas = run(ids_of("abxab"), stops=["abc"], max_tokens=5)
    assert g.finish_reason == "length" and text_of(deltas) == "abxab"
    g, deltas = run(ids_of("abxab") + [0], stops=["abc"])
    assert g.finish_reason == "stop" and text_of(deltas) == "abxab"


def test_the_earliest_of_several_stop_strings_wins():
    g, deltas = run(ids_of("xx stop here end"), stops=["end", "here", "p h"])
    assert text_of(deltas) == "xx sto" and g.finish_reason == "stop"


def test_a_stop_string_completed_by_the_decoders_flush():
    # token 33 is half of "é": its text only appears at the flush (as U+FFFD), which a stop string can match
    g, deltas = run(ids_of("ab") + [33], stops=["b\ufffd"], max_tokens=3)
    assert g.finish_reason == "stop" and text_of(deltas) == "a"


def test_multibyte_characters_and_their_tokens():
    g, deltas = run(ids_of("a") + [33, 34] + ids_of("b"), max_tokens=4)
    assert text_of(deltas) == "aéb"
    # the first half of "é" produced no text: it is reported with the text it begins (the "é")
    assert [t for d in deltas for t in d.token_ids] == [1, 33, 34, 2]


def test_logprobs_are_reported_with_their_tokens():
    g, deltas = run(ids_of("abc"), top_logprobs=2, max_tokens=3)
    lps = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == ids_of("abc")
    for lp in lps:
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.top[0][0] == lp.token_id and len(lp.top) == 2
        assert lp.logprob == pytest.approx(10 - np.log(np.exp(10) + V - 1), abs=1e-5)


def test_per_token_work_does_not_grow_with_the_text():
    """A long generation with stop strings that never match: the held text stays within a stop's length
    and the last thousand steps take no longer than the first."""
    stops = ["zzzz", "the end of it all"]
    g = Generation([1], Tok(), params=SamplingParams(temperature=0), n_vocab=V, max_tokens=10**6, n_ctx=10**7,
                   stops=stops)
    rows = [onehot(t) for t in ids_of("the end of it al") + ids_of("abcdefghij")]
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        for i in range(1000):
            g.step(rows[i % len(rows)])
            assert len(g._held) < max(map(len, stops))
        times.append(time.perf_counter() - t0)
    assert not g.done and len(g.generated) == 12000
    assert min(times[-3:]) < 3 * min(times[:3]) + 0.05


def test_allowed_mask_restricts_every_step():
    g = Generation([1], Tok(), params=SamplingParams(temperature=0), n_vocab=V, max_tokens=5, n_ctx=100,
                   allowed=allowed_mask(ids_of("xy"), V))
    out = []
    while not g.done:
        d = g.step(onehot(ids_of("a")[0]))   # "a" is the best, but not allowed
        if d:
            out.append(d.text)
    assert set("".join(out)) <= set("xy")
    seen = []

    def only_after(generated):
        seen.append(len(generated))
        return allowed_mask([ids_of("q")[0]], V)

    g = Generation([1], Tok(), params=SamplingParams(temperature=0), n_vocab=V, max_tokens=3, n_ctx=100,
                   allowed=only_after)
    text = "".join(d.text for d in (g.step(onehot(1)), g.step(onehot(1)), g.step(onehot(1))) if d)
    assert text == "qqq" and seen == [0, 1, 2]


def test_timings_count_tokens_and_phases():
    t = Timings()
    run(ids_of("abcdef"), max_tokens=6, timings=t)
    assert t.tokens == 6 and t.seconds["sample"] > 0 and t.seconds["detokenize"] > 0
    t.engine, t.wall = 1.0, 2.0
    b = t.breakdown()
    assert b["forward"] == 1.0 and sum(b.values()) == pytest.approx(2.0)


def test_slot_table_prefers_the_slot_that_serves_the_prompt():
    t = SlotTable(3)
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    a = t.choose([1, 2, 3, 4])
    assert t.take(a, [1, 2, 3, 4]) == 0
    t.tokens[a][:] = [1, 2, 3, 4, 5]
    t.release(a)
    # the continuation of a's conversation goes back to a and reuses all of it but the last token
    assert t.choose([1, 2, 3, 4, 5, 6]) == a
    assert t.take(a, [1, 2, 3, 4, 5, 6]) == 5 and t.busy[a]
    # an identical prompt reuses all but its last token; cache_prompt=False reuses nothing
    t.release(a)
    assert t.take(a, [1, 2, 3, 4, 5]) == 4 and t.tokens[a] == [1, 2, 3, 4]
    t.release(a)
    assert t.take(a, [1, 2, 3, 4, 5], cache_prompt=False) == 0 and t.tokens[a] == []
    # a new prompt sharing nothing takes an empty slot rather than evicting a's cache
    t.release(a)
    t.tokens[a][:] = [1, 2, 3]
    assert t.choose([9, 9]) != a
    t.forget()
    assert t.tokens == [[], [], []]
