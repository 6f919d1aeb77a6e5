"""Untrusted input stays inside limits and off the event loop: a request's own chat
template only when trusted, reserved template arguments refused, the body size
limit, the unknown-field policy, and the stall itself: while a large prompt is
tokenized or a trusted template bomb renders, the event loop keeps serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from engines.tiny_model import EMBEDDED_MODEL_NAME, embedded_model_path
from router.http.errors import OpenAIError
from router.http.requests import PromptBuilder, RequestValidator, parse_request
from router.settings import RouterConfig
from tests.support.in_process_router import answer, chat_body, http_request, in_process_router

CHAT = "/v1/chat/completions"
# Nested loops that cost the renderer about half a second here and write two characters;
# one with range(10**5) each would run for hours.
LOOPS = 2500
BOMB = (
    f"{{% for a in range({LOOPS}) %}}{{% for b in range({LOOPS}) %}}{{% endfor %}}{{% endfor %}}"
    "{{ messages[0]['content'] }}"
)
LARGE_PROMPT_CHARS = 300_000
TICK_S = 0.01
# The largest gap between ticks meant to come every TICK_S while a slow request is
# prepared in a worker thread, measured on two shared cores: 26 ms (tokenizing, which
# releases the GIL) and 21 ms (the template, which holds it and gives it up every 5 ms,
# sys.getswitchinterval()); on the event loop itself: 300 to 550 ms. On a busy machine
# every figure grows (up to ~50 ms and 1.7 s seen), so the checks are ratios of them.


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(embedded_model_path())


def validator(tokenizer: Any, **router: Any) -> RequestValidator:
    config = RouterConfig(**router)
    vocab_size = AutoConfig.from_pretrained(embedded_model_path()).vocab_size
    prompts = PromptBuilder(tokenizer, 4096, vocab_size, config.trust_request_chat_template)
    return RequestValidator(prompts, EMBEDDED_MODEL_NAME, config)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": EMBEDDED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}


class NoTemplates:
    """A tokenizer that fails the test if anything is rendered with it."""

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise AssertionError("a template was rendered")


# ---- templates -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template": BOMB}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": BOMB}}, "chat_template_kwargs.chat_template"),
    ],
)
def test_a_request_template_is_refused_before_anything_renders(
    tokenizer: Any, fields: dict[str, Any], param: str
) -> None:
    prompts = PromptBuilder(tokenizer, 4096, 512)
    prompts._tokenizer = NoTemplates()  # the refusal comes before any rendering
    request = parse_request(ChatCompletionRequest, chat(**fields))
    with pytest.raises(OpenAIError) as raised:
        prompts.prepare(request)
    assert raised.value.status == 400 and raised.value.param == param
    assert "router.trust_request_chat_template" in raised.value.message


@pytest.mark.parametrize("where", ["top", "kwargs"])
def test_a_trusted_request_template_is_rendered(tokenizer: Any, where: str) -> None:
    template = "{{ bos_token }}custom:{{ messages[0]['content'] }}"
    fields = (
        {"chat_template": template}
        if where == "top"
        else {"chat_template_kwargs": {"chat_template": template}}
    )
    prompts = PromptBuilder(tokenizer, 4096, 512, trust_request_chat_template=True)
    ids = prompts.prepare(parse_request(ChatCompletionRequest, chat(**fields))).prompt_token_ids
    assert bytes(i for i in ids if i < 256) == b"custom:hi"


@pytest.mark.parametrize("name", ["tokenize", "return_dict", "add_generation_prompt", "tools"])
def test_template_kwargs_may_not_set_the_renderers_own_arguments(tokenizer: Any, name: str) -> None:
    request = parse_request(ChatCompletionRequest, chat(chat_template_kwargs={name: True}))
    with pytest.raises(OpenAIError) as raised:
        PromptBuilder(tokenizer, 4096, 512, trust_request_chat_template=True).prepare(request)
    assert raised.value.param == f"chat_template_kwargs.{name}"


def test_template_variables_still_pass(tokenizer: Any) -> None:
    request = parse_request(ChatCompletionRequest, chat(chat_template_kwargs={"thinking": False}))
    assert PromptBuilder(tokenizer, 4096, 512).prepare(request).prompt_token_ids


# ---- unknown fields and the body size --------------------------------------------------------


def test_unknown_fields_are_ignored_as_vllm_does_or_refused_when_configured() -> None:
    body = {"model": "m", "prompt": "a", "top_k": 5, "frobnicate": 1, "zz": 2}
    assert parse_request(CompletionRequest, dict(body)).top_k == 5
    with pytest.raises(OpenAIError) as raised:
        parse_request(CompletionRequest, dict(body), "reject")
    assert raised.value.param == "frobnicate" and "unrecognized" in raised.value.message
    known = {"model": "m", "prompt": "a", "top_k": 5, "stream_options": None}
    assert parse_request(CompletionRequest, known, "reject").top_k == 5  # vLLM's own fields


def test_the_unknown_field_policy_is_the_routers(tokenizer: Any) -> None:
    strict = validator(tokenizer, unknown_fields="reject")
    with pytest.raises(OpenAIError) as raised:
        strict.prepare(ChatCompletionRequest, chat(frobnicate=1))
    assert raised.value.param == "frobnicate"
    validator(tokenizer).prepare(ChatCompletionRequest, chat(frobnicate=1))


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _never() -> AsyncIterator[bytes]:
    raise AssertionError("a declared size over the limit is refused before reading")
    yield b""  # an async generator


async def test_a_body_over_the_limit_is_a_413_declared_or_not(tokenizer: Any) -> None:
    limited = validator(tokenizer, max_request_bytes=1000)
    assert await limited.receive({}, _chunks(b"a" * 600, b"b" * 400)) == b"a" * 600 + b"b" * 400
    for headers, chunks in (
        ({"content-length": "1001"}, _never()),
        ({}, _chunks(b"a" * 600, b"b" * 401)),
        ({"content-length": "10"}, _chunks(b"a" * 1001)),  # a body longer than it said
    ):
        with pytest.raises(OpenAIError) as raised:
            await limited.receive(headers, chunks)
        assert raised.value.status == 413
        error = raised.value.body()["error"]
        assert isinstance(error, dict) and error["type"] == "RequestTooLargeError"
        assert "router.max_request_bytes" in raised.value.message


async def test_the_router_answers_a_large_body_with_413_and_a_trusted_template() -> None:
    args = {"router": {"max_request_bytes": 4096, "trust_request_chat_template": True}}
    async with in_process_router(**args) as router:
        large = await answer(router.chat_completions, http_request(CHAT, chat_body("a" * 5000)))
        assert large.status_code == 413
        template = "{{ bos_token }}{{ messages[0]['content'] }}"
        trusted = await answer(
            router.chat_completions, http_request(CHAT, chat_body(chat_template=template))
        )
        assert trusted.status_code == 200
    async with in_process_router() as router:
        refused = await answer(
            router.chat_completions, http_request(CHAT, chat_body(chat_template=BOMB))
        )
        assert refused.status_code == 400
        assert b'"param":"chat_template"' in refused.body


# ---- the stall -------------------------------------------------------------------------------


@dataclass
class Ticks:
    """What a coroutine that wants to run every TICK_S saw while some work ran."""

    work_s: float
    gaps: list[float]

    @property
    def max_gap_s(self) -> float:
        return max(self.gaps)


async def ticks_during(work: Awaitable[Any]) -> tuple[Any, Ticks]:
    stop = asyncio.Event()
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(TICK_S)  # the ticker is running before the work starts
    gaps.clear()
    started = time.perf_counter()
    result = await work
    work_s = time.perf_counter() - started
    stop.set()
    await ticker
    return result, Ticks(work_s, gaps)


def _check_loop_kept_serving(off_loop: Ticks, on_loop: Ticks) -> None:
    # Ratios of what this test measured, no bound in seconds: the ticker kept running
    # through the work, no gap of it near the work's length ...
    assert off_loop.max_gap_s * 4 < off_loop.work_s, off_loop
    # ... and far less stalled than the same work on the loop, whose one gap is the work.
    assert off_loop.max_gap_s * 4 < on_loop.max_gap_s, (off_loop.max_gap_s, on_loop.max_gap_s)


async def test_a_large_prompt_is_tokenized_off_the_event_loop() -> None:
    body = chat_body("a" * LARGE_PROMPT_CHARS)
    outcomes = {}
    # Baseline: everything on the loop, as before (a threshold above the body's size).
    for name, inline_bytes in (("on_loop", len(body)), ("off_loop", 0)):
        async with in_process_router(router={"inline_prepare_max_bytes": inline_bytes}) as router:
            await answer(router.chat_completions, http_request(CHAT, chat_body()))  # warm
            response, ticks = await ticks_during(
                answer(router.chat_completions, http_request(CHAT, body))
            )
            assert response.status_code == 400  # over the context, once it is tokenized
            assert b"maximum context length" in response.body
            outcomes[name] = ticks
    _check_loop_kept_serving(outcomes["off_loop"], outcomes["on_loop"])


async def test_a_trusted_template_bomb_renders_off_the_event_loop(tokenizer: Any) -> None:
    trusting = validator(tokenizer, trust_request_chat_template=True)
    body = chat(chat_template=BOMB, max_tokens=4)
    # Baseline: the same render called on the loop.
    _, on_loop = await ticks_during(_on_loop(trusting.prepare, ChatCompletionRequest, dict(body)))
    prepared, off_loop = await ticks_during(
        trusting.prepare_off_loop(ChatCompletionRequest, dict(body), size=len(str(body)))
    )
    assert bytes(i for i in prepared.prompt_token_ids if i < 256) == b"hi"
    _check_loop_kept_serving(off_loop, on_loop)


async def _on_loop(function: Any, *args: Any) -> Any:
    return function(*args)
