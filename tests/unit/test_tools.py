"""specdec.tools: tools rendered by the model's template (checked against transformers' own
rendering), the tool-call syntaxes parsed into OpenAI's `tool_calls` (whole and streamed in
pieces that add up to the whole), and the tool-call grammar: every answer it allows parses into
calls whose arguments validate against the function's schema (`jsonschema`)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from specdec.tools import HERMES, LLAMA3, MISTRAL, ToolParser, ToolSyntax, call_grammar, render_messages, syntax_for
from specdec.types import SpecdecError

jsonschema = pytest.importorskip("jsonschema")

# Qwen2.5-Instruct's chat template, as its tokenizer_config.json ships it (tools and tool messages)
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}
CONVERSATION = [
    {"role": "system", "content": "You help with travel."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
    {"role": "user", "content": "And the time?"},
]


@pytest.fixture(scope="module")
def tok():
    from specdec.models.gguf_file import GGUFFile
    from specdec.models.loader import cache_root, default_model_path
    from specdec.models.tokenizer import gguf_tokenizer

    return gguf_tokenizer(GGUFFile(default_model_path()), cache_root() / "tokenizers", quiet=True)


def with_template(tok, template):
    from specdec.models.tokenizer import FastTokenizer

    return FastTokenizer(tok._tk, tok._config, template, tok.source)


def test_qwen_template_renders_tools_and_tool_messages_as_transformers_does(tok):
    from transformers import PreTrainedTokenizerFast

    qwen = with_template(tok, QWEN25_TEMPLATE)
    syntax = syntax_for(QWEN25_TEMPLATE)
    assert syntax == ToolSyntax(HERMES, native=True)
    messages, tools = render_messages(CONVERSATION, [WEATHER, TIME], syntax)
    ours = qwen.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=tools)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok._tk)
    hf.chat_template = QWEN25_TEMPLATE
    # transformers renders OpenAI messages as given, with the arguments as an object (as vLLM passes them)
    want = hf.apply_chat_template(messages, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=False)
    assert ours == want
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in ours
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in ours and '"name": "get_time"' in ours


def test_a_template_without_tools_gets_the_generic_hermes_format(tok):
    assert syntax_for(tok.chat_template) == ToolSyntax(HERMES, native=False)
    messages, tools = render_messages(CONVERSATION, [WEATHER], syntax_for(tok.chat_template))
    assert tools is None
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "You help with travel.\n\n# Tools" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>" in text


def test_a_template_with_an_unknown_tool_syntax_is_refused():
    with pytest.raises(SpecdecError, match="tool-call syntax"):
        syntax_for("{% for t in tools %}{{ t | tojson }}{% endfor %}{{ messages[0].content }}")


ANSWERS = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "CET"})]),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, '
              '{"name": "get_time", "arguments": {"zone": "a;b]"}}]',
     None, [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "a;b]"})]),
    (MISTRAL, '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', None, [("get_time", {"zone": "UTC"})]),
    (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "x\\"}"}}; '
             '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}',
     None, [("get_time", {"zone": 'x"}'}), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
    (HERMES, "No tools needed: 4.", "No tools needed: 4.", []),
    (HERMES, 'Oops <tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>',
     'Oops <tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>', []),
    (LLAMA3, '{"not": "a call"}', '{"not": "a call"}', []),
]


@pytest.mark.parametrize("name,text,content,calls", ANSWERS)
def test_parse_and_streamed_pieces_add_up(name, text, content, calls):
    parser = ToolParser(ToolSyntax(name, native=True))
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    if "Oops" in text:
        return  # malformed after the name: a stream cannot take back the call it opened (ToolParser.feed)
    rng = random.Random(len(text))
    for _ in range(5):  # streamed in random pieces: the deltas add up to the whole
        streamer = ToolParser(ToolSyntax(name, native=True))
        cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
        deltas = []
        for end in cuts + [len(text)]:
            deltas += streamer.feed(text[:end], final=end == len(text))
        streamed_content = "".join(d["content"] for d in deltas if "content" in d) or None
        assert streamed_content == content
        names, args = {}, {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                if "id" in tc:
                    assert tc["index"] not in names  # the id and name once, first
                    names[tc["index"]] = tc["function"]["name"]
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
        assert [(names[i], json.loads(args[i])) for i in sorted(names)] == calls


def test_hermes_stream_sends_the_name_before_the_arguments_are_complete():
    streamer = ToolParser(ToolSyntax(HERMES, native=True))
    deltas = streamer.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', final=False)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Os'


def walk_calls(tok, grammar, rng, steps=300):
    c = grammar.constraint()
    ids = []
    for _ in range(steps):
        if c.finished():
            return ids
        mask = c.allowed([[]])[0].numpy()
        if mask[tok.eos_token_id] and rng.random() < 0.5:  # the text may end here: end it half the time
            return ids
        allowed = np.flatnonzero(mask)
        t = int(allowed[rng.randrange(len(allowed))])
        c.advance([t])
        ids.append(t)
    return None


@pytest.mark.parametrize("choice,parallel", [("get_weather", False), (None, True)])
def test_every_answer_the_tool_grammar_allows_is_a_valid_call(tok, choice, parallel):
    from specdec.grammar import grammar_for, lark

    syntax = ToolSyntax(HERMES, native=False)
    text = call_grammar([WEATHER, TIME], choice, parallel, syntax, tok)
    grammar = grammar_for(tok, len(tok), [tok.eos_token_id], lark(text, "tool_choice"))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    rng = random.Random(3)
    counts = set()
    for _ in range(8):
        ids = walk_calls(tok, grammar, rng)
        assert ids is not None
        content, calls = ToolParser(syntax).parse(tok.decode(ids))
        assert content is None and calls
        assert parallel or len(calls) == 1
        counts.add(len(calls))
        for call in calls:
            assert choice is None or call.name == choice
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    if parallel:
        assert max(counts) >= 1


def test_named_choice_forces_the_call_opening(tok):
    from specdec.grammar import grammar_for, lark

    text = call_grammar([WEATHER, TIME], "get_time", False, ToolSyntax(HERMES, native=False), tok)
    c = grammar_for(tok, len(tok), [tok.eos_token_id], lark(text, "tool_choice")).constraint()
    # one legal token at each step: the whole opening, up to the free argument
    assert tok.decode(c.forced(64)) == '<tool_call>\n{"name": "get_time", "arguments": {"zone":'


def test_an_added_marker_token_is_matched_as_that_token(tok):
    """Qwen's `<tool_call>` is a token of its own (added, not special): the grammar names it by id,
    so the answer opens with that one token, forced (a string there would be masked as the token
    and then refused when consumed)."""
    from tokenizers import AddedToken, Tokenizer

    from specdec.grammar import grammar_for, lark
    from specdec.models.tokenizer import FastTokenizer

    backend = Tokenizer.from_str(tok._tk.to_str())
    backend.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    qwenish = FastTokenizer(backend, tok._config, QWEN25_TEMPLATE, tok.source)
    opener = backend.token_to_id("<tool_call>")
    text = call_grammar([WEATHER], "get_weather", False, syntax_for(QWEN25_TEMPLATE), qwenish)
    assert f"<[{opener}]>" in text
    c = grammar_for(qwenish, len(qwenish), [tok.eos_token_id], lark(text, "tools")).constraint()
    assert c.forced(1) == [opener]
    ids = qwenish.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
                         '\n</tool_call>', add_special_tokens=False)
    assert ids[0] == opener and c.accepts(ids) == len(ids)
    c.advance(ids)
    assert c.finished()
