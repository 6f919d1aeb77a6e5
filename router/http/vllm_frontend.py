"""vLLM's own OpenAI serving layer, in front of the router's dispatch.

What ``vllm serve`` answers, the router answers the same way: the request models, chat
rendering, tool and reasoning parsers, structured outputs, logprob formatting, ``n`` >
1, echo, the Responses API, tokenize and detokenize all are vLLM's code. Beneath them
sits ``DispatchingEngineClient``, vLLM's engine-client interface over our dispatch: each
``generate`` is validated by vLLM's input processor (its 400s), admitted, planned and
relayed as the router's own requests are (one ``RequestLife``, router/lifecycle.py),
and its deltas come back as vLLM's ``RequestOutput``. Only requests that need none of
this take the router's hand-rendered path (router/http/plain_answer.py; why:
docs/DECISIONS.md).

vLLM's serving classes call ``engine_client.generate`` with nothing of ours, so each
request is served by a shallow copy of its serving class whose engine client is bound to
the request's life (``_LifeEngineClient``): ``generate`` gets the life as an argument.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from vllm.engine.protocol import EngineClient
from vllm.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicError,
    AnthropicErrorResponse,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
)
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath, LoRAModulePath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError

from engines.model_source import resolve_model
from engines.protocol import GenerateChunk, GenerateRequest, LoraAdapter, TokenLogprobs
from engines.settings import ModelConfig
from router.http.errors import ANTHROPIC_ROUTES, OpenAIError
from router.lifecycle import RequestLife

T = TypeVar("T")
# vLLM's response role for chat answers, as `vllm serve` sets it by default.
RESPONSE_ROLE = "assistant"


class AdapterLoader(Protocol):
    """Loads and unloads LoRA adapters on a model's engines (the router's ServedModel)."""

    async def load(self, adapter: LoraAdapter) -> None: ...

    async def unload(self, int_id: int) -> None: ...


class DispatchingEngineClient(EngineClient):
    """vLLM's engine-client interface over the router's dispatch.

    vLLM's serving classes read its configuration (the same model and limits the engines
    run), render and tokenize with its renderer, and call ``generate``. The rest of the
    interface (sleep, profiling, weight updates) belongs to one engine, not to a router
    of many, and says so."""

    def __init__(self, vllm_config: Any, adapters: AdapterLoader | None = None) -> None:
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self._adapters = adapters

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        life: RequestLife | None = None,
        lora_request: Any = None,
        # vLLM's priority and the rest: the router's own (the life's) are what count.
        **_: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """One engine request of ``life`` (a ``_LifeEngineClient`` passes it): vLLM's
        checks, then planned, admitted, opened and relayed as the router's own path does.
        A refusal or failure before its first token is the life's answer (``life.error``):
        vLLM's layer would make a body of its own of what this raises."""
        assert life is not None, "generate is called through a request's _LifeEngineClient"
        # vLLM's own checks of the parameters and the prompt (what AsyncLLM.generate
        # runs first), so a bad request is the 400 `vllm serve` gives.
        core = self.input_processor.process_inputs(
            request_id,
            prompt,
            sampling_params,
            supported_tasks=("generate",),
            lora_request=lora_request,
        )
        params = core.sampling_params
        assert params is not None
        prompt_ids = list(core.prompt_token_ids or ())
        request = GenerateRequest(
            # vLLM needs ids unique among running requests; clients may reuse theirs.
            request_id=f"{request_id}-{uuid.uuid4().hex[:8]}",
            subscriber="",
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            lora=None if lora_request is None else _adapter_of(lora_request),
        )
        try:
            opened = await life.open(life.plan(request))
        except OpenAIError as error:
            life.error = error
            raise
        life.headers.update(opened.headers())
        whole = params.output_kind == RequestOutputKind.FINAL_ONLY
        outputs = _RequestOutputs(request_id, prompt_ids, params)
        chunks = life.relay(opened, streamed=not whole)
        try:
            if whole:
                async for chunk in chunks:
                    outputs.add(chunk)
                yield outputs.final()
                return
            async for chunk in chunks:
                yield outputs.delta(chunk)
        except Exception as error:
            if whole:  # nothing was sent: the response is this status
                life.error = life.failure_of(opened, error, sent=False)
            raise
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    # ---- state vLLM's serving layer reads --------------------------------------------

    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False  # an engine that fails fails its requests; the others serve on

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    async def check_health(self) -> None:
        return None

    async def do_log_stats(self) -> None:
        return None

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter on every engine of the model (vLLM's serving layer calls this
        for the YAML's adapters and for /v1/load_lora_adapter)."""
        if self._adapters is None:
            raise ValueError("LoRA is not enabled for this model (model.lora_adapters)")
        await self._adapters.load(_adapter_of(lora_request))
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        if self._adapters is None:
            return False
        await self._adapters.unload(lora_id)
        return True

    # ---- one engine's operations, which a router of many does not offer ---------------

    async def abort(self, *args: Any, **kwargs: Any) -> None:
        # Closing a request's stream aborts it where it runs (see generate).
        return None

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise _one_engines("pooling")

    async def is_paused(self) -> bool:
        return False

    async def is_sleeping(self) -> bool:
        return False

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        raise _one_engines("pausing")

    async def resume_generation(self, *args: Any, **kwargs: Any) -> None:
        raise _one_engines("resuming")

    async def release_kv_cache_memory(self, *args: Any, **kwargs: Any) -> None:
        raise _one_engines("releasing KV memory")

    async def reset_encoder_cache(self, *args: Any, **kwargs: Any) -> None:
        raise _one_engines("resetting the encoder cache")

    async def reset_mm_cache(self, *args: Any, **kwargs: Any) -> None:
        raise _one_engines("resetting the multimodal cache")

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        raise _one_engines("resetting the prefix cache")

    async def shutdown(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # vLLM's interface has it synchronous in some releases; the server awaits ours.
        return None

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        raise _one_engines("sleeping")

    async def wake_up(self, *args: Any, **kwargs: Any) -> bool:
        raise _one_engines("waking up")

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise _one_engines("profiling")

    async def stop_profile(self, *args: Any, **kwargs: Any) -> None:
        raise _one_engines("profiling")


def _adapter_of(lora_request: Any) -> LoraAdapter:
    return LoraAdapter(lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)


def _one_engines(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is an operation of one engine, not of the router")


class _RequestOutputs:
    """The router's chunks of one request as vLLM's RequestOutputs: one per chunk when
    streaming (deltas), or one with every completion whole at the end."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._request_id = request_id
        self._prompt_ids = prompt_ids
        self._unfinished = params.n
        self._num_cached_tokens = 0
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._whole: dict[int, CompletionOutput] = {}

    def delta(self, chunk: GenerateChunk) -> RequestOutput:
        self._note(chunk)
        return self._output([_completion(chunk)], _vllm_logprobs(chunk.prompt_logprobs))

    def add(self, chunk: GenerateChunk) -> None:
        self._note(chunk)
        if self._prompt_logprobs is None:
            self._prompt_logprobs = _vllm_logprobs(chunk.prompt_logprobs)
        part = _completion(chunk)
        whole = self._whole.setdefault(chunk.index, part)
        if whole is part:
            return
        whole.text += part.text
        whole.token_ids = [*whole.token_ids, *part.token_ids]
        if part.logprobs is not None:
            whole.logprobs = [*(whole.logprobs or ()), *part.logprobs]
        whole.finish_reason, whole.stop_reason = part.finish_reason, part.stop_reason

    def final(self) -> RequestOutput:
        outputs = [self._whole[index] for index in sorted(self._whole)]
        return self._output(outputs, self._prompt_logprobs)

    def _note(self, chunk: GenerateChunk) -> None:
        self._unfinished -= chunk.finish_reason is not None
        self._num_cached_tokens = max(self._num_cached_tokens, chunk.num_cached_tokens)

    def _output(
        self,
        outputs: list[CompletionOutput],
        prompt_logprobs: list[dict[int, Logprob] | None] | None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=self._request_id,
            prompt=None,
            prompt_token_ids=self._prompt_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=self._unfinished <= 0,
            num_cached_tokens=self._num_cached_tokens,
        )


def _completion(chunk: GenerateChunk) -> CompletionOutput:
    return CompletionOutput(
        index=chunk.index,
        text=chunk.text,
        token_ids=list(chunk.token_ids),
        cumulative_logprob=None,
        logprobs=_vllm_logprobs(chunk.logprobs),  # type: ignore[arg-type]
        finish_reason=chunk.finish_reason,
        stop_reason=chunk.stop_reason,
    )


def _vllm_logprobs(
    positions: list[TokenLogprobs | None] | list[TokenLogprobs] | None,
) -> list[dict[int, Logprob] | None] | None:
    """Plain logprobs back as vLLM's dicts, in the engine's order (the sampled first)."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {token: Logprob(lp, rank, decoded) for token, lp, rank, decoded in position}
        for position in positions
    ]


@dataclass(frozen=True, slots=True)
class FrontendOptions:
    """``vllm serve``'s per-model frontend flags (engines.settings.ModelConfig)."""

    served_name: str
    model_path: str
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, path), vllm serve's --lora-modules

    @classmethod
    def of(cls, model: ModelConfig, trust_request_chat_template: bool) -> FrontendOptions:
        source = resolve_model(model)
        return cls(
            served_name=source.served_name,
            model_path=source.path,
            chat_template=model.chat_template,
            enable_auto_tool_choice=model.enable_auto_tool_choice,
            tool_call_parser=model.tool_call_parser,
            reasoning_parser=model.reasoning_parser,
            trust_request_chat_template=trust_request_chat_template,
            lora_adapters=tuple((a.name, a.path) for a in model.lora_adapters),
        )


async def in_daemon_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` in a daemon thread of its own: unlike an executor's, the
    process does not wait for it to finish before it exits."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as error:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, done, None, error)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=run, name="splitserve-frontend", daemon=True).start()
    return await done


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# Engine arguments that shape what vLLM's serving layer checks and renders (how many
# logprobs a request may ask for, generation defaults, the tokenizer, structured
# outputs): taken from the generating pool's engine_kwargs, so that the router's layer
# accepts what its engines were configured for. The others only size or run engines.
FRONTEND_ENGINE_ARGS = (
    "max_logprobs",
    "logprobs_mode",
    "generation_config",
    "override_generation_config",
    "tokenizer",
    "tokenizer_mode",
    "tokenizer_revision",
    "revision",
    "trust_remote_code",
    "hf_overrides",
    "skip_tokenizer_init",
    "structured_outputs_config",
)


def frontend_config(model: ModelConfig, engine_kwargs: dict[str, Any] | None = None) -> Any:
    """The VllmConfig the engines derive for ``model`` (context, tokenizer, generation
    defaults, structured outputs), as the serving layer reads it; built once per router,
    once its engines are up (seconds). ``engine_kwargs``: the generating pool's."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    source = resolve_model(model)
    args = AsyncEngineArgs(
        model=source.path,
        served_model_name=[source.served_name],
        dtype=model.engine_dtype,  # type: ignore[arg-type]  # validated in ModelConfig
        max_model_len=model.max_model_len,  # type: ignore[arg-type]  # None: the model's
        seed=model.seed,
        enforce_eager=True,  # nothing runs here; no graphs to plan
        reasoning_parser=model.reasoning_parser or "",
        **{k: v for k, v in (engine_kwargs or {}).items() if k in FRONTEND_ENGINE_ARGS},
    )
    if model.lora_enabled:  # vLLM's input checks refuse adapters where LoRA is off
        args.enable_lora = True
        # Only the engines batch adapters; the router's count need not match theirs.
        args.max_loras = model.loras_per_batch("cpu")
        # vLLM types the rank as its Literal of supported sizes; ModelConfig checks it.
        args.max_lora_rank = model.max_lora_rank  # type: ignore[assignment]
    return args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


class VllmFrontend:
    """vLLM's serving classes over one DispatchingEngineClient, as `vllm serve` builds them."""

    def __init__(self, client: DispatchingEngineClient, options: FrontendOptions) -> None:
        from vllm.renderers.chat_utils import load_chat_template

        template = load_chat_template(options.chat_template)
        self.models = models = OpenAIServingModels(
            client,
            [BaseModelPath(name=options.served_name, model_path=options.model_path)],
            lora_modules=[
                LoRAModulePath(name=name, path=path, base_model_name=options.served_name)
                for name, path in options.lora_adapters
            ],
        )
        reasoning_parser = options.reasoning_parser or ""
        self._renderer = OnlineRenderer(
            model_config=client.model_config,
            renderer=client.renderer,
            request_logger=None,
            chat_template=template,
            chat_template_content_format="auto",
            trust_request_chat_template=options.trust_request_chat_template,
            enable_auto_tools=options.enable_auto_tool_choice,
            tool_parser=options.tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        # What vLLM's chat serving class, and the Messages class built on it, both take.
        chat_options: dict[str, Any] = {
            "online_renderer": self._renderer,
            "request_logger": None,
            "chat_template": template,
            "chat_template_content_format": "auto",
            "enable_auto_tools": options.enable_auto_tool_choice,
            "tool_parser": options.tool_call_parser,
            "reasoning_parser": reasoning_parser,
        }
        self.chat = OpenAIServingChat(
            client,
            models,
            RESPONSE_ROLE,
            trust_request_chat_template=options.trust_request_chat_template,
            **chat_options,
        )
        self.completion = OpenAIServingCompletion(
            client, models, online_renderer=self._renderer, request_logger=None
        )
        self.responses = OpenAIServingResponses(
            client,
            models,
            self._renderer,
            request_logger=None,
            chat_template=template,
            chat_template_content_format="auto",
            enable_auto_tools=options.enable_auto_tool_choice,
            tool_parser=options.tool_call_parser,
            reasoning_parser=reasoning_parser,
        )
        # Anthropic's Messages API: vLLM's chat serving class underneath, so the same
        # template, tool parser and dispatch.
        self.messages = AnthropicServingMessages(client, models, RESPONSE_ROLE, **chat_options)
        self.tokenization = ServingTokenization(
            models,
            self._renderer,
            chat_template=template,
            chat_template_content_format="auto",
            trust_request_chat_template=options.trust_request_chat_template,
        )

    async def serve(self, request: Any, raw: Request, life: RequestLife) -> Response:
        """Answer ``request`` as `vllm serve` would; a stream is read up to its first
        event first, so that a refusal or a failure before it is raised as the status of
        its own (``life.error``) rather than a stream of vLLM's error event."""
        events = None
        try:
            result = await self._dispatch(request, raw, life)
            if hasattr(result, "__aiter__"):
                # Its first step runs generate, which opens the request.
                events = _sse(result) if isinstance(request, ResponsesRequest) else result
                first = await anext(events, None)
        except Exception as error:  # vLLM raises what it does not return, as its server
            if life.error is not None:
                raise life.error from error
            return _error_answer(life, create_error_response(error), by_alias=False)
        if life.error is not None:
            if events is not None:
                await events.aclose()  # type: ignore[union-attr]
            raise life.error
        if isinstance(result, ErrorResponse):
            return _error_answer(life, result, by_alias=True)
        if isinstance(result, AnthropicMessagesResponse | AnthropicCountTokensResponse):
            # As vLLM's Anthropic routes write them: fields left unset are left out.
            body = result.model_dump(mode="json", exclude_none=True)
            return JSONResponse(body, headers=life.headers)
        if events is None:
            body = result.model_dump(mode="json", by_alias=True)
            return JSONResponse(body, headers=life.headers)
        return StreamingResponse(
            _after_first(first, events), media_type="text/event-stream", headers=life.headers
        )

    async def _dispatch(self, request: Any, raw: Request, life: RequestLife) -> Any:
        if isinstance(request, ChatCompletionRequest):
            return await _bound(self.chat, life).create_chat_completion(request, raw)
        if isinstance(request, CompletionRequest):
            return await _bound(self.completion, life).create_completion(request, raw)
        if isinstance(request, ResponsesRequest):
            return await _bound(self.responses, life).create_responses(request, raw)
        if isinstance(request, AnthropicMessagesRequest):
            return await _bound(self.messages, life).create_messages(request, raw)
        if isinstance(request, AnthropicCountTokensRequest):
            return await self.messages.count_tokens(request, raw)
        if isinstance(request, TokenizeRequest):
            return await self.tokenization.create_tokenize(request, raw)
        if isinstance(request, DetokenizeRequest):
            return await self.tokenization.create_detokenize(request, raw)
        raise TypeError(f"no vLLM serving class takes {type(request).__name__}")


def _error_answer(life: RequestLife, error: ErrorResponse, by_alias: bool) -> JSONResponse:
    """vLLM's error as its server answers it: in OpenAI's format, or on Anthropic's routes
    (ANTHROPIC_ROUTES, as the router's own errors) in Anthropic's, as vLLM's
    translate_error_response spells it."""
    if life.route in ANTHROPIC_ROUTES:
        anthropic = AnthropicError(type=error.error.type, message=error.error.message)
        body = AnthropicErrorResponse(error=anthropic).model_dump()
    else:
        body = error.model_dump(mode="json", by_alias=by_alias)
    return JSONResponse(body, status_code=error.error.code)


Serving = TypeVar("Serving")


def _bound(serving: Serving, life: RequestLife) -> Serving:
    """A shallow copy of one of vLLM's serving objects whose engine client passes
    ``life`` to every ``generate`` it makes (a copy costs microseconds; the rest of the
    object, its parsers and templates, is shared)."""
    bound = copy.copy(serving)
    shared = serving.engine_client  # type: ignore[attr-defined]
    bound.engine_client = _LifeEngineClient(shared, life)  # type: ignore[attr-defined]
    return bound


class _LifeEngineClient:
    """The model's ``DispatchingEngineClient`` as one request's serving object sees it."""

    def __init__(self, shared: DispatchingEngineClient, life: RequestLife) -> None:
        self._shared = shared
        self._life = life

    def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
        return self._shared.generate(*args, life=self._life, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)


async def _sse(events: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The Responses API's stream as vLLM's server writes it: named events."""
    async for event in events:
        kind = getattr(event, "type", "unknown")
        yield f"event: {kind}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"


async def _after_first(first: str | None, events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        if first is None:
            return
        yield first
        async for event in events:
            yield event
    finally:
        await events.aclose()  # type: ignore[attr-defined]
