"""Plain delta events are cut from a template; their bytes must be vLLM's models' own."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.protocol import GenerateChunk
from router.http.responses import TEXT_MARK, ResponseWriter, Transcript

TEXTS = [
    "",
    "hello",
    ' "quoted" \\ back\\slash',
    "\n\r\t\b\f",
    "\x00\x01\x1f\x7f",
    "héllo wörld",
    "日本語",
    "😀👍🏽",
    "\u2028\u2029",
    TEXT_MARK,
    f'"{TEXT_MARK}"',
    "data: [DONE]\n\n",
]


def _writer(
    *, chat: bool, return_token_ids: bool = False, model: str = "tiny-llama"
) -> ResponseWriter:
    return ResponseWriter(
        chat=chat, model=model, response_id="cmpl-abc", return_token_ids=return_token_ids
    )


def _both(writer: ResponseWriter, chunk: GenerateChunk, first: bool = False) -> tuple[str, str]:
    transcript = Transcript(prompt_token_ids=[1, 2, 3])
    fast = writer.delta_event(chunk, transcript, first)
    return fast, writer._rendered_delta(chunk, transcript, first)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_plain_delta_matches_the_models(chat: bool, text: str) -> None:
    fast, rendered = _both(_writer(chat=chat), GenerateChunk(token_ids=[7], text=text))
    assert fast == rendered
    payload = json.loads(fast.removeprefix("data: "))
    assert payload["choices"][0]["delta" if chat else "text"] == (
        {"content": text} if chat else text
    )


@pytest.mark.parametrize("chat", [False, True])
def test_a_model_named_like_the_marker_does_not_move_the_cut(chat: bool) -> None:
    writer = _writer(chat=chat, model=TEXT_MARK)
    fast, rendered = _both(writer, GenerateChunk(token_ids=[7], text="token"))
    assert fast == rendered


@settings(max_examples=300, derandomize=True, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=["Cs"])), chat=st.booleans())
def test_any_text_matches_the_models(text: str, chat: bool) -> None:
    fast, rendered = _both(_writer(chat=chat), GenerateChunk(token_ids=[7], text=text))
    assert fast == rendered


@pytest.mark.parametrize(
    ("chunk", "first", "return_token_ids", "expected_key"),
    [
        (GenerateChunk([7], "x", finish_reason="stop"), False, False, "finish_reason"),
        (GenerateChunk([7], "x", stop_reason=13), False, False, "stop_reason"),
        (GenerateChunk(token_ids=[7], text="x"), False, True, "token_ids"),
        (GenerateChunk(token_ids=[7], text="x"), True, True, "prompt_token_ids"),
    ],
)
def test_deltas_with_more_than_text_carry_it(
    chunk: GenerateChunk, first: bool, return_token_ids: bool, expected_key: str
) -> None:
    writer = _writer(chat=False, return_token_ids=return_token_ids)
    fast, rendered = _both(writer, chunk, first)
    assert fast == rendered
    assert expected_key in json.loads(fast.removeprefix("data: "))["choices"][0]


def test_a_lone_surrogate_fails_as_the_models_do() -> None:
    """vLLM's detokenizer never yields one; if it did, the template must not send what
    the models refuse to serialize."""
    with pytest.raises(ValueError, match="surrogates not allowed"):
        _writer(chat=False).delta_event(
            GenerateChunk(token_ids=[7], text="a\ud800b"), Transcript(prompt_token_ids=[1]), False
        )
