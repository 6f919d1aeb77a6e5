"""Every hostile body gets a 4xx in OpenAI's error format: generated bodies against the
router's validation path (router/requests.py: RequestValidator), no cluster needed.

Bodies come from the router's own OpenAPI description (vLLM's request models, as
``GET /openapi.json`` serves them), from arbitrary JSON, and from valid bodies with one
field replaced by arbitrary JSON. The serving test (tests/test_hostile_serving.py)
sends the same kinds over real HTTP and compares with bare vLLM.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from engines.tiny_model import EMBEDDED_MODEL_NAME, embedded_model_path
from router.errors import OpenAIError
from router.requests import PromptBuilder, RequestValidator

EXAMPLES = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,  # the same bodies every run: a failure here is reproducible
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies shaped by a model's JSON schema: each declared field, present or not, with
    a value of one of its declared types (or, now and then, of any type)."""
    fields = {
        name: st.one_of(_of_declared_type(spec), JSON)
        for name, spec in schema.get("properties", {}).items()
    }
    return st.fixed_dictionaries({}, optional=fields)


def _of_declared_type(spec: dict[str, Any]) -> st.SearchStrategy[Any]:
    kinds = [spec.get("type")] + [option.get("type") for option in spec.get("anyOf", [])]
    by_kind = {
        "string": st.text(max_size=40),
        "integer": st.integers(min_value=-(2**40), max_value=2**40),
        "number": st.floats(allow_nan=False, allow_infinity=False),
        "boolean": st.booleans(),
        "array": st.lists(JSON, max_size=3),
        "object": st.dictionaries(st.text(max_size=8), JSON, max_size=3),
        "null": st.none(),
    }
    strategies = [by_kind[kind] for kind in kinds if kind in by_kind]
    return st.one_of(strategies) if strategies else JSON


VALID = {
    CompletionRequest: {"model": EMBEDDED_MODEL_NAME, "prompt": "hello", "max_tokens": 4},
    ChatCompletionRequest: {
        "model": EMBEDDED_MODEL_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    },
}


@pytest.fixture(scope="module")
def validator() -> RequestValidator:
    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = PromptBuilder(tokenizer, 4096, AutoConfig.from_pretrained(path).vocab_size)
    return RequestValidator(prompts, EMBEDDED_MODEL_NAME, "normal")


def check(validator: RequestValidator, model_cls: type, body: Any) -> None:
    """Accepted, or refused with a 4xx in OpenAI's format; anything else fails."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        _, parsed = validator.read(raw, {})
        validator.prepare(model_cls, parsed)
    except OpenAIError as error:
        assert 400 <= int(error.status) < 500, error.message
        document = error.body()
        json.dumps(document, ensure_ascii=False).encode("utf-8")  # renders, surrogates too
        assert set(document["error"]) == {"message", "type", "param", "code"}
        assert document["error"]["code"] == int(error.status)


def test_the_openapi_description_names_vllms_request_models() -> None:
    from router.ingress import app

    document = app.openapi()
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")):  # fmt: skip
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert model in document["components"]["schemas"]
    assert "messages" in document["components"]["schemas"]["ChatCompletionRequest"]["required"]


@pytest.mark.parametrize("model_cls", [CompletionRequest, ChatCompletionRequest])
def test_bodies_from_the_schema(validator: RequestValidator, model_cls: type) -> None:
    @EXAMPLES
    @given(from_schema(model_cls.model_json_schema()))
    def run(body: Any) -> None:
        check(validator, model_cls, body)

    run()


@pytest.mark.parametrize("model_cls", [CompletionRequest, ChatCompletionRequest])
def test_arbitrary_json(validator: RequestValidator, model_cls: type) -> None:
    @EXAMPLES
    @given(JSON)
    def run(body: Any) -> None:
        check(validator, model_cls, body)

    run()


@pytest.mark.parametrize("model_cls", [CompletionRequest, ChatCompletionRequest])
def test_valid_bodies_with_one_field_gone_wrong(
    validator: RequestValidator, model_cls: type
) -> None:
    fields = sorted(model_cls.model_fields)

    @EXAMPLES
    @given(st.sampled_from(fields), JSON)
    def run(field: str, value: Any) -> None:
        check(validator, model_cls, {**VALID[model_cls], field: value})

    run()


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"\xff\xfe", b'{"model": "\\udcff", "prompt": "x"}', b"[]", b"null", b"1e999"],
)
def test_bytes_that_are_not_a_json_object(validator: RequestValidator, raw: bytes) -> None:
    check(validator, CompletionRequest, raw)
