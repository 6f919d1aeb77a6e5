"""Turn a validated OpenAI request into token ids and sampling parameters for an engine.

Parsing uses vLLM's own OpenAI protocol models; what they accept but we do not serve
is refused here with a 400 that names the parameter. Untrusted input stays inside
limits (``router.max_request_bytes``; a chat template only from a trusted client) and
off the event loop: large bodies are parsed and tokenized in worker threads.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import typing
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError

from router.http.errors import OpenAIError, bad_request
from router.settings import PRIORITIES, Priority, RouterConfig, UnknownFields
from splitserve.metric_catalogue import PRIORITY_HEADER

OpenAIRequest = CompletionRequest | ChatCompletionRequest
# Any of vLLM's request models (the adapter routes' too).
Parsed = TypeVar("Parsed", bound=BaseModel)
T = TypeVar("T")
CHAT_TEMPLATE_PARAM = "chat_template"
TEMPLATE_KWARGS_PARAM = "chat_template_kwargs"

# (parameter, is it set to something only vLLM's serving layer answers?): such requests
# go through it (router/http/vllm_frontend.py); the rest take the router's own path.
_VLLM_FEATURES: list[tuple[str, Callable[[Any], bool]]] = [
    ("n", lambda v: v is not None and v != 1),
    ("use_beam_search", bool),
    ("best_of", lambda v: v is not None and v > 1),
    ("echo", bool),
    ("suffix", lambda v: v is not None),
    ("logprobs", lambda v: v not in (None, False)),
    ("top_logprobs", lambda v: v not in (None, 0)),
    ("prompt_logprobs", lambda v: v is not None),
    ("tools", bool),
    ("tool_choice", lambda v: v not in (None, "none")),
    ("documents", bool),
    ("stream_options", lambda v: v is not None and bool(v.continuous_usage_stats)),
]
# What neither path takes from a client: (parameter, is it set?, why).
_REFUSED: list[tuple[str, Callable[[Any], bool], str]] = [
    ("prompt_embeds", lambda v: v is not None, "prompt_embeds are not supported"),
    # The router's own hand-over between prefill and decode engines: a client's would
    # reach the decode engine's KV connector unchecked.
    (
        "kv_transfer_params",
        lambda v: v is not None,
        "set by the router for prefill/decode hand-over, not by clients",
    ),
    # vLLM's encoder-cache hand-over between engines, the twin of kv_transfer_params.
    (
        "ec_transfer_params",
        lambda v: v is not None,
        "an engine-to-engine hand-over field, not set by clients",
    ),
]
# What a message of the router's own path holds; anything else (tool calls, a tool's
# answer, content parts other than text) is rendered by vLLM's layer.
_PLAIN_MESSAGE_KEYS = frozenset({"role", "content", "name"})


class ServedByVllm(Exception):
    """The request uses what only vLLM's serving layer answers (``feature``)."""

    def __init__(self, request: OpenAIRequest, feature: str) -> None:
        super().__init__(feature)
        self.request = request
        self.feature = feature


def vllm_feature_of(request: OpenAIRequest) -> str | None:
    """The first thing ``request`` asks for that the router's own path does not render."""
    for param, is_set in _VLLM_FEATURES:
        if is_set(getattr(request, param, None)):
            return param
    if isinstance(request, CompletionRequest) and _is_batch(request.prompt):
        return "prompt"
    if isinstance(request, ChatCompletionRequest):
        for message in request.messages:
            if not isinstance(message, dict) or message.keys() - _PLAIN_MESSAGE_KEYS:
                return "messages"
            content = message.get("content")
            if isinstance(content, list) and any(
                not isinstance(part, dict) or part.get("type") != "text" for part in content
            ):
                return "messages"
    return None


def _is_batch(prompt: Any) -> bool:
    """Several prompts (strings or token-id lists) in one completion request."""
    if not isinstance(prompt, list) or len(prompt) < 2:
        return False
    return all(isinstance(p, str | list) for p in prompt)


@dataclass(slots=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    sampling_params: Any
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse_request(
    model_cls: type[Parsed], body: Any, unknown_fields: UnknownFields = "ignore"
) -> Parsed:
    """``unknown_fields``: what a field neither OpenAI's API nor vLLM's knows gets:
    ignored (vLLM's models keep it aside and log its name at debug level) or a 400."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if unknown_fields == "reject" and (unknown := sorted(body.keys() - _field_names(model_cls))):
        raise bad_request(f"unrecognized request argument: {unknown[0]!r}", unknown[0])
    if model_cls is ChatCompletionRequest and not isinstance(body.get("messages"), list):
        # vLLM's validators iterate it before pydantic checks its type (a TypeError).
        raise bad_request("'messages' must be a list of message objects", "messages")
    try:
        return _adapter(model_cls).validate_python(body)
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


@functools.cache
def _adapter(model_cls: Any) -> TypeAdapter[Any]:
    """Validates into ``model_cls``, a model or a union of them (vLLM's TokenizeRequest)."""
    return TypeAdapter(model_cls)


@functools.cache
def _field_names(model_cls: Any) -> frozenset[str]:
    names: set[str] = set()
    for model in typing.get_args(model_cls) or (model_cls,):  # a union: any member's
        names.update(model.model_fields)
        names.update(f.alias for f in model.model_fields.values() if f.alias)
    return frozenset(names)


def _from_vllm(error: VLLMValidationError) -> OpenAIError:
    return bad_request(str(error.args[0]) if error.args else str(error), error.parameter)


def reject_unsupported(request: OpenAIRequest) -> None:
    for param, is_unsupported, why in _REFUSED:
        if is_unsupported(getattr(request, param, None)):
            raise bad_request(f"'{param}': {why}", param)


def route_request(request: OpenAIRequest) -> None:
    """Refuse what no path takes; ServedByVllm for what vLLM's layer must answer."""
    reject_unsupported(request)
    if (feature := vllm_feature_of(request)) is not None:
        raise ServedByVllm(request, feature)


class PromptBuilder:
    """Tokenizes prompts with the model's own tokenizer and chat template; a template
    sent by the client only with ``trust_request_chat_template``, as vLLM.

    ``max_model_len`` is the context a prompt and its answer must fit; the router sets
    it to what the engines report once they are up (engines derive it as vLLM does).
    """

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        trust_request_chat_template: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._trust_templates = trust_request_chat_template
        # apply_chat_template's own arguments, which chat_template_kwargs must not set:
        # the router sets them (tokenize, add_generation_prompt), they change what comes
        # back (return_dict, return_tensors), or they carry what the router refuses
        # elsewhere (tools, documents). What is left are the template's own variables.
        self._reserved_kwargs = _named_parameters(tokenizer.apply_chat_template) - {
            CHAT_TEMPLATE_PARAM
        }

    @property
    def trusts_request_templates(self) -> bool:
        return self._trust_templates

    def prepare(self, request: OpenAIRequest) -> PreparedRequest:
        route_request(request)
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
        tokens = [t for t in prompt if isinstance(t, int)] if isinstance(prompt, list) else []
        if isinstance(prompt, list) and tokens and len(tokens) == len(prompt):
            bad = [t for t in tokens if not 0 <= t < self._vocab_size]
            if bad:
                raise bad_request(
                    f"'prompt' has token ids outside the vocabulary [0, {self._vocab_size}):"
                    f" {bad[:5]}",
                    "prompt",
                )
            return tokens
        raise bad_request(
            "'prompt' must be one string or one list of token ids; send one prompt per request",
            "prompt",
        )

    def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        if not request.messages:
            raise bad_request("'messages' must not be empty", "messages")
        messages = [_plain_message(message, i) for i, message in enumerate(request.messages)]
        template_kwargs = self._template_kwargs(request)
        try:
            text = self._tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tokenize=False,
                **template_kwargs,
            )
        except Exception as error:  # a template's own error is the client's to see
            raise bad_request(f"the chat template failed: {error}", "messages") from None
        if not isinstance(text, str):
            raise bad_request("the chat template did not render text", "messages")
        # The template writes bos itself; adding special tokens again would double it.
        return self._encode(text, add_special_tokens=False)

    def _template_kwargs(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """``chat_template_kwargs`` as the template gets them, with the request's own
        template (top level or among the kwargs) only from a trusted client."""
        kwargs = dict(request.chat_template_kwargs or {})
        reserved = sorted(kwargs.keys() & self._reserved_kwargs)
        if reserved:
            param = f"{TEMPLATE_KWARGS_PARAM}.{reserved[0]}"
            raise bad_request(f"'{param}' is set by the router, not by requests", param)
        for param, template in (
            (CHAT_TEMPLATE_PARAM, request.chat_template),
            (f"{TEMPLATE_KWARGS_PARAM}.{CHAT_TEMPLATE_PARAM}", kwargs.get(CHAT_TEMPLATE_PARAM)),
        ):
            if template is not None and not self._trust_templates:
                raise bad_request(
                    f"'{param}': a chat template sent with a request is refused; the server"
                    " runs its model's own (router.trust_request_chat_template allows them)",
                    param,
                )
        if request.chat_template is not None:
            kwargs[CHAT_TEMPLATE_PARAM] = request.chat_template
        return kwargs

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens;"
                f" the prompt has {prompt_len} tokens.",
                "prompt",
            )
        if requested is None:
            return room
        if requested < 1:
            raise bad_request("'max_tokens' must be at least 1", "max_tokens")
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens."
                f" However, you requested {prompt_len + requested} tokens ({prompt_len} in"
                f" the prompt, {requested} for the completion). Reduce the prompt or"
                " max_tokens.",
                "max_tokens",
            )
        return requested


def _named_parameters(function: Callable[..., Any]) -> frozenset[str]:
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    parameters = inspect.signature(function).parameters.values()
    return frozenset(p.name for p in parameters if p.kind not in variadic)


def has_request_template(body: Any) -> bool:
    """Whether a body carries a chat template of its own (rendering one may take long)."""
    if not isinstance(body, dict):
        return False
    kwargs = body.get(TEMPLATE_KWARGS_PARAM)
    return body.get(CHAT_TEMPLATE_PARAM) is not None or (
        isinstance(kwargs, dict) and kwargs.get(CHAT_TEMPLATE_PARAM) is not None
    )


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
    try:
        # vLLM's models validate content parts lazily, as they are iterated here.
        for part in content:
            if part.get("type") != "text":
                raise bad_request(
                    f"messages[{index}]: content of type {part.get('type')!r} is not"
                    " supported; only text",
                    f"messages.{index}.content",
                )
            texts.append(part.get("text", ""))
    except ValidationError as error:
        first = error.errors()[0]
        raise bad_request(
            f"messages[{index}]: invalid content part: {first['msg']}", f"messages.{index}.content"
        ) from None
    return {"role": role, "content": "".join(texts)}


class RequestValidator:
    """Everything between a request's raw body and what the engines get, in the order
    the router runs it; anything the client got wrong is an OpenAIError (4xx) in
    OpenAI's format, never an exception of another kind (tests/router/http/test_hostile_input.py
    throws generated bodies at exactly this path)."""

    def __init__(
        self,
        prompts: PromptBuilder,
        served_name: str,
        limits: RouterConfig | None = None,
        is_adapter: Callable[[str], bool] = lambda name: False,
    ) -> None:
        """``is_adapter``: whether a name is one of the model's LoRA adapters now."""
        self._prompts = prompts
        self._served_name = served_name
        self._is_adapter = is_adapter
        self._limits = limits or RouterConfig()
        # Threads of their own, so that a burst of large bodies waits here and leaves
        # asyncio's default executor (which the event loop's own work uses) alone.
        self._threads = ThreadPoolExecutor(
            self._limits.prepare_threads, thread_name_prefix="splitserve-prepare"
        )

    async def receive(self, headers: Mapping[str, str], chunks: AsyncIterator[bytes]) -> bytes:
        """The request body, read no further than ``router.max_request_bytes`` (413)."""
        limit = self._limits.max_request_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        body = bytearray()
        async for chunk in chunks:
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
        return bytes(body)

    async def decode_off_loop(self, raw: bytes) -> Any:
        """The JSON body (``decode_json_body``), in a worker thread when it is large."""
        large = len(raw) > self._limits.inline_prepare_max_bytes
        return await self._run(large, decode_json_body, raw)

    async def prepare_off_loop(
        self, model_cls: type[OpenAIRequest], body: Any, size: int
    ) -> PreparedRequest:
        """``prepare``, in a worker thread when the body (of ``size`` bytes) is large or
        brings a chat template of its own, so that the event loop keeps serving."""
        template = self._prompts.trusts_request_templates and has_request_template(body)
        slow = size > self._limits.inline_prepare_max_bytes or template
        return await self._run(slow, self.prepare, model_cls, body)

    async def _run(self, off_loop: bool, function: Callable[..., T], *args: Any) -> T:
        if not off_loop:
            return function(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, function, *args)

    def prepare(self, model_cls: type[OpenAIRequest], body: Any) -> PreparedRequest:
        request = parse_request(model_cls, body, self._limits.unknown_fields)
        if request.model is not None and self._is_adapter(request.model):
            # vLLM's layer resolves the adapter as vllm serve does, and hands it on.
            raise ServedByVllm(request, "lora_adapter")
        if request.model is not None and request.model != self._served_name:
            raise OpenAIError(
                f"The model '{request.model}' does not exist; this server serves"
                f" '{self._served_name}'.",
                HTTPStatus.NOT_FOUND,
                "model",
            )
        return self._prompts.prepare(request)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"the request body is larger than the {limit} bytes this server takes"
        " (router.max_request_bytes)",
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    )


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


def take_priority(body: Any, headers: Any, default: Priority) -> Priority:
    """The request's priority from its ``priority`` field (removed from the body, since
    vLLM's own ``priority`` is an integer) or else the ``x-priority`` header."""
    value = body.pop("priority", None) if isinstance(body, dict) else None
    where = "priority"
    if value is None:
        value, where = headers.get(PRIORITY_HEADER), f"{PRIORITY_HEADER} header"
    if value is None:
        return default
    name = str(value).strip().lower()
    if name not in PRIORITIES:
        raise OpenAIError(
            f"{where} must be one of {', '.join(PRIORITIES)}; got {value!r}",
            HTTPStatus.BAD_REQUEST,
            "priority",
        )
    return name
