"""``python -m loadgen fake-server``: a paced OpenAI-compatible server without a model."""

from __future__ import annotations

import argparse

from rich.console import Console

from loadgen.cli.common import (
    add_shape_flag,
)
from loadgen.client.fake_server import FakeServerConfig, run_fake_server


def build_fake_server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen fake-server",
        description="A tiny OpenAI-compatible streaming server (zero latency by default).",
    )
    defaults = FakeServerConfig()
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--reject-every", type=int, default=0, help="503 every Nth request")
    parser.add_argument("--reject-status", type=int, default=503, choices=(429, 503))
    add_shape_flag(parser, "--shape", default=defaults.shape)
    return parser


def command_fake_server(argv: list[str], console: Console) -> int:
    args = build_fake_server_parser().parse_args(argv)
    run_fake_server(
        FakeServerConfig(
            host=args.host,
            port=args.port,
            model=args.model,
            max_model_len=args.max_model_len,
            ttft_ms=args.ttft_ms,
            itl_ms=args.itl_ms,
            tokens_per_chunk=args.tokens_per_chunk,
            reject_every=args.reject_every,
            reject_status=args.reject_status,
            shape=args.shape,
        )
    )
    return 0
