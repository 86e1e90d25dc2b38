"""`prediction`, `response_format` and `tools` through `specdec serve`, with real clients
unmodified: the openai SDK (`chat.completions.parse` with a pydantic model, `prediction=`, a
tools round trip streamed and not) and LangChain's `ChatOpenAI` (`bind_tools`,
`with_structured_output`), against a server on loopback (the default model, `auto`).

A small model is held to a schema or to a tool call by the grammar the scheduler enforces."""

from __future__ import annotations

import json

import pytest

from server_helpers import http, serving

pytestmark = pytest.mark.default_model


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(city: str, i: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


# two worked examples: the default model, greedy, answers the third with a call of its own
FEW_SHOT = [{"role": "system", "content": "You answer only with a tool call."},
            {"role": "user", "content": "Weather in Paris?"}, call("Paris", 1),
            {"role": "user", "content": "Weather in Rome?"}, call("Rome", 2),
            {"role": "user", "content": "Weather in London?"}]


@pytest.fixture(scope="module")
def server(default_model):
    from specdec.config import SpecConfig
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.methods import sources_for
    from specdec.server.app import create_app

    batcher = ContinuousBatcher(default_model.model, default_model.eos_ids, sources_for(SpecConfig(), default_model)[0],
                                method="auto", k_max=8, max_batch=4, max_queue=50, max_context=1024)
    app = create_app(default_model, batcher, "smol", request_timeout=120)
    with serving(app) as url:
        yield url
    batcher.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages, **kw):
    return client.chat.completions.create(model="smol", messages=messages, max_tokens=kw.pop("max_tokens", 40),
                                          temperature=0, **kw)


def test_prediction_keeps_the_greedy_answer_and_counts_its_tokens(client, default_model):
    q = [{"role": "user", "content": "List the days of the week."}]
    plain = chat(client, q)
    text = plain.choices[0].message.content
    tok = default_model.tokenizer
    for prediction, most in ((text, True), ("Bananas are yellow. " * 3, False)):
        r = chat(client, q, prediction={"type": "content", "content": prediction})
        assert r.choices[0].message.content == text  # a prediction is a draft: the answer is the same
        details = r.usage.completion_tokens_details
        predicted = len(tok.encode(prediction, add_special_tokens=False))
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == predicted
        if most:  # the prediction is the answer itself: every one of its tokens appears in it
            assert details.accepted_prediction_tokens == predicted
        else:
            assert details.accepted_prediction_tokens < predicted // 2
    parts = chat(client, q, prediction={"type": "content", "content": [{"type": "text", "text": text}]})
    assert parts.usage.completion_tokens_details.accepted_prediction_tokens == predicted_len(tok, text)
    c = client.completions.create(model="smol", prompt="def add(a, b):\n", max_tokens=16, temperature=0)
    cp = client.completions.create(model="smol", prompt="def add(a, b):\n", max_tokens=16, temperature=0,
                                   extra_body={"prediction": {"type": "content", "content": c.choices[0].text}})
    assert cp.choices[0].text == c.choices[0].text
    assert cp.usage.completion_tokens_details.accepted_prediction_tokens > 0


def predicted_len(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_every_answer_carries_its_speculation_figures(client):
    r = chat(client, [{"role": "user", "content": "Repeat: one two three, one two three, one two three."}])
    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] >= 1
    assert 0 <= spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"])
    assert r.usage.completion_tokens_details is None  # no prediction, no prediction counts


def test_tools_are_rendered_into_the_prompt(client, default_model):
    from specdec.text import encode_prompt
    from specdec.tools import render_messages, syntax_for

    tok = default_model.tokenizer
    messages, tools = render_messages(FEW_SHOT, [WEATHER], syntax_for(tok.chat_template))
    want = len(encode_prompt(tok, messages, True, tools=tools))
    r = chat(client, FEW_SHOT, tools=[WEATHER], max_tokens=1)
    assert r.usage.prompt_tokens == want
    without = chat(client, FEW_SHOT, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert without.usage.prompt_tokens < want  # "none": the tools are left out, the answer is text


def test_a_tool_round_trip(client):
    r = chat(client, FEW_SHOT, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tc] = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "London"}
    # the result goes back as a `tool` message answering that call; the model answers on
    follow = FEW_SHOT + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": tc.id, "content": json.dumps({"temp_c": 14})}]
    again = chat(client, follow, tools=[WEATHER])
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")

    stream = chat(client, FEW_SHOT, tools=[WEATHER], stream=True)
    opened, args, reasons, content = {}, {}, [], []
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.content:
                content.append(ch.delta.content)
            for d in ch.delta.tool_calls or []:
                if d.id is not None:  # the id and the name come first, once
                    assert d.index not in opened
                    opened[d.index] = (d.id, d.function.name)
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert not content and reasons == ["tool_calls"]
    assert [opened[0][1]] == ["get_weather"] and opened[0][0].startswith("call_")
    assert args[0] == tc.function.arguments


@pytest.mark.parametrize("body,needle,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, "'not'", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "strng", "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format"),
    ({"response_format": {"type": "json_schema"}}, "needs 'json_schema'", "response_format"),
    ({"prediction": {"type": "image", "content": "x"}}, "prediction.type", "prediction"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, '"nope"', "tool_choice"),
    ({"tool_choice": "required"}, "'tools' is empty", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "'tool_choice' must be", "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, 'only tools of type "function"', "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "use one", "response_format"),
])
def test_bad_structured_requests_are_one_clear_400(server, body, needle, param):
    status, text = http(server + "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}, key=None)
    err = json.loads(text)["error"]
    assert status == 400 and needle in err["message"] and err["param"] == param, text


def test_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        population_millions: float

    r = client.chat.completions.parse(model="smol", max_tokens=60, temperature=0, response_format=City,
                                      messages=[{"role": "user", "content": "Paris: name, country and population in millions, as JSON."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_json_object_and_schema_answers_parse(client):
    import jsonschema

    r = chat(client, [{"role": "user", "content": "Hi"}], response_format={"type": "json_object"}, max_tokens=60)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    r = client.completions.create(model="smol", prompt="The number of days in a week, as JSON:", max_tokens=30, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_a_named_tool_choice_always_calls_it(client):
    r = chat(client, [{"role": "user", "content": "Tell me a joke."}], tools=[WEATHER], max_tokens=60,
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert calls and all(tc.function.name == "get_weather" for tc in calls)
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


def test_langchain_bind_tools(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    model = lc.ChatOpenAI(base_url=server + "/v1", api_key="unused", model="smol", temperature=0, max_tokens=40,
                          max_retries=0)
    history = [SystemMessage(FEW_SHOT[0]["content"])]
    for m in FEW_SHOT[1:]:
        if m["role"] == "user":
            history.append(HumanMessage(m["content"]))
        else:
            tc = m["tool_calls"][0]
            history.append(AIMessage("", tool_calls=[{"id": tc["id"], "name": "get_weather",
                                                      "args": json.loads(tc["function"]["arguments"])}]))
    answer = model.bind_tools([WEATHER]).invoke(history)
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("get_weather", {"city": "London"})]
    streamed = None
    for piece in model.bind_tools([WEATHER]).stream(history):
        streamed = piece if streamed is None else streamed + piece
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", {"city": "London"})]


def test_langchain_with_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class Answer(BaseModel):
        city: str
        sunny: bool

    model = lc.ChatOpenAI(base_url=server + "/v1", api_key="unused", model="smol", temperature=0, max_tokens=60,
                          max_retries=0)
    for method in ("json_schema", "function_calling"):
        out = model.with_structured_output(Answer, method=method).invoke("Is it sunny in Madrid?")
        assert isinstance(out, Answer)
