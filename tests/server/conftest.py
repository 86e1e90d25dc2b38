"""Fixtures of the server tests: `server`, a server on loopback over the default model with the
default method (no API key), as (url, batcher), and `client`, the openai client of it.
test_serve.py and test_serve_structured.py define servers of their own under the same names."""

from __future__ import annotations

import pytest

from server_helpers import MAX_CONTEXT, serving


@pytest.fixture(scope="module")
def server(default_model):
    from specdec.config import SpecConfig
    from specdec.core.scheduler import ContinuousBatcher
    from specdec.methods import sources_for
    from specdec.server.app import create_app

    batcher = ContinuousBatcher(default_model.model, default_model.eos_ids, sources_for(SpecConfig(), default_model)[0],
                                method="auto", k_max=8, max_batch=8, max_queue=64, max_context=MAX_CONTEXT)
    app = create_app(default_model, batcher, "smol", request_timeout=120)
    with serving(app) as url:
        yield url, batcher
    batcher.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)
