"""One corpus of OpenAI and Anthropic requests, each answered by bare ``vllm serve`` and by
every shape.

Every kind exercises one feature of vLLM's API (tools, schemas, logprobs, seeds, n,
echo, the Responses API, tokenize, Anthropic's Messages API...), streamed and not. An
answer is compared by what a client reads from it: the status, each choice's text and
token ids, tool calls, finish reasons, usage, and logprobs within ``LOGPROB_TOLERANCE``;
a Messages answer by its content blocks, stop reason and usage. A stream is folded into
one answer first, since its chunking is the server's own business. Ids and timestamps,
which differ on every call, are left out.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx

from engines.tiny_model import EMBEDDED_MODEL_NAME as MODEL

LOGPROB_TOLERANCE = 1e-3
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The capital of France is"
USER = [{"role": "user", "content": "What is the weather in Paris today?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 1234}
PENALTIES = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.3}


def completion(**fields: Any) -> tuple[str, dict[str, Any]]:
    return COMPLETIONS, {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, **fields}


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": MODEL, "messages": USER, "max_tokens": 8, **fields}
    return CHAT, body


MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
# Anthropic's spelling of WEATHER_TOOL.
WEATHER_TOOL_ANTHROPIC = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER_TOOL["function"]["parameters"],  # type: ignore[index]
}
TOOL_USE_HISTORY = [
    *USER,
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}],
    },
]
MULTI_TURN = [
    *USER,
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
]


def messages(**fields: Any) -> tuple[str, dict[str, Any]]:
    """An Anthropic Messages request (temperature 0 unless told)."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 8, "temperature": 0, **fields}
    return MESSAGES, body


def _both(name: str, route_body: tuple[str, dict[str, Any]]) -> dict[str, tuple[str, dict]]:
    """A kind, streamed and not."""
    route, body = route_body
    return {name: (route, body), f"{name}-stream": (route, {**body, "stream": True})}


TOOL_CALL_HISTORY = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
]

# name -> (route, body); temperature 0 unless a seed is given.
CORPUS: dict[str, tuple[str, dict[str, Any]]] = {
    **_both("completion", completion(temperature=0, return_token_ids=True)),
    "completion-token-ids": completion(prompt=[72, 101, 108, 108, 111], temperature=0),
    "completion-batch": completion(prompt=["Hello", "One two three"], temperature=0),
    **_both("completion-n2-seeded", completion(n=2, **SEEDED)),
    **_both("completion-logprobs", completion(temperature=0, logprobs=3)),
    "completion-echo": completion(temperature=0, echo=True),
    "completion-echo-logprobs": completion(temperature=0, echo=True, logprobs=2, max_tokens=4),
    "completion-prompt-logprobs": completion(temperature=0, prompt_logprobs=2),
    "completion-stop-string": completion(temperature=0, stop=["e"], max_tokens=16),
    "completion-stop-token": completion(temperature=0, stop_token_ids=[101], max_tokens=16),
    **_both("completion-seeded", completion(**SEEDED, max_tokens=12)),
    **_both("completion-seeded-penalties", completion(**SEEDED, **PENALTIES, max_tokens=12)),
    "completion-min-tokens": completion(temperature=0, min_tokens=6, max_tokens=8),
    "completion-logit-bias": completion(temperature=0, logit_bias={"65": 100}),
    **_both(
        "completion-regex",
        completion(temperature=0, structured_outputs={"regex": "[0-9]{3}-[a-z]{4}"}),
    ),
    "completion-choice": completion(temperature=0, structured_outputs={"choice": ["yes", "no"]}),
    "completion-json-schema": completion(
        temperature=0, structured_outputs={"json": PERSON_SCHEMA}, max_tokens=40
    ),
    "completion-ignore-eos": completion(temperature=0, ignore_eos=True),
    "completion-bad-words": completion(temperature=0, bad_words=["e", "a"]),
    "completion-allowed-tokens": completion(temperature=0, allowed_token_ids=[72, 105, 33]),
    # ignore_eos: the random-weight model's next-token distribution is nearly flat, so
    # the end-of-sequence token sits at the edge of a beam's top candidates; KV that a
    # split computed in other chunks differs in the last float bits, and that was enough
    # (once, in CI) to complete a one-token beam, which then outranks every longer one.
    "completion-beam-search": completion(use_beam_search=True, n=2, max_tokens=4, ignore_eos=True),
    **_both("chat", chat(temperature=0)),
    "chat-usage-stream": chat(temperature=0, stream=True, stream_options={"include_usage": True}),
    "chat-continuous-usage": chat(
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ),
    **_both("chat-logprobs", chat(temperature=0, logprobs=True, top_logprobs=2)),
    **_both("chat-n2-seeded", chat(n=2, **SEEDED)),
    **_both("chat-seeded-penalties", chat(**SEEDED, **PENALTIES, max_tokens=12)),
    "chat-json-object": chat(temperature=0, response_format={"type": "json_object"}, max_tokens=24),
    **_both(
        "chat-json-schema",
        chat(
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
            },
            max_tokens=40,
        ),
    ),
    "chat-regex": chat(temperature=0, structured_outputs={"regex": "[0-9]{3}-[a-z]{4}"}),
    "chat-tools-none": chat(temperature=0, tools=[WEATHER_TOOL], tool_choice="none"),
    "chat-tools-auto": chat(temperature=0, tools=[WEATHER_TOOL], tool_choice="auto"),
    **_both(
        "chat-tools-required",
        chat(temperature=0, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=96),
    ),
    **_both(
        "chat-tools-named",
        chat(
            temperature=0,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=96,
        ),
    ),
    "chat-tool-result": chat(temperature=0, messages=TOOL_CALL_HISTORY, tools=[WEATHER_TOOL]),
    "chat-echo": chat(
        temperature=0,
        echo=True,
        messages=[*USER, {"role": "assistant", "content": "It is"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    "chat-return-token-ids": chat(temperature=0, return_token_ids=True),
    "responses": (
        "/v1/responses",
        {"model": MODEL, "input": PROMPT, "max_output_tokens": 8, "temperature": 0},
    ),
    "tokenize-prompt": ("/tokenize", {"model": MODEL, "prompt": PROMPT}),
    "tokenize-chat": ("/tokenize", {"model": MODEL, "messages": USER}),
    "detokenize": ("/detokenize", {"model": MODEL, "tokens": [72, 101, 108, 108, 111]}),
    "unknown-model": (COMPLETIONS, {"model": "gpt-17", "prompt": "x"}),
    **_both("messages", messages()),
    **_both(
        "messages-system-multi-turn",
        messages(system="Answer in one word.", messages=MULTI_TURN, max_tokens=12),
    ),
    "messages-system-blocks": messages(system=[{"type": "text", "text": "Be brief."}]),
    **_both("messages-stop-sequences", messages(stop_sequences=["e"], max_tokens=16)),
    # top_k 1: the sampling fields are taken and passed on, and the answer stays greedy.
    "messages-sampling": messages(temperature=0.9, top_p=0.95, top_k=1, max_tokens=12),
    "messages-tools-auto": messages(
        tools=[WEATHER_TOOL_ANTHROPIC], tool_choice={"type": "auto"}, max_tokens=96
    ),
    **_both(
        "messages-tools-any",
        messages(tools=[WEATHER_TOOL_ANTHROPIC], tool_choice={"type": "any"}, max_tokens=96),
    ),
    **_both(
        "messages-tools-named",
        messages(
            tools=[WEATHER_TOOL_ANTHROPIC],
            tool_choice={"type": "tool", "name": "get_weather"},
            max_tokens=96,
        ),
    ),
    "messages-tool-result": messages(messages=TOOL_USE_HISTORY, tools=[WEATHER_TOOL_ANTHROPIC]),
    "messages-count-tokens": (
        COUNT_TOKENS,
        {"model": MODEL, "messages": MULTI_TURN, "system": "Answer in one word."},
    ),
    "messages-unknown-model": (MESSAGES, {**messages()[1], "model": "claude-17"}),
    "messages-past-the-context": messages(max_tokens=10**6),
    "past-the-context": completion(max_tokens=10**6),
    "suffix": completion(suffix="!"),
}

# Fields of an answer that differ on every call, whoever serves it.
_VOLATILE = {"id", "created", "created_at", "system_fingerprint", "request_id", "item_id"}


def ask(
    client: httpx.Client, route: str, body: dict[str, Any], model: str = MODEL
) -> dict[str, Any]:
    """What a client reads from one answer, volatile fields left out. ``model``: the
    served name to ask (the corpus names MODEL); its answer reads as MODEL's."""
    if body.get("model") == MODEL:
        body = {**body, "model": model}
    if route.startswith("/v1/models"):
        response = client.get(route)
    else:
        response = client.post(route, json=body)
    if model != MODEL:
        response = _as_named(response, model)
    answer: dict[str, Any] = {"status": response.status_code}
    if response.status_code != 200:
        error = response.json()
        answer["error"] = (error.get("error") or {}).get("type") or error
        return answer
    if body.get("stream") and route == MESSAGES:
        answer["body"] = _fold_messages_stream(response.text)
    elif body.get("stream"):
        answer["body"] = _fold_stream(response.text)
    else:
        answer["body"] = _read(response.json())
    return answer


def _as_named(response: httpx.Response, model: str) -> httpx.Response:
    """The response with ``model``'s name written as MODEL's, wherever it names it."""
    content = response.content.replace(f'"{model}"'.encode(), f'"{MODEL}"'.encode())
    return httpx.Response(response.status_code, headers=response.headers, content=content)


def _read(body: dict[str, Any]) -> dict[str, Any]:
    body = _without_volatile(body)
    if "choices" not in body:
        return body  # the Responses API, tokenize, a model card: vLLM renders them all
    return {
        "object": body.get("object"),
        "model": body.get("model"),
        "choices": [_read_choice(choice) for choice in body["choices"]],
        "usage": _usage(body.get("usage")),
    }


def _read_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """What a client reads from one choice, message or text alike."""
    message = choice.get("message") or {}
    read = {
        "index": choice["index"],
        "text": choice.get("text", message.get("content")),
        "reasoning": message.get("reasoning"),
        "tool_calls": [_tool_call(call) for call in message.get("tool_calls") or ()],
        "token_ids": choice.get("token_ids"),
        "logprobs": choice.get("logprobs"),
        "prompt_logprobs": choice.get("prompt_logprobs"),
        "finish_reason": choice.get("finish_reason"),
        "stop_reason": choice.get("stop_reason"),
    }
    return {key: value for key, value in read.items() if value not in (None, [])}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", {})
    return {"name": function.get("name"), "arguments": function.get("arguments")}


def _fold_stream(text: str) -> dict[str, Any]:
    """A stream as one answer: per choice, its text, token ids, logprobs and tool calls
    joined in order, its last finish reason; the last usage."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    events = [
        line.removeprefix("data: ")
        for line in text.split("\n")
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    for event in events:
        chunk = json.loads(event)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            _fold_choice(choices.setdefault(choice["index"], {}), choice)
    folded = [_folded(choices[i]) for i in sorted(choices)]
    return {"choices": folded, "usage": _usage(usage)}


def _fold_messages_stream(text: str) -> dict[str, Any]:
    """A Messages stream as one answer: its content blocks (text joined, a tool call's
    input parsed from its JSON deltas), the last stop reason, and the usage its events
    reported (the start's input tokens, the last delta's output tokens)."""
    blocks: dict[int, dict[str, Any]] = {}
    folded: dict[str, Any] = {"events": [], "usage": {}}
    for line in text.split("\n"):
        if not line.startswith("data: "):
            continue
        event = json.loads(line.removeprefix("data: "))
        kind = event.get("type")
        folded["events"].append(kind)
        if kind == "message_start":
            folded["usage"].update(event["message"].get("usage") or {})
        elif kind == "content_block_start":
            block = _without_volatile(event["content_block"])
            blocks[event["index"]] = {**block, "partial_json": ""}
        elif kind == "content_block_delta":
            _fold_block_delta(blocks[event["index"]], event["delta"])
        elif kind == "message_delta":
            folded["stop_reason"] = event["delta"].get("stop_reason")
            folded["usage"].update(event.get("usage") or {})
    folded["content"] = [_finished_block(blocks[index]) for index in sorted(blocks)]
    # Pings, and how many deltas a block's text or JSON came in, are the server's own
    # chunking (a relay behind its engine joins deltas); the order of the rest is the
    # protocol's.
    kinds = [kind for kind in folded["events"] if kind != "ping"]
    folded["events"] = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    return folded


def _fold_block_delta(block: dict[str, Any], delta: dict[str, Any]) -> None:
    if delta.get("type") == "text_delta":
        block["text"] = block.get("text", "") + delta["text"]
    elif delta.get("type") == "input_json_delta":
        block["partial_json"] += delta["partial_json"]


def _finished_block(block: dict[str, Any]) -> dict[str, Any]:
    partial = block.pop("partial_json")
    if block.get("type") == "tool_use" and partial:
        block["input"] = json.loads(partial)
    return block


def _folded(choice: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" in choice:
        choice["tool_calls"] = [choice["tool_calls"][i] for i in sorted(choice["tool_calls"])]
    return {key: value for key, value in choice.items() if value not in (None, [])}


def _fold_choice(into: dict[str, Any], choice: dict[str, Any]) -> None:
    delta = choice.get("delta") or {}
    text = choice.get("text", delta.get("content"))
    if text:
        into["text"] = into.get("text", "") + text
    if delta.get("reasoning"):
        into["reasoning"] = into.get("reasoning", "") + delta["reasoning"]
    for field in ("token_ids",):
        if choice.get(field):
            into[field] = [*into.get(field, []), *choice[field]]
    logprobs = choice.get("logprobs")
    if logprobs:
        for key, value in logprobs.items():
            if isinstance(value, list):
                into.setdefault("logprobs", {}).setdefault(key, []).extend(value)
    for call in delta.get("tool_calls") or ():
        calls = into.setdefault("tool_calls", {})
        slot = calls.setdefault(call["index"], {"name": None, "arguments": ""})
        function = call.get("function") or {}
        slot["name"] = function.get("name") or slot["name"]
        slot["arguments"] += function.get("arguments") or ""
    if choice.get("finish_reason") is not None:
        into["finish_reason"] = choice["finish_reason"]
        into["stop_reason"] = choice.get("stop_reason")
    if choice.get("prompt_logprobs"):
        into["prompt_logprobs"] = choice["prompt_logprobs"]


def _without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def differences(theirs: Any, ours: Any, path: str = "") -> list[str]:
    """Where ``ours`` differs from ``theirs``: floats within LOGPROB_TOLERANCE count as
    equal (float32 reductions differ by split), everything else must be equal."""
    if isinstance(theirs, float) and isinstance(ours, float | int):
        if math.isclose(theirs, ours, abs_tol=LOGPROB_TOLERANCE) or theirs == ours:
            return []
        return [f"{path}: {theirs!r} != {ours!r}"]
    if isinstance(theirs, dict) and isinstance(ours, dict):
        found = []
        for key in sorted(theirs.keys() | ours.keys()):
            if key not in ours or key not in theirs:
                found.append(f"{path}.{key}: only in {'vllm' if key in theirs else 'ours'}")
                continue
            found.extend(differences(theirs[key], ours[key], f"{path}.{key}"))
        return found
    if isinstance(theirs, list) and isinstance(ours, list):
        if len(theirs) != len(ours):
            return [f"{path}: {len(theirs)} items != {len(ours)}"]
        found = []
        for index, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            found.extend(differences(a, b, f"{path}[{index}]"))
        return found
    return [] if theirs == ours else [f"{path}: {theirs!r} != {ours!r}"]


def answers(base_url: str, model: str = MODEL) -> dict[str, dict[str, Any]]:
    """Every kind of the corpus, asked of one server's ``model`` in order."""
    with httpx.Client(base_url=base_url, timeout=300) as client:
        return {name: ask(client, route, body, model) for name, (route, body) in CORPUS.items()}


def bare_vllm_reference(base_url: str) -> dict[str, dict[str, Any]]:
    """The corpus as bare `vllm serve` answers it (asked by conftest's bare_vllm_answers)."""
    return answers(base_url)


def assert_answers_as(
    reference: dict[str, dict[str, Any]], base_url: str, model: str = MODEL
) -> None:
    """Every kind answered by ``model`` at ``base_url`` as in ``reference`` (bare vLLM's
    answers to MODEL: a served model of another name reads as if it were named so)."""
    ours = answers(base_url, model)
    found = {
        name: problems
        for name in CORPUS
        if (problems := differences(reference[name], ours[name], name))
    }
    assert not found, "answered unlike bare vLLM:\n" + "\n".join(
        line for problems in found.values() for line in problems[:5]
    )
