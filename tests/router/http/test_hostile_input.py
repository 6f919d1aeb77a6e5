"""Every hostile body gets a 4xx in OpenAI's error format: generated bodies against the
router's validation path (router/http/requests.py: RequestValidator), no cluster needed.

Generated bodies are not all hostile (a schema-shaped body can be a valid request), so
each is judged first without the router (``hostility``: vLLM's own request model, the
router's documented priority names, model and hand-over fields); a hostile body the
router accepts fails the test, and so does any answer other than success or a 4xx.

Bodies come from the router's own OpenAPI description (vLLM's request models, as
``GET /openapi.json`` serves them), from arbitrary JSON, and from valid bodies with one
field replaced by arbitrary JSON. The serving test (tests/router/http/test_hostile_served.py)
sends the same kinds over real HTTP and compares with bare vLLM.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from engines.tiny_model import EMBEDDED_MODEL_NAME, embedded_model_path
from router.http.errors import OpenAIError
from router.http.requests import (
    OpenAIRequest,
    PromptBuilder,
    RequestValidator,
    ServedByVllm,
    decode_json_body,
    take_priority,
)
from router.settings import PRIORITIES

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
    shapes = [by_kind[kind] for kind in kinds if kind in by_kind]
    return st.one_of(shapes) if shapes else JSON


VALID: dict[type[OpenAIRequest], dict[str, Any]] = {
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
    return RequestValidator(prompts, EMBEDDED_MODEL_NAME)


# Fields the router sets for the engines' hand-over; a client's value is hostile
# (router/http/requests.py refuses it).
HAND_OVER_FIELDS = ("kv_transfer_params", "ec_transfer_params")


def hostility(model_cls: type[OpenAIRequest], raw: bytes) -> str | None:
    """Why the router must refuse ``raw``, judged without the router: not a JSON object
    in UTF-8, a body vLLM's own request model refuses, a priority the router does not
    know, another model, or a field only the router sets. None: the router may serve it
    (or refuse it for a limit of its own, such as n=1 or the context length)."""
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # no lone surrogates
    except (ValueError, UnicodeError) as error:
        return f"not JSON in UTF-8: {type(error).__name__}"
    if not isinstance(body, dict):
        return "not a JSON object"
    # The router's ``priority`` is a name (README: high, normal, low), not vLLM's integer.
    priority = body.pop("priority", None)
    if priority is not None and str(priority).strip().lower() not in PRIORITIES:
        return f"priority {priority!r}"
    try:
        request = model_cls.model_validate(body)
    except Exception as error:  # vLLM's validators raise more than ValidationError
        return f"vLLM's {model_cls.__name__} refuses it: {type(error).__name__}: {error}"
    if request.model is not None and request.model != EMBEDDED_MODEL_NAME:
        return f"model {request.model!r}"
    return next((f"sets {f}" for f in HAND_OVER_FIELDS if getattr(request, f) is not None), None)


def refusal(
    validator: RequestValidator, model_cls: type[OpenAIRequest], raw: bytes
) -> OpenAIError | None:
    """The router's 4xx in OpenAI's format for ``raw``, or None if it serves it (on its
    own path, or through vLLM's layer, which validates it there); any other outcome
    fails."""
    try:
        parsed = decode_json_body(raw)
        take_priority(parsed, {}, "normal")
        validator.prepare(model_cls, parsed)
    except ServedByVllm:
        return None
    except OpenAIError as error:
        assert 400 <= int(error.status) < 500, error.message
        document = error.body()
        json.dumps(document, ensure_ascii=False).encode("utf-8")  # renders, surrogates too
        fields = document["error"]
        assert isinstance(fields, dict)
        assert set(fields) == {"message", "type", "param", "code"}
        assert fields["code"] == int(error.status)
        return error
    return None


def check(validator: RequestValidator, model_cls: type[OpenAIRequest], body: Any) -> str:
    """A hostile body refused with a 4xx in OpenAI's format (accepted, it fails the
    test); any other body served or refused the same way. Returns which it was."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    why = hostility(model_cls, raw)
    refused = refusal(validator, model_cls, raw)
    if why is not None:
        assert refused is not None, f"a hostile body was accepted ({why}): {raw[:500]!r}"
        return "hostile"
    return "refused" if refused is not None else "served"


def test_the_openapi_description_names_vllms_request_models() -> None:
    from router.http.ingress import app

    document = app.openapi()
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")):  # fmt: skip
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert model in document["components"]["schemas"]
    assert "messages" in document["components"]["schemas"]["ChatCompletionRequest"]["required"]


@pytest.mark.parametrize("model_cls", [CompletionRequest, ChatCompletionRequest])
def test_bodies_from_the_schema(
    validator: RequestValidator, model_cls: type[OpenAIRequest]
) -> None:
    seen: Counter[str] = Counter()

    @EXAMPLES
    @given(from_schema(model_cls.model_json_schema()))
    def run(body: Any) -> None:
        seen[check(validator, model_cls, body)] += 1

    run()
    assert seen["hostile"] > seen["served"], seen  # mostly hostile, some valid bodies


@pytest.mark.parametrize("model_cls", [CompletionRequest, ChatCompletionRequest])
def test_arbitrary_json(validator: RequestValidator, model_cls: type[OpenAIRequest]) -> None:
    seen: Counter[str] = Counter()

    @EXAMPLES
    @given(JSON)
    def run(body: Any) -> None:
        seen[check(validator, model_cls, body)] += 1

    run()
    assert set(seen) == {"hostile"}, seen  # no prompt or messages: none can be served


@pytest.mark.parametrize("model_cls", [CompletionRequest, ChatCompletionRequest])
def test_valid_bodies_with_one_field_gone_wrong(
    validator: RequestValidator, model_cls: type[OpenAIRequest]
) -> None:
    fields = sorted(model_cls.model_fields)
    seen: Counter[str] = Counter()

    @EXAMPLES
    @given(st.sampled_from(fields), JSON)
    def run(field: str, value: Any) -> None:
        seen[check(validator, model_cls, {**VALID[model_cls], field: value})] += 1

    run()
    # Arbitrary JSON is often a fine value (null for an optional field, [] for stop);
    # what vLLM's model refuses is hostile, and most of it is.
    assert seen["hostile"] > seen["served"] + seen["refused"], seen


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"\xff\xfe", b'{"model": "\\udcff", "prompt": "x"}', b"[]", b"null", b"1e999"],
)
def test_bytes_that_are_not_a_json_object(validator: RequestValidator, raw: bytes) -> None:
    assert hostility(CompletionRequest, raw) is not None
    assert refusal(validator, CompletionRequest, raw) is not None


@pytest.mark.parametrize(
    "field",
    [
        "kv_transfer_params",
        "ec_transfer_params",
    ],
)
@pytest.mark.parametrize("model_cls", [CompletionRequest, ChatCompletionRequest])
def test_a_client_cannot_set_the_routers_hand_over_fields(
    validator: RequestValidator, model_cls: type[OpenAIRequest], field: str
) -> None:
    body = {**VALID[model_cls], field: {"transfer_id": "someone-elses", "do_remote_prefill": True}}
    refused = refusal(validator, model_cls, json.dumps(body).encode())
    assert refused is not None
    error = refused.body()["error"]
    assert isinstance(error, dict) and error["param"] == field


@pytest.mark.parametrize("model_cls", [CompletionRequest, ChatCompletionRequest])
def test_the_valid_bodies_are_served(
    validator: RequestValidator, model_cls: type[OpenAIRequest]
) -> None:
    # The other side of hostility(): what it lets through, the router serves.
    assert check(validator, model_cls, VALID[model_cls]) == "served"
