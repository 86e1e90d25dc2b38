"""The prefix cache behind `specdec serve` (specdec/prefix_cache.py): requests that share a long
prompt prefix report the tokens they took from it as OpenAI does (usage.prompt_tokens_details.
cached_tokens, each prompt once whatever n), and answer what plain decoding without a cache
gives; the default method's EAGLE head reads the cached prefix's hidden states."""

from __future__ import annotations

import pytest

from server_helpers import http, plain_greedy, serving

pytestmark = [pytest.mark.default_model, pytest.mark.usefixtures("one_thread_per_module")]

SYSTEM = ("You answer questions about a shop's database. Tables: customers(id, name, email, city), "
          "orders(id, customer_id, placed_at, total), order_items(order_id, product_id, quantity, price), "
          "products(id, name, category, price). Answer with one SQL query in a code block, nothing else.")
QUESTIONS = ["How many customers live in Paris?", "What is the average order total?",
             "Which product sold the most units?"]


@pytest.fixture(scope="module")
def server(default_model):
    from specdec.config import SpecConfig
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.methods import sources_for
    from specdec.prefix_cache import PrefixCache
    from specdec.server.app import create_app

    batcher = ContinuousBatcher(default_model.model, default_model.eos_ids, sources_for(SpecConfig(), default_model)[0],
                                method="auto", k_max=8, max_batch=4, max_queue=16, max_context=512,
                                prefix_cache=PrefixCache(64))
    app = create_app(default_model, batcher, "smol", request_timeout=120)
    with serving(app) as url:
        yield url, batcher
    batcher.close()




def test_shared_prefixes_are_reused_and_reported(server, default_model):
    from openai import OpenAI

    url, batcher = server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    cached, texts = [], []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        r = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        texts.append(r.choices[0].message.content)
        assert 0 <= cached[-1] < r.usage.prompt_tokens
    assert cached[0] == 0 and all(c >= 64 and c % 16 == 0 for c in cached[1:]), cached
    for q, text in zip(QUESTIONS, texts):
        assert text == plain_greedy(default_model, [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": q}], True, 12)
    # n = 2 of one prompt: the prompt counts once, and its second choice hits what the first left
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List every city."}]
    r = client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0, n=2)
    assert r.usage.prompt_tokens_details.cached_tokens == cached[1]
    assert batcher.prefix.stats.hits >= 3
    # /metrics counts every choice's cached tokens (the n = 2 request's two choices each at least its figure)
    code, text = http(url + "/metrics", key=None)
    counted = [float(line.split()[1]) for line in text.splitlines()
               if line.startswith("specdec_prompt_tokens_cached_total ")]
    assert code == 200 and counted[0] >= sum(cached) + 2 * r.usage.prompt_tokens_details.cached_tokens


def test_the_config_builds_the_cache():
    from specdec.config import SpecConfig
    from specdec.types import SpecdecError

    assert SpecConfig(prefix_cache_mb=0).prefix_cache() is None
    assert SpecConfig(prefix_cache_mb=8).prefix_cache().budget == 8 << 20
    with pytest.raises(SpecdecError, match="prefix_cache_mb"):
        SpecConfig(prefix_cache_mb=-1)
