"""specdec.grammar: the constraint over the default model's vocabulary (its tokenizer only, no
weights), checked against independent oracles: the JSON parser and `jsonschema` for every text
the constraint lets through, a fresh constraint advanced token by token for every row of a
tree step, and a brute-force count of the legal tokens for `forced`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")

from specdec.grammar import grammar_for, json_object, json_schema  # noqa: E402
from specdec.types import SpecdecError  # noqa: E402

DEV = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "json_extraction.jsonl"

BOUNDED = {  # every text it allows is short, so a walk of random legal tokens ends
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["a", "bb", "ccc"]},
        "n": {"type": "integer", "minimum": -5, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "inner": {"type": "object", "properties": {"x": {"type": "null"}, "y": {"type": "string", "maxLength": 2}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["name", "kind", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    from specdec.models.gguf_file import GGUFFile
    from specdec.models.loader import cache_root, default_model_path
    from specdec.models.tokenizer import gguf_tokenizer

    return gguf_tokenizer(GGUFFile(default_model_path()), cache_root() / "tokenizers", quiet=True)


def legal(constraint) -> list[int]:
    """The tokens allowed at the pending position (numpy: torch's small ops are slow on a busy machine)."""
    return np.flatnonzero(constraint.allowed([[]])[0].numpy()).tolist()


def compile_(tok, spec):
    return grammar_for(tok, len(tok), [tok.eos_token_id], spec)


_ONE_CHAR: dict = {}


def single_char_tokens(tok) -> np.ndarray:
    """[V] bool: the tokens that are one character."""
    if id(tok) not in _ONE_CHAR:
        _ONE_CHAR[id(tok)] = np.array([len(tok.decode([i])) == 1 for i in range(len(tok))])
    return _ONE_CHAR[id(tok)]


def walk(tok, constraint, rng: random.Random, steps: int, short: bool = False) -> list[int] | None:
    """Random legal tokens until only the end is left (None if `steps` ran out). `short`:
    prefer one-character tokens, so that strings and nesting close within the budget."""
    ids = []
    one_char = single_char_tokens(tok) if short else None
    for _ in range(steps):
        if constraint.finished():
            return ids
        mask = constraint.allowed([[]])[0].numpy()
        assert mask.any(), "a state with nothing allowed"
        if short and rng.random() < 0.9 and (mask & one_char).any():
            mask = mask & one_char
        allowed = np.flatnonzero(mask)
        t = int(allowed[rng.randrange(len(allowed))])
        assert t != tok.eos_token_id, "the end was allowed before the text was complete"
        constraint.advance([t])
        ids.append(t)
    return None


def test_every_walk_the_schema_allows_parses_and_validates(tok):
    grammar = compile_(tok, json_schema(BOUNDED))
    rng = random.Random(0)
    for _ in range(12):
        c = grammar.constraint()
        ids = walk(tok, c, rng, 400)
        assert ids is not None, "a bounded schema's walk did not end"
        value = json.loads(tok.decode(ids))
        jsonschema.validate(value, BOUNDED)
        assert legal(c) == [tok.eos_token_id]


def test_json_object_walks_are_objects(tok):
    grammar = compile_(tok, json_object())
    rng = random.Random(1)
    ended = 0
    for _ in range(12):
        ids = walk(tok, grammar.constraint(), rng, 300, short=True)
        if ids is not None:
            ended += 1
            assert isinstance(json.loads(tok.decode(ids)), dict)
    assert ended >= 4


@pytest.mark.parametrize("row", [json.loads(line) for line in DEV.read_text().splitlines()[:8]], ids=lambda r: r["id"])
def test_the_dev_set_answers_are_allowed_and_a_broken_one_is_not(tok, row):
    grammar = compile_(tok, json_schema(row["schema"]))
    ids = tok.encode(json.dumps(row["answer"], ensure_ascii=False), add_special_tokens=False)
    c = grammar.constraint()
    assert c.accepts(ids) == len(ids)
    c.advance(ids)
    assert c.finished()
    broken = tok.encode(json.dumps({**row["answer"], "extra_field": 1}, ensure_ascii=False), add_special_tokens=False)
    assert grammar.constraint().accepts(broken) < len(broken)  # additionalProperties: false


def test_allowed_rows_equal_a_fresh_constraint_and_roll_back(tok):
    """Each row of a tree step equals a constraint advanced along that path alone; the state is
    unchanged after (the next step's rows are the same), off-grammar paths included."""
    grammar = compile_(tok, json_schema(BOUNDED))
    text = '{"name": "ab", "kind": "bb", "n": 7}'
    ids = tok.encode(text, add_special_tokens=False)
    c = grammar.constraint()
    c.advance(ids[:2])
    before = c.allowed([[]])
    rest = ids[2:]
    off = tok.encode("zzz", add_special_tokens=False)
    paths = [[], rest[:1], rest[:2], rest[:3], rest[:1] + off, rest[:2] + [rest[5]], rest + [tok.eos_token_id], rest[:2]]
    rows = c.allowed(paths)
    assert rows.shape == (len(paths), len(tok)) and rows.dtype == torch.bool
    for i, path in enumerate(paths):
        fresh = grammar.constraint()
        fresh.advance(ids[:2])
        if fresh.accepts(path) == len(path) and tok.eos_token_id not in path:
            fresh.advance(path)
            assert torch.equal(rows[i], fresh.allowed([[]])[0]), i
        else:  # never reached by verification: all allowed, so masked logits stay finite
            assert bool(rows[i].all()), i
    assert torch.equal(c.allowed([[]]), before)
    c.forced(8)
    assert torch.equal(c.allowed([[]]), before)
    c.advance(rest)  # and the committed state still takes the rest of the text
    assert c.finished()


def test_forced_tokens_are_exactly_those_with_one_legal_choice(tok):
    schema = {"type": "object", "properties": {"temperature_celsius": {"type": "integer"},
                                               "unit": {"const": "celsius"}},
              "required": ["temperature_celsius", "unit"], "additionalProperties": False}
    grammar = compile_(tok, json_schema(schema))
    ids = tok.encode('{"temperature_celsius": 21, "unit": "celsius"}', add_special_tokens=False) + [tok.eos_token_id]
    c = grammar.constraint()
    seen_forced = 0
    for i, t in enumerate(ids):
        choices = legal(c)
        f = c.forced(4)
        if len(choices) == 1:
            seen_forced += 1
            assert f[:1] == choices
            probe = grammar.constraint()  # the rest of the chain: one legal choice at each step, too
            probe.advance(ids[:i])
            for g in f:
                assert legal(probe) == [g]
                probe.advance([g])
        else:
            assert f == []
        assert t in choices
        if t != tok.eos_token_id:
            c.advance([t])
    assert seen_forced >= 1  # the end-of-sequence token at least
    assert c.forced(3) == [tok.eos_token_id]


def brute_forced(grammar, prefix: list[int], limit: int) -> list[int]:
    """The forced chain by brute force: a fresh constraint's whole mask, one legal choice each."""
    probe = grammar.constraint()
    probe.advance(prefix)
    out: list[int] = []
    while len(out) < limit:
        choices = legal(probe)
        if len(choices) != 1:
            break
        out += choices
        if choices[0] == probe.vocab.eos[0]:
            break
        probe.advance(choices)
    return out


@pytest.mark.parametrize("row", [json.loads(line) for line in DEV.read_text().splitlines()[:4]], ids=lambda r: r["id"])
def test_forced_equals_brute_force_along_a_dev_answer_and_random_walks(tok, row):
    """`forced` skips the mask where the next byte has a choice and reads the mask's words
    without unpacking them: along a dev-set answer and random legal walks it gives exactly the
    brute-force chain of one-choice masks."""
    grammar = compile_(tok, json_schema(row["schema"]))
    answer = tok.encode(json.dumps(row["answer"], ensure_ascii=False), add_special_tokens=False)
    rng = random.Random(2)
    walks = [answer] + [walk(tok, grammar.constraint(), rng, 60, short=True) or [] for _ in range(2)]
    checked = forced = 0
    for ids in walks:
        c = grammar.constraint()
        for i in range(len(ids) + 1):
            got = c.forced(6)
            assert got == brute_forced(grammar, ids[:i], 6), (row["id"], i)
            checked += 1
            forced += bool(got)
            if i < len(ids):
                c.advance(ids[i : i + 1])
    assert forced >= 3 and checked > forced


def test_allows_equals_the_mask_at_each_path(tok):
    """`allows` (one token checked per path) says what `allowed`'s row says of that token: on
    the grammar's own tokens, forbidden ones, the end-of-sequence token mid-text and at the end,
    and paths that leave the grammar."""
    grammar = compile_(tok, json_schema(BOUNDED))
    ids = tok.encode('{"name": "ab", "kind": "bb", "n": 7}', add_special_tokens=False)
    c = grammar.constraint()
    c.advance(ids[:1])
    rest, eos = ids[1:], tok.eos_token_id
    off = tok.encode("zzz", add_special_tokens=False)
    rng = random.Random(3)
    paths = [rest[:j] for j in range(len(rest) + 1)] + [rest[:2] + off, rest[:1] + [eos]]
    tokens = [rest[j] if j < len(rest) else eos for j in range(len(rest) + 1)] + [rest[2], rest[1]]
    paths += [rest[: rng.randrange(len(rest))] for _ in range(12)]
    tokens += [rng.randrange(len(tok)) for _ in range(12)]
    paths += [[], rest[:3]]
    tokens += [eos, eos]
    got = c.allows(paths, tokens)
    mask = c.allowed(paths)
    want = [bool(mask[i, t]) for i, t in enumerate(tokens)]
    assert got == want
    assert got[: len(rest) + 1] == [True] * (len(rest) + 1) and not got[-1] and not got[-2]
    assert not all(got) and torch.equal(c.allowed([[]]), mask[:1])  # rolled back


@pytest.mark.parametrize("schema,needle", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not'"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "'if', 'then'"),
    ({"type": "strng"}, "strng"),
    ({"$ref": "#/$defs/missing"}, "missing"),
])
def test_an_invalid_or_unsupported_schema_is_one_clear_error(tok, schema, needle):
    with pytest.raises(SpecdecError) as e:
        compile_(tok, json_schema(schema, what="response_format.json_schema"))
    message = str(e.value)
    assert needle in message and "\n" not in message and message.startswith("response_format.json_schema")


def test_a_bad_schema_inside_a_tool_grammar_is_one_line_without_the_grammar(tok):
    """A tool's parameters with an invalid type: the error names it, in one line, without the Lark
    grammar specdec wraps the calls in (the engine lists that grammar and a position in it)."""
    from specdec.grammar import lark
    from specdec.tools import HERMES, ToolSyntax, call_grammar

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    grammar = call_grammar(tools, None, True, ToolSyntax(HERMES, native=False), tok)
    with pytest.raises(SpecdecError) as e:
        compile_(tok, lark(grammar, what="tools"))
    message = str(e.value)
    assert message.startswith("tools: ") and "objekt" in message and "\n" not in message
    assert "%json" not in message and "start:" not in message and "at 3(" not in message


def test_a_schema_is_compiled_once(tok):
    a = compile_(tok, json_schema(BOUNDED))
    b = compile_(tok, json_schema(json.loads(json.dumps(BOUNDED))))
    assert a._matcher is b._matcher
    c1, c2 = a.constraint(), a.constraint()
    c1.advance(tok.encode('{"name": "x', add_special_tokens=False))
    assert not torch.equal(c1.allowed([[]]), c2.allowed([[]]))  # each request has its own state
