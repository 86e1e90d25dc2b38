"""The Python API: `specdec.load(...)` returns a `Speculator`, whose `generate` takes text and
returns text with its figures. Everything is built from a `SpecConfig` by specdec.config's
builder, exactly as `specdec generate` builds it, so the same settings give the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .config import SpecConfig, build_engine, load_target
from .types import RequestStats, SamplingParams, SpecdecError

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(SpecConfig) if f.name != "sampling")


@dataclass
class Completion:
    """One generated answer: `text` (stop strings cut off, special tokens skipped; with tools, the
    text outside the calls), `token_ids` (every generated id, an EOS and a matched stop string's
    tokens included), `finish_reason` ("eos", "length", "stop", or "tool_calls" when it called a
    tool), `stats` (RequestStats: acceptance alpha, tokens per target forward tau, prefill and
    decode seconds, ...) and `tool_calls` (with `tools`: OpenAI's shape, arguments as JSON text)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    tool_calls: list[dict] = dataclasses.field(default_factory=list)  # with tools=: OpenAI-shaped calls


class Speculator:
    """A target model with its drafter and engine, built once from a SpecConfig and reused across
    `generate` calls (adaptive drafters keep what they learn between calls).

    Attributes: `config` (the SpecConfig), `target` (the LoadedModel: `.model`, `.tokenizer`,
    `.name`, `.weights`), `engine` (the Engine, for token-id level use)."""

    def __init__(self, config: SpecConfig, quiet: bool = True) -> None:
        from . import threads

        self.config = config
        threads.start(config.threads)  # (the free cores are measured while loading, as generate does)
        self.target = load_target(config, quiet)
        if self.target.tokenizer is None:
            raise SpecdecError(f"{self.target.path} has no tokenizer; Speculator.generate needs one to read text")
        self.engine = build_engine(config, self.target, quiet)
        threads.settle()

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def generate(self, prompt: str | list | Sequence[str | list], *, stop: Sequence[str] = (),
                 chat: bool | None = None, system: str | None = None,
                 on_text: Callable[[int, str], None] | None = None, prediction: str | None = None,
                 json_schema: dict | None = None, tools: list[dict] | None = None, tool_choice: str = "auto",
                 **sampling) -> Completion | list[Completion]:
        """Complete one prompt (returns a Completion) or a list of prompts decoded as one batch
        (returns a list, in order).

        A prompt is text or a list of OpenAI-style messages ({"role", "content"}). chat=None
        uses the tokenizer's chat template when it has one (True requires it, False sends the
        text raw); system is the template's system message. stop: strings that end a row (cut
        from its text; empty ones are ignored). on_text(row, text): each row's new text as it
        comes, never reaching a stop string (text that could still become one waits, as does a
        character whose bytes have not all come).
        sampling: max_new_tokens, temperature (0: greedy), top_k, top_p, min_p, seed; the
        config's sampling defaults for the rest.

        prediction: text the answer is expected to repeat (OpenAI's Predicted Outputs: a draft;
        the answer is the same with or without it). json_schema: a JSON Schema the answer must
        follow ({"type": "object"}: any JSON object). tools: OpenAI function definitions, rendered
        by the chat template (or specdec's generic format, `specdec.tools`) with the calls parsed
        into `Completion.tool_calls`; tool_choice "auto", "required", "none" or a function's name
        ("required" and a name hold the answer to calls). The grammar is enforced as the answer
        is verified (docs/design.md, "Structured output")."""
        from .text import TextStream, check_text, encode_prompt, stop_strings

        unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
        if unknown:
            raise SpecdecError(f"generate() got unknown option(s) {', '.join(unknown)}; sampling options are "
                               f"{', '.join(SAMPLING_FIELDS)}")
        params = dataclasses.replace(self.config.sampling, **sampling)
        stops = stop_strings(stop, "a stop string")
        single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict))
        prompts = [prompt] if single else list(prompt)
        if not prompts:
            raise SpecdecError("generate() needs at least one prompt")
        tok, ctx = self.tokenizer, self.target.model.max_context
        syntax, spec = self._shaping(tools, tool_choice, json_schema)
        encoded = []
        for i, p in enumerate(prompts):
            where = "the prompt" if single else f"prompt {i + 1}"
            if isinstance(p, str):
                check_text(p, where)
            blank = not p.strip() if isinstance(p, str) else all(not str(m.get("content", "")).strip() for m in p)
            if blank:
                raise SpecdecError(f"{where} is empty: give the text for the model to answer (chat) or continue (raw)")
            if syntax is not None:
                from .tools import render_messages

                messages = p if isinstance(p, list) else [{"role": "user", "content": p}]
                if system:
                    messages = [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]
                messages, template_tools = render_messages(messages, tools, syntax)
                ids = encode_prompt(tok, messages, True, tools=template_tools)
            else:
                ids = encode_prompt(tok, p, chat, system)
            if len(ids) + 1 > ctx:
                raise SpecdecError(f"{where} has {len(ids)} tokens but the model's context is {ctx}")
            encoded.append(ids)
        streams = [TextStream(tok, stops) for _ in encoded]  # each row's text, stop strings held back

        def on_tokens(row, ids):
            piece = streams[row].push(ids)
            if piece:
                on_text(row, piece)

        def stop_fn(row, ids):
            return streams[row].reached_stop(ids)

        predicted = None
        if prediction is not None:
            check_text(prediction, "the prediction")
            predicted = [tok.encode(prediction, add_special_tokens=False)] * len(encoded)
        constraints = None
        if spec is not None:
            from .grammar import grammar_for

            grammar = grammar_for(tok, self.target.model.vocab_size, self.target.eos_ids, spec)
            constraints = [grammar.constraint() for _ in encoded]
        results = self.engine.generate(encoded, params, on_tokens if on_text is not None else None,
                                       stop_fn if stops else None, predictions=predicted, constraints=constraints)
        out = []
        for row, (r, text) in enumerate(zip(results, streams)):
            rest = text.finish(r.tokens)
            if rest and on_text is not None:
                on_text(row, rest)
            c = Completion(text.text, list(r.tokens), r.stats.finish_reason, r.stats)
            if syntax is not None:
                from .tools import ToolParser

                eos = set(self.target.eos_ids)
                calls_text = tok.decode([t for t in r.tokens[: text.used_tokens] if t not in eos])
                content, calls = ToolParser(syntax).parse(calls_text)
                if calls:
                    c.text, c.tool_calls, c.finish_reason = content or "", [k.openai() for k in calls], "tool_calls"
            out.append(c)
        return out[0] if single else out

    def _shaping(self, tools, tool_choice, json_schema):
        """(the tool syntax to render and parse, or None; the grammar the answers follow, or None)."""
        from . import grammar as gr

        syntax = spec = None
        if tools and tool_choice != "none":
            from .tools import call_grammar, syntax_for

            syntax = syntax_for(getattr(self.tokenizer, "chat_template", None))
            names = [t["function"]["name"] for t in tools]
            if tool_choice not in ("auto", "required", *names):
                raise SpecdecError(f"tool_choice must be 'auto', 'required', 'none' or one of {', '.join(names)}; "
                                   f"got {tool_choice!r}")
            if tool_choice != "auto":
                if json_schema is not None:
                    raise SpecdecError("json_schema and a tool_choice that asks for a call exclude each other; use one")
                named = None if tool_choice == "required" else tool_choice
                spec = gr.lark(call_grammar(tools, named, True, syntax, self.tokenizer), "tools")
        if json_schema is not None and spec is None:
            spec = gr.json_schema(json_schema, "json_schema")
        return syntax, spec


def load(model: str | None = None, draft: str | None = None, method: str = "auto", *,
         config: SpecConfig | None = None, quiet: bool = True, **settings) -> Speculator:
    """A Speculator for `model` (a .gguf file, a Hugging Face folder, a hub id; None: the
    embedded default model) drafting with `method` ("auto", "none", "ngram", "draft", "eagle",
    "medusa") and `draft` (the drafter's files; None: the ones shipped for the default model).

    settings: any other SpecConfig field (k, threads, weights, dtype, tree, tree_depth,
    tree_width, tree_nodes, draft_confidence) and the default sampling of generate calls
    (max_new_tokens, temperature, top_k, top_p, min_p, seed). Or pass a whole `config`.
    Bad values raise SpecdecError with one line saying what is wrong."""
    if config is None:
        unknown = sorted(set(settings) - set(CONFIG_FIELDS) - set(SAMPLING_FIELDS))
        if unknown:
            raise SpecdecError(f"load() got unknown setting(s) {', '.join(unknown)}; settings are "
                               f"{', '.join(CONFIG_FIELDS + SAMPLING_FIELDS)}")
        sampling = SamplingParams(**{k: v for k, v in settings.items() if k in SAMPLING_FIELDS})
        config = SpecConfig(model=model, draft=draft, method=method, sampling=sampling,
                            **{k: v for k, v in settings.items() if k in CONFIG_FIELDS})
    elif settings or model is not None or draft is not None or method != "auto":
        raise SpecdecError("load() takes either a config or settings, not both")
    return Speculator(config, quiet)
