"""Request preparation in the router, without engines: lengths, prompts, refusals."""

from __future__ import annotations

from http import HTTPStatus

import pytest
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from engines.tiny_model import embedded_model_path
from router.http.errors import OpenAIError
from router.http.requests import PromptBuilder, ServedByVllm, decode_json_body, parse_request

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def prompts() -> PromptBuilder:
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    return PromptBuilder(tokenizer, MAX_MODEL_LEN, vocab_size=512)


def _completion(**fields: object) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": "m", **fields})


def test_text_and_token_prompts_tokenize_alike(prompts: PromptBuilder) -> None:
    by_text = prompts.prepare(_completion(prompt="abc", max_tokens=4))
    by_ids = prompts.prepare(_completion(prompt=[97, 98, 99], max_tokens=4))
    nested = prompts.prepare(_completion(prompt=[[97, 98, 99]], max_tokens=4))
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == nested.prompt_token_ids
    assert by_ids.sampling_params.max_tokens == 4


def test_chat_uses_the_template_once(prompts: PromptBuilder) -> None:
    request = parse_request(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    ids = prompts.prepare(request).prompt_token_ids
    assert ids.count(256) == 1  # bos written by the template, not added again
    assert bytes(i for i in ids if i < 256).decode().endswith("<|assistant|>\n")


def test_max_tokens_defaults_to_the_room_left(prompts: PromptBuilder) -> None:
    request = parse_request(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    prepared = prompts.prepare(request)
    assert prepared.sampling_params.max_tokens == MAX_MODEL_LEN - len(prepared.prompt_token_ids)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": [1] * 60, "max_tokens": 5}, "max_tokens"),
        ({"prompt": [1] * MAX_MODEL_LEN, "max_tokens": 1}, "prompt"),
        ({"prompt": [1, 2, 512]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ],
)
def test_refusals_name_the_parameter(
    prompts: PromptBuilder, fields: dict[str, object], param: str
) -> None:
    with pytest.raises(OpenAIError) as raised:
        prompts.prepare(_completion(**fields))
    assert raised.value.status == 400
    assert raised.value.param == param


@pytest.mark.parametrize(
    ("fields", "feature"),
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "a", "n": 3}, "n"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "logprobs": 1}, "logprobs"),
        ({"prompt": "a", "prompt_logprobs": 0}, "prompt_logprobs"),
        ({"prompt": "a", "use_beam_search": True}, "use_beam_search"),
        (
            {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options",
        ),
    ],
)
def test_what_only_vllms_layer_renders_goes_there(
    prompts: PromptBuilder, fields: dict[str, object], feature: str
) -> None:
    with pytest.raises(ServedByVllm) as routed:
        prompts.prepare(_completion(**fields))
    assert routed.value.feature == feature


@pytest.mark.parametrize(
    ("message", "routed"),
    [
        ({"role": "user", "content": "hi"}, False),
        ({"role": "user", "content": [{"type": "text", "text": "hi"}]}, False),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, True),
        ({"role": "tool", "content": "42", "tool_call_id": "call-1"}, True),
    ],
)
def test_messages_beyond_plain_text_go_to_vllms_layer(
    prompts: PromptBuilder, message: dict[str, object], routed: bool
) -> None:
    request = parse_request(ChatCompletionRequest, {"model": "m", "messages": [message]})
    if routed:
        with pytest.raises(ServedByVllm):
            prompts.prepare(request)
    else:
        assert prompts.prepare(request).prompt_token_ids


def test_stream_options(prompts: PromptBuilder) -> None:
    prepared = prompts.prepare(
        _completion(prompt="a", stream=True, stream_options={"include_usage": True})
    )
    assert prepared.stream and prepared.include_usage
    assert not prompts.prepare(_completion(prompt="a", stream_options=None)).include_usage


@pytest.mark.parametrize("messages", [None, 0, -1, 10**30, "hi", {"role": "user"}])
def test_messages_that_are_not_a_list_are_a_400(messages: object) -> None:
    with pytest.raises(OpenAIError) as raised:
        parse_request(ChatCompletionRequest, {"model": "m", "messages": messages})
    assert raised.value.status == 400 and raised.value.param == "messages"


def test_a_user_message_without_content_is_a_400_as_openai_answers(
    prompts: PromptBuilder,
) -> None:
    request = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user"}]})
    with pytest.raises(OpenAIError) as raised:
        prompts.prepare(request)
    assert raised.value.param == "messages.0.content"


def test_lone_surrogates_are_a_400_and_errors_quoting_them_render() -> None:
    body = b'{"model": "\\udcff", "prompt": "a \\ud83d\\ude00 is fine"}'
    with pytest.raises(OpenAIError) as raised:
        decode_json_body(body)
    assert raised.value.status == 400 and "surrogate" in raised.value.message
    paired = b'{"model": "m", "prompt": "a \\ud83d\\ude00 is fine"}'
    assert decode_json_body(paired)["prompt"] == "a \U0001f600 is fine"
    error = OpenAIError("The model '\udcff' does not exist", HTTPStatus.NOT_FOUND, "model")
    assert b"\\\\udcff" in error.response().body
