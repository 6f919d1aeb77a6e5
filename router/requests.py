"""Turn a validated OpenAI request into token ids and sampling parameters for an engine.

Parsing uses vLLM's own OpenAI protocol models; what they accept but we do not serve
is refused here with a 400 that names the parameter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError

from router.errors import OpenAIError, bad_request
from router.qos import take_priority
from router.settings import Priority

OpenAIRequest = CompletionRequest | ChatCompletionRequest

# (parameter, is it set to something we do not serve?, why)
_UNSUPPORTED: list[tuple[str, Callable[[Any], bool], str]] = [
    ("n", lambda v: v is not None and v != 1, "only n=1 is supported"),
    ("use_beam_search", bool, "beam search is not supported"),
    ("best_of", lambda v: v is not None and v > 1, "best_of is not supported"),
    ("echo", bool, "echo is not supported"),
    ("suffix", lambda v: v is not None, "suffix is not supported"),
    ("logprobs", lambda v: v not in (None, False), "logprobs are not supported yet"),
    ("top_logprobs", lambda v: v not in (None, 0), "logprobs are not supported yet"),
    ("prompt_logprobs", lambda v: v is not None, "prompt_logprobs are not supported"),
    ("prompt_embeds", lambda v: v is not None, "prompt_embeds are not supported"),
    ("tools", bool, "tool calling is not supported"),
    # The router's own hand-over between prefill and decode engines: a client's would
    # reach the decode engine's KV connector unchecked.
    (
        "kv_transfer_params",
        lambda v: v is not None,
        "set by the router for prefill/decode hand-over, not by clients",
    ),
]


@dataclass(slots=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    sampling_params: Any
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse_request(model_cls: type[OpenAIRequest], body: Any) -> OpenAIRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if model_cls is ChatCompletionRequest and not isinstance(body.get("messages"), list):
        # vLLM's validators iterate it before pydantic checks its type (a TypeError).
        raise bad_request("'messages' must be a list of message objects", "messages")
    try:
        return model_cls.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise bad_request(f"invalid value for '{param}': {first['msg']}", param) from None
    except VLLMValidationError as error:
        raise _from_vllm(error) from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as error:
        # A validator of vLLM's that met a shape it did not expect (``structured_outputs:
        # []`` reaches ``.get`` on a list): still the client's mistake, not a 500.
        raise bad_request(f"invalid request: {type(error).__name__}: {error}") from None


def _from_vllm(error: VLLMValidationError) -> OpenAIError:
    return bad_request(str(error.args[0]) if error.args else str(error), error.parameter)


def reject_unsupported(request: OpenAIRequest) -> None:
    for param, is_unsupported, why in _UNSUPPORTED:
        if is_unsupported(getattr(request, param, None)):
            raise bad_request(f"'{param}': {why}", param)


class PromptBuilder:
    """Tokenizes prompts with the model's own tokenizer and chat template."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size

    def prepare(self, request: OpenAIRequest) -> PreparedRequest:
        reject_unsupported(request)
        if isinstance(request, ChatCompletionRequest):
            prompt_ids = self._chat_prompt(request)
            requested = request.max_completion_tokens or request.max_tokens
        else:
            prompt_ids = self._completion_prompt(request)
            requested = request.max_tokens
        max_tokens = self._max_tokens(len(prompt_ids), requested)
        try:
            sampling_params = request.to_sampling_params(max_tokens, {})
        except VLLMValidationError as error:
            raise _from_vllm(error) from None
        except ValueError as error:
            raise bad_request(str(error)) from None
        stream = bool(request.stream)
        options = request.stream_options
        return PreparedRequest(
            prompt_token_ids=prompt_ids,
            sampling_params=sampling_params,
            stream=stream,
            include_usage=bool(stream and options and options.include_usage),
            return_token_ids=bool(request.return_token_ids),
        )

    def _completion_prompt(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("'prompt' must not be empty", "prompt")
            return self._encode(prompt, add_special_tokens=request.add_special_tokens)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self._vocab_size]
            if bad:
                raise bad_request(
                    f"'prompt' has token ids outside the vocabulary [0, {self._vocab_size}):"
                    f" {bad[:5]}",
                    "prompt",
                )
            return list(prompt)
        raise bad_request(
            "'prompt' must be one string or one list of token ids; send one prompt per request",
            "prompt",
        )

    def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        if not request.messages:
            raise bad_request("'messages' must not be empty", "messages")
        messages = [_plain_message(message, i) for i, message in enumerate(request.messages)]
        try:
            text = self._tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tokenize=False,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as error:  # a template's own error is the client's to see
            raise bad_request(f"the chat template failed: {error}", "messages") from None
        # The template writes bos itself; adding special tokens again would double it.
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        room = self._max_model_len - prompt_len
        if room <= 0:
            raise bad_request(
                f"This model's maximum context length is {self._max_model_len} tokens;"
                f" the prompt has {prompt_len} tokens.",
                "prompt",
            )
        if requested is None:
            return room
        if requested < 1:
            raise bad_request("'max_tokens' must be at least 1", "max_tokens")
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {self._max_model_len} tokens."
                f" However, you requested {prompt_len + requested} tokens ({prompt_len} in"
                f" the prompt, {requested} for the completion). Reduce the prompt or"
                " max_tokens.",
                "max_tokens",
            )
        return requested


def _plain_message(message: Any, index: int) -> dict[str, str]:
    role = message.get("role")
    content = message.get("content")
    if content is None and role != "assistant":
        # OpenAI's API requires it (vLLM's server would template an empty message).
        raise bad_request(
            f"messages[{index}]: 'content' is required for role {role!r}",
            f"messages.{index}.content",
        )
    if isinstance(content, str) or content is None:
        return {"role": role, "content": content or ""}
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise bad_request(
                f"messages[{index}]: content of type {part.get('type')!r} is not supported;"
                " only text",
                f"messages.{index}.content",
            )
        texts.append(part.get("text", ""))
    return {"role": role, "content": "".join(texts)}


class RequestValidator:
    """Everything between a request's raw body and what the engines get, in the order
    the router runs it; anything the client got wrong is an OpenAIError (4xx) in
    OpenAI's format, never an exception of another kind (tests/test_hostile_input.py
    throws generated bodies at exactly this path)."""

    def __init__(self, prompts: PromptBuilder, served_name: str, default: Priority) -> None:
        self._prompts = prompts
        self._served_name = served_name
        self._default_priority = default

    def read(self, raw: bytes, headers: Mapping[str, str]) -> tuple[Priority, Any]:
        """The JSON body, and the request's priority (taken out of it or its headers)."""
        body = decode_json_body(raw)
        return take_priority(body, headers, self._default_priority), body

    def prepare(self, model_cls: type[OpenAIRequest], body: Any) -> PreparedRequest:
        request = parse_request(model_cls, body)
        if request.model is not None and request.model != self._served_name:
            raise OpenAIError(
                f"The model '{request.model}' does not exist; this server serves"
                f" '{self._served_name}'.",
                HTTPStatus.NOT_FOUND,
                "model",
            )
        return self._prompts.prepare(request)


def decode_json_body(raw: bytes) -> Any:
    try:
        parsed = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"malformed JSON in the request body: {error}") from None
    # Valid UTF-8 bytes can still spell a lone UTF-16 surrogate as a \u escape, which no
    # tokenizer or UTF-8 writer takes; the byte test keeps the full check off most bodies.
    if b"\\ud" in raw.lower() and not _encodable(parsed):
        raise bad_request("the request holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
    return parsed


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
