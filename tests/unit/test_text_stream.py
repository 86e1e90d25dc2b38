"""specdec.text.TextStream, the one incremental decoder of the CLI, the Python API and the
server, against decoding every token at once (the oracle): random answers pushed in random
steps over two tokenizers built here (byte-level BPE, where a character's bytes are separate
tokens, and SentencePiece-style byte fallback with a leading-space rule), stop strings never
released at or after their start, and a cost that grows linearly with the answer.

Bytes that never form a character (a stray byte, an answer cut inside a character) are
compared with byte-level BPE only: a byte-fallback decoder turns a whole run of byte tokens
into U+FFFD once one of them is invalid, so text shown earlier ("é" as two byte tokens) reads
differently once the run goes wrong; no incremental decoder can know that in advance (the
streamed text then differs from decoding at once in those replacement characters only)."""

from __future__ import annotations

import random

import pytest

from specdec.text import TextStream, stop_strings
from specdec.types import SpecdecError
from tiny_gguf import byte_symbols


def byte_level_tokenizer():
    """Byte-level BPE with a few merges: most characters are one token, while multi-byte characters
    are split into their bytes unless a merge joins them; id 300 is a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: b for b, symbol in enumerate(byte_symbols())}
    merges = []
    for word in ("he", "hel", "hell", "hello", "Ġw", "Ġwo"):
        left, right = (word[:-1], word[-1]) if len(word) > 2 or word[0] != "Ġ" else ("Ġ", word[1:])
        merges.append((left, right))
        vocab[word] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|end|>"])
    return tk


def byte_fallback_tokenizer():
    """SentencePiece-style: '▁' words, <0xNN> byte tokens, a decoder that strips the text's first
    space (the leading-space rule that makes a window's first token decode differently)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for w in ("▁", "▁hello", "▁world", "a", "b", "▁a", "7", "▁7", "."):
        vocab[w] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens(["</s>"])
    return tk


class Counting:
    """A tokenizer whose decode counts the token ids it reads."""

    def __init__(self, tok) -> None:
        self.tok, self.read, self.calls = tok, 0, 0

    def decode(self, ids, skip_special_tokens=False):
        self.read += len(ids)
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _valid_or_byte_level(tok, ids) -> bool:
    """Whether decoding at once is the oracle for these ids (see the module's docstring)."""
    return tok.get_vocab_size() > 300 or "\ufffd" not in tok.decode(ids, skip_special_tokens=True)


def _random_answer(tok, rng: random.Random, n: int) -> list[int]:
    texts = ["hello", " world", " a", "b", "é", "東京", "🙂", "7", ".", "\n", " 7, 8"]
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.1 and tok.get_vocab_size() > 300:  # a stray byte (byte-level BPE; see below)
            ids.append(rng.randrange(256))
        elif r < 0.13:
            ids.append(tok.token_to_id("<|end|>") or tok.token_to_id("</s>"))
        else:
            ids += tok.encode(rng.choice(texts), add_special_tokens=False).ids
    return ids[:n]


def _oracle(tok, ids: list[int], stops: list[str]) -> tuple[str, int]:
    """(the text cut at the stop string complete first, the fewest tokens whose text holds one)."""
    full = tok.decode(ids, skip_special_tokens=True)
    hits = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
    if not hits:
        return full, len(ids)
    used = next(n for n in range(1, len(ids) + 1)
                if any(s in tok.decode(ids[:n], skip_special_tokens=True) for s in stops))
    return full[:min(hits)[1]], used


def _stream(tok, ids, stops, rng, token_ends=False) -> tuple[TextStream, list[str]]:
    stream = TextStream(tok, stops, token_ends=token_ends)
    pieces, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 6)
        pieces.append(stream.push(ids[i:i + step]))
        i += step
    pieces.append(stream.finish())
    return stream, pieces


@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer])
def test_streamed_text_equals_decoding_at_once(make):
    """Random answers (split characters, stray bytes, special tokens) in random steps: the pieces add
    up to the whole decode; no piece ends inside a character that later tokens complete."""
    tok, rng = make(), random.Random(0)
    checked = 0
    for _ in range(300):
        ids = _random_answer(tok, rng, rng.randint(1, 40))
        if not _valid_or_byte_level(tok, ids):
            continue
        checked += 1
        stream, pieces = _stream(tok, ids, [], rng)
        assert "".join(pieces) == stream.text == tok.decode(ids, skip_special_tokens=True), ids
        assert stream.used_tokens == len(ids) and not stream.stopped
    assert checked > 150


@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer])
def test_stop_strings_are_never_released(make):
    """Stop strings taken from the answer itself (several per answer, overlapping, multi-byte): the
    text released before finish() never reaches the stop; in all, it is the text up to the stop
    complete first; used_tokens is the shortest prefix whose text holds it."""
    tok, rng = make(), random.Random(1)
    checked = 0
    for _ in range(300):
        ids = _random_answer(tok, rng, rng.randint(2, 40))
        full = tok.decode(ids, skip_special_tokens=True)
        if len(full) < 2 or not _valid_or_byte_level(tok, ids):
            continue
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(full))
            stop = full[a:a + rng.randint(1, 4)]
            if "\ufffd" not in stop:
                stops.append(stop)
        if not stops:
            continue
        want, used = _oracle(tok, ids, stops)
        stream, pieces = _stream(tok, ids, stops, rng)
        assert "".join(pieces) == stream.text == want, (ids, stops)
        assert stream.stopped and stream.used_tokens == used, (ids, stops, stream.used_tokens, used)
        checked += 1
    assert checked > 150


def test_text_is_held_back_only_while_it_could_become_a_stop_string():
    tok = byte_level_tokenizer()
    ids = tok.encode("say hello there\n\nbye", add_special_tokens=False).ids
    assert [tok.decode([t]) for t in ids] == ["s", "a", "y", " ", "hello", " ", "t", "he", "r", "e", "\n", "\n",
                                              "b", "y", "e"]
    stream = TextStream(tok, ["hello world", "\n\n"])
    out = [stream.push([t]) for t in ids]
    # 'hello', 'hello ' and 'he' could each still become 'hello world'; a single newline '\n\n'
    assert out == ["s", "a", "y", " ", "", "", "hello t", "", "her", "e", "", "", "", "", ""]
    assert stream.stopped and stream.push(tok.encode(" more", add_special_tokens=False).ids) == ""
    assert stream.finish() == "" and stream.text == "say hello there" and stream.used_tokens == 12
    unfinished = TextStream(tok, ["hello world"])
    assert unfinished.push(ids[:5]) == "say " and unfinished.finish() == "hello"  # the answer ended: no stop


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    tok = byte_level_tokenizer()
    ids = tok.encode("a🙂b", add_special_tokens=False).ids
    assert len(ids) == 6  # a, the emoji's four bytes, b
    stream = TextStream(tok)
    assert [stream.push([t]) for t in ids] == ["a", "", "", "", "🙂", "b"]
    cut = TextStream(tok)
    assert cut.push(ids[:3]) == "a" and cut.finish() == "\ufffd"  # an answer that ends inside it: as decode shows it
    assert cut.text == tok.decode(ids[:3])


def test_stop_strings_empty_duplicate_and_unreadable():
    assert stop_strings(["", "x", "x", "", "yz"]) == ["x", "yz"]
    assert stop_strings(None) == []
    with pytest.raises(SpecdecError, match="surrogate"):
        stop_strings(["ok", "a\ud800"])
    tok = byte_level_tokenizer()
    stream = TextStream(tok, [""])  # an empty stop string is ignored, not a hold-back of -1
    ids = tok.encode("1, 2, 3", add_special_tokens=False).ids
    assert "".join(stream.push([t]) for t in ids) + stream.finish() == "1, 2, 3" and not stream.stopped


def test_token_ends_locate_each_token():
    """token_ends: where each token's text ends (as len(decode(tokens[:n])) counts it), and
    tokens_within(chars) the tokens wholly inside the first chars characters."""
    tok, rng = byte_level_tokenizer(), random.Random(2)
    for _ in range(50):
        ids = _random_answer(tok, rng, rng.randint(1, 30))
        stream, _ = _stream(tok, ids, [], rng, token_ends=True)
        want = [len(tok.decode(ids[:n + 1], skip_special_tokens=True)) for n in range(len(ids))]
        assert stream.ends == [max(want[:n + 1]) for n in range(len(ids))]
        for chars in range(len(stream.text) + 1):
            assert stream.tokens_within(chars) == next(
                (n for n in range(len(ids)) if want[n] > chars), len(ids))


@pytest.mark.parametrize("token_ends", [False, True])
def test_decoding_work_grows_linearly_with_the_answer(token_ends):
    """Tokens read by decode for an answer pushed one token a time (a plain decode) and four at a
    time (speculative steps), with a stop string: bounded per token, so doubling the answer
    doubles the work (re-decoding the whole answer each step, as the API did, reads n^2 / 2)."""
    base = byte_level_tokenizer()
    words = base.encode("hello world, 東京 and 🙂 again. " * 200, add_special_tokens=False).ids
    reads = {}
    for n in (1000, 2000):
        for step in (1, 4):
            tok = Counting(base)
            stream = TextStream(tok, ["never appears", "\n\n"], token_ends=token_ends)
            for i in range(0, n, step):
                stream.push(words[i:i + step])
            stream.finish()
            assert stream.text == base.decode(words[:n])
            reads[n, step] = tok.read
            assert tok.read <= 40 * n, (n, step, tok.read)  # quadratic would read ~n * n / 2
    for step in (1, 4):
        assert reads[2000, step] <= 2.2 * reads[1000, step], reads


def test_hold_back_is_bounded_on_repetitive_text():
    """A stop string that repetitive text keeps almost matching ('aaaa...b'): still found when it
    comes, never released, and the hold-back check stays a few comparisons per push."""
    tok = byte_level_tokenizer()
    stop = "a" * 50 + "b"
    ids = tok.encode("x" + "a" * 300 + "b tail", add_special_tokens=False).ids
    stream = TextStream(tok, [stop])
    out = "".join(stream.push([t]) for t in ids) + stream.finish()
    assert out == stream.text == "x" + "a" * 250 and stream.stopped


def test_reached_stop_keeps_the_text_for_the_next_push():
    """As the scheduler's stop_fn (given the whole answer so far), it pushes what it has not seen;
    that text comes out of the next push or finish, so a stream misses nothing."""
    tok = byte_level_tokenizer()
    ids = tok.encode("one two three four", add_special_tokens=False).ids
    stream = TextStream(tok, ["three"])
    assert stream.push(ids[:3]) == "one"
    assert not stream.reached_stop(ids[:7])  # 'one two' seen by the stop check only
    assert stream.push(ids[7:9]) == " two "  # 'th' could still become 'three'
    assert stream.reached_stop(ids) and stream.finish() == "" and stream.text == "one two "
