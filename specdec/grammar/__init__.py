"""Structured output: a grammar over the target's vocabulary, enforced token by token.

`grammar_for(tokenizer, vocab_size, eos_ids, spec)` compiles a `GrammarSpec` (any JSON
object, a JSON schema, or a Lark grammar such as a tool call's) once per tokenizer and grammar
and returns a `Grammar`; `Grammar.constraint()` gives one request its own `Constraint`: the set
of tokens allowed after the committed text (`allowed`, for every path of a speculative step,
rolled back after), the tokens the grammar forces (`forced`, a jump-forward draft that cannot
fail), and whether the text is complete (`finished`). The engine is llguidance (chosen by
measurement: docs/design.md, "Structured output"). A schema that is invalid, or uses a keyword
the engine does not implement, raises SpecdecError naming it (the server's 400).
"""

from __future__ import annotations

from .constraint import Constraint, Grammar, GrammarSpec, grammar_for, json_object, json_schema, lark, lark_json

__all__ = ["Constraint", "Grammar", "GrammarSpec", "grammar_for", "json_object", "json_schema", "lark", "lark_json"]
