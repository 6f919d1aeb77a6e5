"""``python -m loadgen profile``: measure an engine and fit its latency profile."""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import datetime
from pathlib import Path

from rich.console import Console

from loadgen.cli.common import (
    configure_logging,
)
from loadgen.client.streaming import request_headers
from loadgen.config import (
    DEFAULT_BASE_URL,
)
from loadgen.scheduling.eventloop import run_event_loop
from loadgen.study.profiling import (
    ProfileGrid,
    ProfileTarget,
    kv_capacity_tokens,
    measure,
    measure_prefills,
    profile_from,
    profile_table,
    save_samples,
    served_models,
    spread_quantiles,
    without_path_cost,
)
from splitserve.latency.fit import PrefillSample, fit_handover, handover_costs
from splitserve.latency.profile import load_profile, shipped_profiles

HANDOVER_NOTE = "; hand-over fitted from lone prefills through a PD application"


def build_profile_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen profile",
        description="Measure one engine's step times over a grid (prefill lengths, decode"
        " batches and contexts) and fit a latency profile for simulated engines"
        " (engine.backend: simulated). Serve one engine alone while it measures.",
    )
    parser.add_argument("--list", action="store_true", help="list the shipped profiles")
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL)
    parser.add_argument("--model", help="default: the first model of GET /v1/models")
    parser.add_argument("--device", help="what the engine runs on, e.g. H100-SXM-80GB")
    parser.add_argument("--model-name", help="the profile's model; default: --model")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument(
        "--kv-bytes-per-token", type=int, help="the model's KV per token, all layers"
    )
    parser.add_argument(
        "--kv-capacity-tokens", type=int, help="default: vLLM's cache_config_info on /metrics"
    )
    parser.add_argument("--handover-gbps", type=float, default=1.0, help="PD: KV link rate, GB/s")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    grid = ProfileGrid()
    parser.add_argument(
        "--prompt-lengths", type=_int_list, default=grid.prompt_lengths, help="e.g. 16,256,1024"
    )
    parser.add_argument("--batches", type=_int_list, default=grid.batches, help="e.g. 1,4,16")
    parser.add_argument("--contexts", type=_int_list, default=grid.contexts, help="e.g. 64,512")
    parser.add_argument("--repeats", type=int, default=grid.repeats)
    parser.add_argument(
        "--baseline-samples",
        type=Path,
        help="the .samples.json of a profile run against the same serving path on engines"
        " that take no time (deployments.serve CONFIG --simulate with a zero profile): its"
        " lone-request TTFT is taken off each prefill measurement, so that a simulated"
        " engine behind that path does not pay it twice",
    )
    parser.add_argument(
        "--handover-of",
        type=Path,
        metavar="PROFILE",
        help="fit only PROFILE's PD hand-over (a profile this command fitted on one engine):"
        " --base-url is then a PD application of the same engines (pd_always.yaml), whose"
        " lone prefills at PROFILE's prompt lengths, over PROFILE's own, give the"
        " hand-over's latency and link rate (instead of --handover-gbps); needs"
        " --baseline-samples of that application; writes --out (default: PROFILE)",
    )
    parser.add_argument("--out", type=Path, help="the profile's file (YAML)")
    return parser


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def command_profile(argv: list[str], console: Console) -> int:
    args = build_profile_parser().parse_args(argv)
    configure_logging(False)
    if args.list:
        for name in shipped_profiles():
            console.print(name)
        return 0
    if args.handover_of:
        if args.baseline_samples is None:
            raise ValueError(
                "--handover-of needs --baseline-samples of the PD application: a served"
                " simulation pays its path's own cost for real, and would pay it twice"
            )
        return run_event_loop(_fit_handover(args, console))
    if args.device is None or args.kv_bytes_per_token is None:
        raise ValueError("profile needs --device and --kv-bytes-per-token (or --list)")
    return run_event_loop(_profile(args, console))


async def _profile(args: argparse.Namespace, console: Console) -> int:
    base_url = args.base_url.rstrip("/")
    headers = request_headers()
    served = await served_models(base_url, headers)
    model = args.model or served[0][0]
    max_model_len = dict(served).get(model) or 8192
    target = ProfileTarget(base_url, model, headers)
    grid = ProfileGrid(args.prompt_lengths, args.batches, args.contexts, repeats=args.repeats)
    capacity = args.kv_capacity_tokens or await kv_capacity_tokens(target)
    if capacity is None:
        raise ValueError("the server's /metrics has no KV cache size: give --kv-capacity-tokens")
    console.print(f"measuring {model} at {base_url} ...")
    measured = await measure(target, grid)
    baseline_note = ""
    if args.baseline_samples:
        prefills, path_s = without_path_cost(measured.prefills, args.baseline_samples)
        measured = dataclasses.replace(measured, prefills=prefills)
        baseline_note = f"; less the serving path's own TTFT ({path_s * 1e3:.2f} ms median)"
    prefills, decodes = measured.prefills, measured.decodes
    when = datetime.now().strftime("%Y-%m-%d")
    profile = profile_from(
        prefills,
        decodes,
        source=f"fitted from python -m loadgen profile against {model} on {args.device}"
        f" ({when}; prompt lengths {list(grid.prompt_lengths)}, batches"
        f" {list(grid.batches)}, contexts {list(grid.contexts)}, {grid.repeats} repeats)"
        + baseline_note,
        device=args.device,
        model=args.model_name or model,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        kv_bytes_per_token=args.kv_bytes_per_token,
        kv_capacity_tokens=capacity,
        handover_bytes_per_s=args.handover_gbps * 1e9,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        step_spread=spread_quantiles(measured.gap_ratios),
    )
    out = args.out or Path("results/profiles") / (
        f"{args.device}-{profile.model}-tp{args.tensor_parallel_size}"
        f"-pp{args.pipeline_parallel_size}.yaml".lower().replace("/", "-")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    save_samples(out.with_suffix(".samples.json"), measured)
    console.print(profile_table(profile, prefills, decodes))
    if profile.step_spread:
        spread = profile.step_spread
        console.print(
            f"step_spread: {len(spread)} equally likely ratios of a decode gap to its"
            f" batch's median step, {spread[0]:.2f} to {spread[-1]:.2f},"
            f" mean {sum(spread) / len(spread):.2f}"
        )
    console.print(f"profile: {out}")
    return 0


async def _fit_handover(args: argparse.Namespace, console: Console) -> int:
    """PROFILE again, its hand-over fitted from lone prefills through a PD application."""
    profile = load_profile(str(args.handover_of))
    samples_path = args.handover_of.with_suffix(".samples.json")
    if not samples_path.exists():
        raise ValueError(
            f"{samples_path} is missing: --handover-of needs the lone prefills that this"
            " command saved beside the profile it fitted"
        )
    samples = json.loads(samples_path.read_text())
    engine = [PrefillSample(**sample) for sample in samples["prefill"]]
    base_url = args.base_url.rstrip("/")
    headers = request_headers()
    model = args.model or (await served_models(base_url, headers))[0][0]
    lengths = tuple(sample.prompt_tokens for sample in engine)
    console.print(f"measuring hand-overs through {base_url} ...")
    measured = await measure_prefills(
        ProfileTarget(base_url, model, headers),
        ProfileGrid(prompt_lengths=lengths, repeats=args.repeats),
    )
    through_pd, _ = without_path_cost(measured, args.baseline_samples)
    costs = handover_costs(engine, through_pd, profile)
    fit = fit_handover(costs)
    fitted = profile.model_copy(
        update={
            "handover_latency_s": fit.latency_s,
            "handover_bytes_per_s": fit.bytes_per_s(profile.kv_bytes_per_token),
            # A profile fitted again keeps one note of its hand-over, the latest.
            "source": f"{profile.source.split(HANDOVER_NOTE)[0]}{HANDOVER_NOTE}"
            f" ({datetime.now():%Y-%m-%d}) over the same on one engine",
        }
    )
    out = args.out or args.handover_of
    fitted.save(out)
    out.with_suffix(".samples.json").write_text(
        json.dumps({**samples, "handover": [dataclasses.asdict(cost) for cost in costs]}, indent=1)
    )
    console.print(
        f"hand-over: {fit.latency_s * 1e3:.2f} ms + {fit.seconds_per_token * 1e6:.2f} us a"
        f" prompt token ({fitted.handover_bytes_per_s / 1e6:.0f} MB/s of"
        f" {fitted.kv_bytes_per_token}-byte tokens); profile: {out}"
    )
    return 0
