"""The request fields that shape an answer or draft it: `response_format` and `tool_choice`
(a grammar the answer must follow), `tools` (rendered by the model's template, the answer's
tool calls parsed into OpenAI's `tool_calls`), and `prediction` (OpenAI's Predicted Outputs: a
draft for the answer). `prepare` turns them into a `Shaping` the batcher request carries
(`Request.prediction`, `Request.constraint`); `message`, `tool_deltas`, `usage_details` and
`speculation` shape the answer.
"""

from __future__ import annotations

import asyncio
import difflib
from dataclasses import dataclass

from .. import grammar as gr
from ..tools import ToolParser, ToolSyntax, call_grammar, render_messages, syntax_for
from ..types import SpecdecError
from .errors import APIError


@dataclass
class Shaping:
    grammar: gr.Grammar | None = None  # every choice gets its own Constraint from it
    prediction: list[int] | None = None  # the predicted answer, tokenised
    tools: ToolSyntax | None = None  # parse tool calls out of the answer (chat with tools, not "none")

    def constraint(self):
        return self.grammar.constraint() if self.grammar is not None else None


def chat_messages(state, body) -> tuple[list[dict], list[dict] | None, ToolSyntax | None]:
    """(messages for the template, tools for the template, the syntax to parse) of a chat body."""
    messages = [{**m.model_dump(exclude_none=True, by_alias=True), "content": m.text()} for m in body.messages]
    mode = body.tool_mode()
    calls_in = any(m.get("tool_calls") for m in messages) or any(m["role"] == "tool" for m in messages)
    if mode is None and not calls_in:
        return messages, None, None
    try:
        syntax = syntax_for(getattr(state.text.tok, "chat_template", None))
        messages, tools = render_messages(messages, body.tool_dicts() if mode else None, syntax)
    except SpecdecError as e:
        raise APIError(400, str(e), param="tools") from None
    return messages, tools, syntax if mode else None


def _grammar_spec(state, body, syntax: ToolSyntax | None) -> gr.GrammarSpec | None:
    fmt = body.response_format
    wants_json = fmt is not None and fmt.type != "text"
    mode = body.tool_mode() if hasattr(body, "tool_mode") else None
    if mode in ("required", "named"):
        if wants_json:
            raise APIError(400, "'response_format' asks for JSON but 'tool_choice' asks for a tool call; use one",
                           param="response_format")
        name = body.tool_choice.function.name if mode == "named" else None
        text = call_grammar(body.tool_dicts(), name, body.parallel_tool_calls, syntax, state.text.tok)
        return gr.lark(text, "tools")
    if not wants_json:
        return None
    if fmt.type == "json_object":
        return gr.json_object("response_format")
    return gr.json_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")


def _compile(state, spec: gr.GrammarSpec) -> gr.Grammar:
    lm = state.lm
    return gr.grammar_for(state.text.tok, lm.model.vocab_size, lm.eos_ids, spec)


async def prepare(state, body, syntax: ToolSyntax | None = None) -> Shaping:
    """The grammar (compiled off the event loop: a tokenizer's first grammar reads its whole
    vocabulary, 1-6 s), the tokenised prediction and the tool syntax of a request; a 400 for a
    schema the engine refuses, naming it."""
    shaping = Shaping(tools=syntax)
    spec = _grammar_spec(state, body, syntax)
    if spec is not None:
        try:
            shaping.grammar = await asyncio.to_thread(_compile, state, spec)
        except SpecdecError as e:
            raise APIError(400, str(e), param=spec.what.split(".")[0]) from None
    if body.prediction is not None:
        text = body.prediction.text()
        state.text.check_prompt_text([text], "prediction")
        shaping.prediction = state.text.tok.encode(text, add_special_tokens=False) if text else []
    return shaping


def tool_text(state, tokens: list[int], stops: list[str]) -> str:
    """An answer's text for the tool-call parser: special tokens kept ([TOOL_CALLS],
    <|python_tag|> are special in their vocabularies), the end-of-sequence token dropped, cut at
    a stop string."""
    eos = set(state.lm.eos_ids)
    text = state.text.decode([t for t in tokens if t not in eos], special=True)
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text


def message(state, tokens: list[int], stops: list[str], reason: str, syntax: ToolSyntax) -> tuple[dict, str]:
    """A chat choice's message with its tool calls parsed, and its finish reason ("tool_calls"
    when the answer called a tool and was not cut short)."""
    content, calls = ToolParser(syntax).parse(tool_text(state, tokens, stops))
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.openai() for c in calls]
        if reason == "stop":
            reason = "tool_calls"
    return msg, reason


def tool_deltas(state, parser: ToolParser, tokens: list[int], stops: list[str], final: bool) -> list[dict]:
    """The chat deltas of an answer with tools so far (content, then each call's id and name, then
    its arguments in pieces), as OpenAI streams them."""
    text = tool_text(state, tokens, stops)
    if not final and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
        return []
    return parser.feed(text, final)


def usage_details(state, prediction: list[int] | None, answers: list[str]) -> dict:
    """OpenAI's `completion_tokens_details` for a request with a prediction: the prediction's
    tokens that appear in the answer (in order: the matching blocks of a diff against the
    answer's text tokenised as the prediction was, so a prediction equal to the answer counts
    whole however the model spelled it), and those that do not, summed over the choices."""
    if prediction is None:
        return {}
    accepted = rejected = 0
    for answer in answers:
        tokens = state.text.tok.encode(answer, add_special_tokens=False) if answer else []
        matcher = difflib.SequenceMatcher(None, prediction, tokens, autojunk=False)
        kept = sum(b.size for b in matcher.get_matching_blocks())
        accepted += kept
        rejected += len(prediction) - kept
    return {"completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def speculation(stats: list[dict]) -> dict:
    """The request's speculation figures in vLLM's shape (`metrics.speculative_decoding`: draft
    tokens verified and accepted, verification steps, acceptance rate, mean tokens a step), summed
    over its choices, with per draft source counts (`by_method`: the scheduler's `sources`)."""
    drafted = sum(s.get("proposed", 0) for s in stats)
    accepted = sum(s.get("accepted", 0) for s in stats)
    steps = sum(s.get("forwards", 0) for s in stats)
    out = {"num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted, "num_spec_steps": steps,
           "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
           "mean_acceptance_length": 1 + accepted / steps if steps else 1.0}
    methods: dict = {}
    for s in stats:
        for name, (drafted_by, accepted_by) in (s.get("sources") or {}).items():
            m = methods.setdefault(name, {"num_draft_tokens": 0, "num_accepted_draft_tokens": 0})
            m["num_draft_tokens"] += drafted_by
            m["num_accepted_draft_tokens"] += accepted_by
    if methods:
        out["by_method"] = methods
    return {"speculative_decoding": out}
