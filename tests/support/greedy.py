"""What serving tests ask a started application: greedy token ids, and metric samples."""

from __future__ import annotations

import json
import time

import httpx

MODEL = "splitserve-tiny-llama"


def greedy(
    base_url: str,
    route: str,
    prompt: dict,
    max_tokens: int,
    stream: bool = False,
    model: str = MODEL,
) -> tuple[list[int], dict, httpx.Headers]:
    """Token ids, usage and response headers of one greedy request, streamed or not;
    ``prompt``: ``{"prompt": ...}`` or ``{"messages": ...}``."""
    body = {
        "model": model,
        **prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    with httpx.Client(base_url=base_url, timeout=120) as http:
        if not stream:
            response = http.post(route, json=body)
            assert response.status_code == 200, response.text
            data = response.json()
            return data["choices"][0]["token_ids"], data["usage"], response.headers
        token_ids: list[int] = []
        usage: dict = {}
        with http.stream("POST", route, json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                assert "error" not in event, event
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    token_ids.extend(choice.get("token_ids") or [])
        return token_ids, usage, response.headers


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with these labels at ``url`` (a /metrics page, or a
    base URL whose /metrics is meant)."""
    if not url.endswith("/metrics"):
        url = f"{url}/metrics"
    total = 0.0
    for row in httpx.get(url, timeout=10).text.splitlines():
        is_sample = row.startswith(name) and row[len(name)] in " {"
        if is_sample and all(f'{k}="{v}"' in row for k, v in labels.items()):
            total += float(row.split()[-1])
    return total


# The router renders the KV directory's counters from its last read of them, taken every
# router.kv_metrics_interval_s (1 s by default): they trail the answers by that much.
KV_METRICS_WAIT_S = 10.0


def kv_metric(url: str, name: str, at_least: float, **labels: str) -> float:
    """``metric`` once it reaches ``at_least`` (the KV directory's counters trail the
    answers), or its value when KV_METRICS_WAIT_S has passed."""
    deadline = time.monotonic() + KV_METRICS_WAIT_S
    value = metric(url, name, **labels)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
        value = metric(url, name, **labels)
    return value
