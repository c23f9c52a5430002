"""Incremental detokenization on the default model's byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from engine.core.detokenizer import TextStream
from engine.models.default_model import default_model_path
from engine.tokenizer import load_tokenizer

# Characters the tokenizer never saw in training: each is several byte-level tokens.
TEXT = "Ωμέγα Привет 中国 🎉🌍 ñandú ßøå"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(default_model_path()))


def test_multibyte_characters_never_break_mid_stream(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 3  # emoji and CJK are split over several byte tokens
    stream = TextStream(tok, tok.encode("Hello"))
    pieces = [stream.add([t])[0] for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.finish() == TEXT
    assert any(p == "" for p in pieces)  # some tokens had to wait for the rest of a character


def test_stop_string_across_tokens_is_cut_and_held_back(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    stream = TextStream(tok, [0], stop=["中国"])
    emitted, stop = "", None
    for t in ids:
        delta, stop = stream.add([t])
        emitted += delta
        assert "中" not in emitted or stop is not None  # a possible stop prefix is held back
        if stop:
            break
    assert stop == "中国" and emitted == "Ωμέγα Привет "
    assert stream.add([ids[-1]]) == ("", "中国")


def test_include_stop_string_and_earliest_match_wins(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    stream = TextStream(tok, [0], stop=["ñandú", "🌍"], include_stop_str_in_output=True)
    out = ""
    for t in ids:
        delta, stop = stream.add([t])
        out += delta
        if stop:
            break
    assert stop == "🌍" and out == "Ωμέγα Привет 中国 🎉🌍"


def test_rust_decode_is_transformers_decode(tok):
    """Streams decode through the Rust tokenizer directly where that gives transformers'
    text: every window of ids, special tokens kept or skipped; a tokenizer that cleans up
    spaces keeps transformers' own decode."""
    import copy

    from engine.core.detokenizer import backend_decode

    fast = backend_decode(tok)
    assert fast is not None and TextStream(tok, [0])._fast == fast
    ids = list(range(len(tok)))
    for skip in (True, False):
        for i in range(0, len(ids), 5):
            window = ids[i : i + 11]
            assert fast(window, skip_special_tokens=skip) == tok.decode(
                window, skip_special_tokens=skip)
    cleaning = copy.copy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert backend_decode(cleaning) is None and TextStream(cleaning, [0])._fast is None
