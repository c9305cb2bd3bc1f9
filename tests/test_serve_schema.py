"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI document (valid
and invalid, bounded in number) against a live server; no answer may be a 5xx, and every answer
must match the document (status code, content type, body schema)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from helpers import (  # noqa: E402
    SMALL,
    live_server,
    varied_model,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from gpt2kit.serve import ServeOptions  # noqa: E402
from gpt2kit.tokenizer import Tokenizer  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def live():
    model = varied_model(SMALL, seed=0)
    with live_server(lambda: (model, Tokenizer.default()),
                     ServeOptions(served_model_name=NAME, max_batch=8, max_queue=64)) as (url, app):
        yield url


def test_no_5xx_and_every_answer_matches_the_schema(live):
    # schemathesis' pytest plugin does not load under this pytest, so each operation runs its own
    # hypothesis loop here (bounded: max_examples requests per operation).
    schema = schemathesis.openapi.from_url(live + "/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/tokenize", "/detokenize", "/health", "/v1/models"}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            if isinstance(case.body, dict) and "model" in case.body and hash(repr(case.body)) % 2 == 0:
                case.body["model"] = NAME  # half the requests name the served model, to reach generation
            case.call_and_validate(timeout=60, checks=checks)

        run()
