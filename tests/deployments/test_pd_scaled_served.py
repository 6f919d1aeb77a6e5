"""PD with a decode pool that Serve grows and shrinks, on real vLLM engines (issue 26's
real-engine scaling target): from one decode engine to two and back to one.

The decode engine Serve adds must take KV a prompt computed on the prefill engine and
give one engine's greedy tokens, and the one it takes out must finish the stream it
carries. The pool's objective here is a first token within 10 ms, which every
hand-over breaks: the load that grows the pool is a few requests, not a flood two cores
could not carry, and when requests stop arriving the measured window empties and the
pool shrinks while both engines still stream. How the policy weighs real queues is
tested with synthetic engines (tests/engines/test_pool_ramp_served.py) and without a
cluster (tests/engines/test_pool_scaling.py).
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deployments.launcher import RunningApp, config_path
from splitserve.metric_catalogue import PREFILL_HEADER, REPLICA_HEADER
from tests.support.greedy import MODEL, greedy
from tests.support.scaled_pools import members, shrink_under_streams
from tests.support.served_apps import ServedApps
from tests.support.waiting import eventually

pytestmark = pytest.mark.serving

MAX_TOKENS = 8
_rng = random.Random(26)
# Longer than one 128-token KV block, so that each hand-over moves whole blocks.
PROMPTS = [[_rng.randrange(0, 256) for _ in range(n)] for n in (300, 700)]
SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "ttft_slo_s": 0.01,  # every first token after a hand-over is later: load means grow
    "tpot_slo_s": 10.0,  # never: streams alone do not hold the pool up
    "upscale_delay_s": 0,
    "downscale_delay_s": 4,
    "window_s": 2,
    "drain_timeout_s": 120,
}
# About 20 s of tokens on a CPU engine: the pool shrinks long before these end.
LONG_STREAM_TOKENS = 2000
# A vLLM engine starts in about a minute on this box, longer while others compute.
SCALE_TIMEOUT_S = 360.0


def single_reference(base_url: str) -> list[list[int]]:
    """single.yaml's tokens for this module's prompts (asked by conftest's single_answers)."""
    return [_complete(base_url, prompt)[0] for prompt in PROMPTS]


@pytest.fixture(scope="module")
def reference(single_answers: dict[str, Any]) -> list[list[int]]:
    return single_answers[__name__]


@pytest.fixture(scope="module")
def scaled_pd(reference: list, served_apps: ServedApps, serve_logs: Path) -> RunningApp:
    document = yaml.safe_load(config_path("pd").read_text())
    args = document["applications"][0]["args"]
    decode = next(pool for pool in args["pools"] if pool["role"] == "decode")
    decode["cpu_binds"] = ["1", "0"]  # by rank in the pool: the second shares core 0
    decode["autoscaling"] = SCALING
    args["prefill_policy"] = {"name": "always"}  # every prompt's KV crosses to a decode engine
    args["router"]["replica_choice"]["decode"] = "round_robin"  # each engine in turn
    path = serve_logs / "pd_scaled.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return served_apps.get(str(path))


def _complete(base_url: str, prompt: list[int]) -> tuple[list[int], httpx.Headers]:
    token_ids, _, headers = greedy(base_url, "/v1/completions", {"prompt": prompt}, MAX_TOKENS)
    return token_ids, headers


def _decode_engines(url: str) -> set[str]:
    return {name for name in members(url) if name.startswith("decode-")}


def _load_until(url: str, done: threading.Event, failures: list[str]) -> None:
    """One request at a time, each with its own hand-over, until ``done``."""
    while not done.is_set():
        for prompt in PROMPTS:
            try:
                _complete(url, prompt)
            except (AssertionError, httpx.HTTPError) as error:
                failures.append(repr(error))


def _stream(url: str, result: dict[str, Any]) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": LONG_STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    tokens, errors = 0, []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        result["replica"] = response.headers[REPLICA_HEADER]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    errors.append(event)
                else:
                    tokens += sum(len(c.get("token_ids") or []) for c in event["choices"])
    result.update(tokens=tokens, errors=errors, ended_at=time.monotonic())


def test_the_decode_pool_grows_to_two_engines_and_back_to_one(
    scaled_pd: RunningApp, reference: list[list[int]]
) -> None:
    url = scaled_pd.base_url
    (first,) = _decode_engines(url)

    # Hand-overs break the 10 ms first-token line: Serve adds a decode engine.
    grown, failures = threading.Event(), list[str]()
    load = threading.Thread(target=_load_until, args=(url, grown, failures))
    load.start()
    try:
        eventually(lambda: len(_decode_engines(url)) == 2, SCALE_TIMEOUT_S)
    finally:
        grown.set()
        load.join(timeout=120)
    assert failures == []
    engines = _decode_engines(url)
    (added,) = engines - {first}

    # Round robin: the next requests reach both engines; each loads the prefill
    # engine's KV and gives one engine's tokens.
    served: dict[str, list[list[int]]] = {}
    for prompt, expected in zip(PROMPTS * 2, reference * 2, strict=True):
        token_ids, headers = _complete(url, prompt)
        assert headers[PREFILL_HEADER] == "remote:always"
        assert token_ids == expected
        served.setdefault(headers[REPLICA_HEADER], []).append(token_ids)
    assert set(served) == {first, added}, "the added engine decodes once Serve runs it"

    # One long stream on each; with no new request the window empties and Serve
    # shrinks the pool under them.
    streams = shrink_under_streams(
        lambda result: _stream(url, result), lambda: _decode_engines(url), SCALE_TIMEOUT_S, 0.5
    )
    for stream in streams:
        assert stream["errors"] == [] and stream["tokens"] == LONG_STREAM_TOKENS
    assert [_complete(url, p)[0] for p in PROMPTS] == reference
