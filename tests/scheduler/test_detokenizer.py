"""IncrementalDetokenizer and StopStringMatcher: whole characters, stop
strings, bounded decoding windows, on the default model's tokenizer and on
small hand-built tokenizers."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitney.scheduler.core.detokenizer import DetokenizerUpdate, IncrementalDetokenizer, StopStringMatcher
from jitney.common.model_files import cache_root, load_tokenizer, resolve_model

MULTILINGUAL = [
    "héllo 世界 🚀🎉 naïve",
    "Привет, мир! Ça va? Größe",
    "日本語のテキストと한국어 텍스트",
    "emoji zwj: 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "math ∑∫√∞ ≠ ≤ arrows ←→ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]
ALPHABET = st.sampled_from(list("ab cd,.!\n日本世界é🚀🎉👍🏽ñ€𝔘")) | st.characters(codec="utf-8")
TEXT = st.text(alphabet=ALPHABET, max_size=40)


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(resolve_model(None), cache_root())


def encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def run(tok: Any, prompt: list[int], ids: list[int], stop: tuple[str, ...] = (),
        step: int = 1) -> tuple[list[str], str, bool]:
    """Push ``ids`` ``step`` at a time; return (chunks, all text, stopped)."""
    d = IncrementalDetokenizer(tok, prompt, stop)
    chunks, stopped = [], False
    for i in range(0, len(ids), step):
        update = d.push(ids[i:i + step])
        chunks.append(update.text)
        stopped = update.stopped
    if not stopped:
        chunks.append(d.flush())  # may match a stop in the last characters
    assert d.full_text == "".join(chunks)
    return chunks, "".join(chunks), d.stopped


# ---- whole characters, equality with tokenizer.decode ----------------------


@pytest.mark.parametrize("text", MULTILINGUAL)
@pytest.mark.parametrize("prompt", ["", "Say it:", "世"])
def test_concatenation_equals_decode(tok: Any, text: str, prompt: str) -> None:
    ids = encode(tok, text)
    chunks, out, _ = run(tok, encode(tok, prompt), ids)
    assert out == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in c for c in chunks)


def test_split_character_is_held_back(tok: Any) -> None:
    ids = encode(tok, "a🚀b")
    assert len(ids) > 3, "the emoji should span several byte-level tokens"
    assert [c for c in run(tok, [], ids)[0] if c] == ["a", "🚀", "b"]
    d = IncrementalDetokenizer(tok, [], ())
    assert d.push(ids[:3]).text == "a"  # a push emits up to its last boundary
    assert d.push(ids[3:]).text == "🚀b"


@settings(max_examples=150, deadline=None)
@given(text=TEXT, prompt=TEXT, step=st.integers(1, 3))
def test_random_text_round_trips(tok: Any, text: str, prompt: str, step: int) -> None:
    ids = encode(tok, text)
    chunks, out, _ = run(tok, encode(tok, prompt), ids, step=step)
    full = tok.decode(ids, skip_special_tokens=True)
    assert out == full
    # (A few rare code points do not survive the GGUF vocabulary.)
    assert all("\ufffd" not in c for c in chunks) or "\ufffd" in full


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=30), step=st.integers(1, 4))
def test_random_ids_round_trip(tok: Any, ids: list[int], step: int) -> None:
    _, out, _ = run(tok, [], ids, step=step)
    assert out == tok.decode(ids, skip_special_tokens=True)


def test_invalid_bytes_then_a_valid_character(tok: Any) -> None:
    lead_byte = tok.convert_tokens_to_ids("ð")  # 0xF0: opens a 4-byte char
    ids = [lead_byte] * 12 + encode(tok, "🚀 ok")
    chunks, out, _ = run(tok, [], ids)
    assert out == tok.decode(ids) and out.endswith("🚀 ok")


def test_incomplete_tail_is_flushed_as_replacement_char(tok: Any) -> None:
    ids = encode(tok, "ok 🚀")[:-1]  # cut the emoji's last byte(s)
    d = IncrementalDetokenizer(tok, [], ())
    pushed = "".join(d.push([t]).text for t in ids)
    assert "\ufffd" not in pushed
    tail = d.flush()
    assert tail.endswith("\ufffd") and pushed + tail == tok.decode(ids)


def test_prompt_ending_mid_character(tok: Any) -> None:
    ids = encode(tok, "x世界")
    _, out, _ = run(tok, ids[:2], ids[2:])  # the prompt ends inside '世'
    assert out == tok.decode(ids[2:])


def test_leading_space_byte_level(tok: Any) -> None:
    hello, world = encode(tok, " hello world")
    assert tok.convert_ids_to_tokens([hello])[0] == "Ġhello"
    assert run(tok, [], [hello, world])[0][:2] == [" hello", " world"]
    assert run(tok, encode(tok, "Say"), [hello, world])[0][:2] == [" hello", " world"]


def test_special_tokens_skipped_or_kept(tok: Any) -> None:
    ids = [*encode(tok, "hi"), tok.eos_token_id, *encode(tok, " there")]
    assert run(tok, [], ids)[1] == "hi there"
    d = IncrementalDetokenizer(tok, [], (), skip_special_tokens=False)
    out = "".join(d.push([t]).text for t in ids) + d.flush()
    assert out == "hi" + tok.eos_token + " there"


# ---- SentencePiece-style ('▁') tokenizer with byte fallback ---------------


@pytest.fixture(scope="module")
def sp_tok() -> Any:
    """A tiny Llama-like tokenizer: '▁' for spaces, the first token's leading
    space stripped on decode, <0xNN> byte-fallback pieces."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁hello", "▁world", "hello", ",", "!"]:
        vocab[piece] = len(vocab)
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    model.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def sp_ids(sp_tok: Any, *pieces: str) -> list[int]:
    """Ids of vocabulary pieces; "bytes:TEXT" spells TEXT in <0xNN> pieces."""
    names = [[f"<0x{b:02X}>" for b in p[6:].encode()] if p.startswith("bytes:") else [p]
             for p in pieces]
    return [sp_tok.convert_tokens_to_ids(n) for group in names for n in group]


def test_sentencepiece_first_token_and_mid_sequence(sp_tok: Any) -> None:
    ids = sp_ids(sp_tok, "▁hello", "▁world", ",", "▁world")
    assert sp_tok.decode(ids[1:2]) == "world", "the decoder strips a leading space"
    chunks, out, _ = run(sp_tok, [], ids)
    assert out == sp_tok.decode(ids) == "hello world, world"
    assert chunks[:4] == ["hello", " world", ",", " world"]
    # After a prompt the first output token keeps its space.
    chunks, out, _ = run(sp_tok, sp_ids(sp_tok, "hello"), ids[1:])
    assert chunks[0] == " world" and out == " world, world"


def test_sentencepiece_byte_fallback(sp_tok: Any) -> None:
    ids = sp_ids(sp_tok, "▁hello", "▁", "bytes:世🚀", "!")
    chunks, out, _ = run(sp_tok, [], ids)
    assert out == sp_tok.decode(ids) == "hello 世🚀!"
    assert [c for c in chunks if c] == ["hello", " ", "世", "🚀", "!"]


# ---- bounded window --------------------------------------------------------


class RecordingTokenizer:
    """Wraps a tokenizer, recording the longest id list given to decode."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.longest = inner, 0
        self.all_special_ids, self.added_tokens_decoder = inner.all_special_ids, inner.added_tokens_decoder

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return str(self.inner.decode(ids, **kwargs))


@pytest.mark.parametrize("kind", ["text", "specials", "invalid-bytes"])
def test_window_stays_bounded(tok: Any, kind: str) -> None:
    lead_byte = tok.convert_tokens_to_ids("ð")  # 0xF0: opens a 4-byte char
    ids = {
        "text": encode(tok, "héllo 世界 🚀🎉 " * 200),
        "specials": [tok.eos_token_id] * 2000 + encode(tok, "end"),
        "invalid-bytes": [lead_byte] * 2000 + encode(tok, "end"),
    }[kind]
    rec = RecordingTokenizer(tok)
    _, out, _ = run(rec, encode(tok, "prompt " * 50), ids)
    assert rec.longest <= 20
    assert out == tok.decode(ids, skip_special_tokens=True)


# ---- stop strings ----------------------------------------------------------


class CharTokenizer:
    """One token per character: id = code point. No special tokens."""

    all_special_ids: list[int] = []
    added_tokens_decoder: dict[int, Any] = {}

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(map(chr, ids))


def char_run(text: str, stop: tuple[str, ...]) -> tuple[list[str], bool, str]:
    """Push ``text`` one character at a time: (chunks, stopped, flushed)."""
    d = IncrementalDetokenizer(CharTokenizer(), [], stop)
    chunks = [d.push([ord(c)]).text for c in text]
    return chunks, d.stopped, "" if d.stopped else d.flush()


@pytest.mark.parametrize(
    ("text", "stop", "emitted"),
    [
        ("hello world", ("wor",), "hello "),          # across tokens
        ("hello world", ("h",), ""),                  # at the very start
        ("abcabd", ("abd",), "abc"),                  # a false start first
        ("aaab", ("aab",), "a"),                      # overlapping prefixes
        ("x end y", ("end", "x"), ""),
        ("x end y", ("y", "end"), "x "),
        ("12345", ("34", "2345"), "12"),              # the first to complete wins
        ("abcd", ("abcd", "bc"), "a"),
    ],
)
def test_stop_string_truncates(text: str, stop: tuple[str, ...], emitted: str) -> None:
    chunks, stopped, _ = char_run(text, stop)
    assert stopped and "".join(chunks) == emitted


def test_partial_stop_is_held_then_released() -> None:
    chunks, stopped, flushed = char_run("say STOx and STO", ("STOP",))
    assert not stopped
    assert chunks[4:7] == ["", "", ""]                # 'S', 'T', 'O' held
    assert chunks[7] == "STOx"                        # released on mismatch
    assert flushed == "STO" and "".join(chunks) + flushed == "say STOx and STO"


@pytest.mark.parametrize("stop", [("abcdef",), ("bcdex", "abcdef", "zz")])
def test_holdback_is_bounded(stop: tuple[str, ...]) -> None:
    longest = max(map(len, stop))
    text = "abcde" * 3
    chunks, stopped, flushed = char_run(text, stop)
    assert not stopped and "".join(chunks) + flushed == text
    for i in range(len(text)):
        held = (i + 1) - len("".join(chunks[: i + 1]))
        assert held <= longest - 1


def test_stop_in_one_multi_char_token(tok: Any) -> None:
    ids = encode(tok, "The answer is 42. Done")
    chunks, out, stopped = run(tok, [], ids, stop=("answer",))
    assert stopped and out == "The "


def test_push_after_stop_is_empty(tok: Any) -> None:
    d = IncrementalDetokenizer(tok, [], ("lo",))
    ids = encode(tok, "hello there")
    updates = [d.push([t]) for t in ids]
    assert any(u.stopped for u in updates) and updates[-1] == DetokenizerUpdate("", True)
    assert d.stopped and d.flush() == "" and d.full_text == "hel"


@settings(max_examples=150, deadline=None)
@given(text=TEXT, data=st.data(), step=st.integers(1, 3))
def test_random_stop_strings(tok: Any, text: str, data: st.DataObject, step: int) -> None:
    ids = encode(tok, text)
    full = tok.decode(ids)
    stops = tuple(data.draw(st.lists(
        st.text(min_size=1, max_size=4).filter(lambda s: "\ufffd" not in s)
        | st.integers(0, max(len(full) - 1, 0)).flatmap(
            lambda i: st.integers(i + 1, i + 5).map(lambda j: full[i:j] or "x")),
        min_size=1, max_size=3)))
    # The stop that completes first (ties: the longest) cuts the text.
    found = [(i + len(s), i) for s in stops if (i := full.find(s)) >= 0]
    chunks, out, stopped = run(tok, [], ids, stop=stops, step=step)
    assert stopped == bool(found)
    assert out == (full[:min(found)[1]] if found else full)


def test_matcher_rejects_empty_stop() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(("ok", ""))
