"""Several models in one application, one router, each model with its own pools and
split, routed by the request's ``model``: the shapes' shared application
(tests/support/shared_apps.py), whose last model is models.yaml's ``tiny-code``.

single.yaml's model (models.yaml's ``tiny-chat`` under its own name) is the embedded
model on one engine; ``tiny-code`` is another tiny Llama (other weights) split into
prefill and decode, with two LoRA adapters: it and its adapters must answer exactly as
bare `vllm serve` does with the same model and ``--lora-modules``. Each model is
counted under its own ``model`` label.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.launcher import RunningApp
from engines.model_source import resolve_adapter_path, resolve_model
from engines.settings import ModelConfig
from tests.support.bare_vllm import bare_vllm
from tests.support.greedy import greedy, metric
from tests.support.shared_apps import SHAPES

pytestmark = pytest.mark.serving

CHAT, CODE = SHAPES["single"], SHAPES["code"]
CHAT_MODEL, SPLIT_MODEL = CHAT.name, CODE.name
ADAPTERS = {"tiny-code-sql": "embedded-lora:1", "tiny-code-py": "embedded-lora:2"}
MAX_TOKENS = 8
PROMPTS = [[1, 2, 3], list(range(40, 240)), [7] * 300]


def _complete(base_url: str, prompt: list[int], model: str, stream: bool = False) -> list[int]:
    body = {"prompt": prompt}
    return greedy(base_url, "/v1/completions", body, MAX_TOKENS, stream, model)[0]


def single_reference(base_url: str) -> dict[str, Any]:
    """single.yaml's tokens for this module's prompts (asked by conftest's single_answers)."""
    return {"completions": [_complete(base_url, p, "splitserve-tiny-llama") for p in PROMPTS]}


@pytest.fixture(scope="module")
def reference(single_answers: dict[str, Any]) -> dict[str, Any]:
    return single_answers[__name__]


@pytest.fixture(scope="module")
def bare_answers(reference: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Bare `vllm serve` of tiny-code with its adapters: each name's greedy tokens."""
    model_path = Path(resolve_model(ModelConfig(source="embedded:1")).path)
    modules = [f"{name}={resolve_adapter_path(path)}" for name, path in ADAPTERS.items()]
    flags = ("--enable-lora", "--max-loras", "3", "--lora-modules", *modules)
    folder = tmp_path_factory.mktemp("bare-lora")
    with bare_vllm(folder, model_path, SPLIT_MODEL, flags) as url:
        return {
            name: [_complete(url, prompt, name) for prompt in PROMPTS]
            for name in (SPLIT_MODEL, *ADAPTERS)
        }


@pytest.fixture(scope="module")
def models_app(bare_answers: dict, shapes_app: RunningApp) -> RunningApp:
    return shapes_app


def test_the_model_list_names_every_model_then_its_adapters(models_app: RunningApp) -> None:
    listed = httpx.get(f"{models_app.base_url}/v1/models", timeout=30)
    assert listed.status_code == 200
    cards = [(card["id"], card["parent"]) for card in listed.json()["data"]]
    assert cards == [
        *((model.name, None) for model in SHAPES.values()),  # tiny-code is the last
        *((name, SPLIT_MODEL) for name in ADAPTERS),
    ]
    card = httpx.get(f"{models_app.base_url}/v1/models/{SPLIT_MODEL}", timeout=30)
    assert card.status_code == 200 and card.json()["id"] == SPLIT_MODEL


def test_each_model_answers_with_its_own_weights_and_split(
    models_app: RunningApp, reference: dict
) -> None:
    url = models_app.base_url
    chat = [_complete(url, prompt, CHAT_MODEL) for prompt in PROMPTS]
    assert chat == reference["completions"]  # the same weights as single.yaml's one model
    split = [_complete(url, prompt, SPLIT_MODEL) for prompt in PROMPTS]
    assert split != chat  # other weights
    assert [_complete(url, prompt, SPLIT_MODEL, stream=True) for prompt in PROMPTS] == split
    _, _, headers = greedy(url, "/v1/completions", {"prompt": PROMPTS[1]}, 2, model=SPLIT_MODEL)
    assert headers["x-splitserve-prefill"].startswith("remote")
    assert headers["x-splitserve-replica"] == CODE.engine("decode", 0)
    _, _, headers = greedy(url, "/v1/completions", {"prompt": PROMPTS[1]}, 2, model=CHAT_MODEL)
    assert headers["x-splitserve-replica"] == CHAT.engine("mixed", 0)


def test_the_split_model_and_its_adapters_answer_as_bare_vllm(
    models_app: RunningApp, bare_answers: dict
) -> None:
    url = models_app.base_url
    for name, expected in bare_answers.items():
        assert [_complete(url, prompt, name) for prompt in PROMPTS] == expected, name
        streamed = [_complete(url, prompt, name, stream=True) for prompt in PROMPTS]
        assert streamed == expected, name
    assert bare_answers["tiny-code-sql"] != bare_answers[SPLIT_MODEL]  # the adapter acts
    assert bare_answers["tiny-code-sql"] != bare_answers["tiny-code-py"]
    body = {"prompt": PROMPTS[1]}
    _, _, headers = greedy(url, "/v1/completions", body, 2, model="tiny-code-py")
    assert headers["x-splitserve-prefill"].startswith("remote")  # its KV was handed over


def test_an_adapter_loads_and_unloads_at_run_time(models_app: RunningApp) -> None:
    url = models_app.base_url
    load = {"lora_name": "tiny-code-ops", "lora_path": "embedded-lora:3", "model": SPLIT_MODEL}
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60)
    assert loaded.status_code == 200, loaded.text
    served = _complete(url, PROMPTS[0], "tiny-code-ops")
    assert served != _complete(url, PROMPTS[0], "tiny-code-sql")
    bad = {"lora_name": "broken", "lora_path": "/nonexistent/adapter"}
    refused = httpx.post(f"{url}/v1/load_lora_adapter", json=bad, timeout=60)
    assert refused.status_code in (400, 404, 500) and "broken" in refused.text
    unload = {"lora_name": "tiny-code-ops"}
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json=unload, timeout=60).status_code == 200
    body = {"model": "tiny-code-ops", "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 404
    listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert "broken" not in [card["id"] for card in listed]


def test_vllms_layer_serves_each_model_by_name(models_app: RunningApp) -> None:
    url = models_app.base_url
    for model in (CHAT_MODEL, SPLIT_MODEL):
        body = {"model": model, "prompt": "Hi", "max_tokens": 3, "logprobs": 2, "temperature": 0}
        answered = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert answered.status_code == 200, answered.text
        assert answered.json()["model"] == model
        assert len(answered.json()["choices"][0]["logprobs"]["top_logprobs"]) == 3
        tokens = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": "ab"}, timeout=30)
        assert tokens.status_code == 200 and tokens.json()["count"] >= 2


def test_an_unknown_model_is_a_404_naming_the_served_ones(models_app: RunningApp) -> None:
    body = {"model": "gpt-4", "prompt": "Hi", "max_tokens": 3}
    refused = httpx.post(f"{models_app.base_url}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 404
    error = refused.json()["error"]
    assert error["param"] == "model"
    assert "'gpt-4'" in error["message"]
    assert all(f"'{model.name}'" in error["message"] for model in SHAPES.values())
    missing = httpx.get(f"{models_app.base_url}/v1/models/gpt-4", timeout=30)
    assert missing.status_code == 404


def test_the_metrics_and_health_tell_the_models_apart(models_app: RunningApp) -> None:
    url = models_app.base_url
    before = metric(url, "splitserve_requests_total", model=SPLIT_MODEL, status="200")
    greedy(url, "/v1/completions", {"prompt": [5, 6]}, 2, model=SPLIT_MODEL)
    after = metric(url, "splitserve_requests_total", model=SPLIT_MODEL, status="200")
    assert after == before + 1
    assert metric(url, "splitserve_tokens_total", model=CHAT_MODEL, kind="generation") > 0
    remote = metric(url, "splitserve_prefill_decisions_total", model=SPLIT_MODEL, where="remote")
    assert remote > 0
    assert metric(url, "splitserve_prefill_decisions_total", model=CHAT_MODEL, where="remote") == 0
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["status"] == "ok"
    assert health["models"][CHAT_MODEL] == [CHAT.engine("mixed", 0)]
    assert health["models"][SPLIT_MODEL] == [CODE.engine("decode", 0), CODE.engine("prefill", 0)]
