"""The shipped GPU profiles against public vLLM runs (benchmark, not a test).

Each replayable run of splitserve/latency/public_runs/runs.yaml is served offline
(deployments/simulate.py) on the shipped profile of its device, model and TP degree,
with the run's vLLM scheduler settings (V0, multi-step, max_num_seqs) and its requests
(its own prompt and output lengths where published, else the same dataset's at its
Poisson rate). The replay's figures are computed as benchmark_serving.py computes them
(a request that got no token counts a TTFT of 0 and no TPOT; throughput is output
tokens over the run's span) and printed as ratios to the published ones, per run and,
per set (calibration, held-out), as the median and worst |error|.

    python bench/sim_published.py [--set held-out] [--runs ID,ID] [--profiles DIR]
        [--groups] [--out results/sim_published]

``--groups``: for each run that published every request's TTFT, its first tokens in
groups (requests whose first token came within ``GROUP_S`` of the group's first), as
published and as replayed: each group's time, requests and prompt tokens. A burst's
groups are its prefill steps, so their period and size say where a replay's TTFT goes
wrong (silent requests, whose TTFT the client recorded as 0, are left out).

``--profiles DIR``: profiles to replay on instead of the shipped ones (a fit's
candidates, by the shipped files' names).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from rich.console import Console
from rich.table import Table

from deployments.config import parse_app_config
from deployments.simulate import OfflineCluster
from splitserve.latency.catalog import PROFILES_DIR, profile_name
from splitserve.latency.profile import LatencyProfile
from splitserve.latency.published import FIGURES, Figure, ReplaySpec, replay_specs
from splitserve.offline_exchange import Arrival, Outcome

console = Console(width=160)


GROUP_S = 0.006  # first tokens this close together came from one step
GROUPS_SHOWN = 14


@dataclass(frozen=True)
class Replay:
    spec: ReplaySpec
    profile: str
    figures: dict[Figure, float]
    ttfts: list[float]  # each request's, replayed, in the spec's order

    def ratios(self) -> dict[Figure, float]:
        published = self.spec.run.figures
        return {name: self.figures[name] / value for name, value in published.items() if value}


def shipped_profile_path(spec: ReplaySpec, folder: Path = PROFILES_DIR) -> Path:
    return (
        folder / f"{profile_name(spec.device, spec.model, spec.run.tensor_parallel_size, 1)}.yaml"
    )


def replay(spec: ReplaySpec, profile: Path | LatencyProfile) -> Replay:
    """Serve ``spec``'s requests offline on ``profile`` (a file, or a profile in hand)."""
    if isinstance(profile, LatencyProfile):
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "profile.yaml"
            profile.save(path)
            return replay(spec, path)
    config = parse_app_config(_args(spec, profile))
    cluster = OfflineCluster(config)
    rng = random.Random(spec.run.id)
    arrivals = [
        # Distinct prompts: the runs served ShareGPT with prefix caching off (0.6.0's
        # default), so no prompt found another's KV.
        Arrival(
            index,
            request.at,
            [rng.randrange(10, 30000) for _ in range(request.prompt_tokens)],
            request.max_tokens,
        )
        for index, request in enumerate(spec.requests)
    ]
    outcomes = cluster.run(arrivals)
    ttfts = [o.token_times[0] - r.at for o, r in zip(outcomes, spec.requests, strict=True)]
    return Replay(spec, profile.name, figures(spec, outcomes), ttfts)


def first_token_groups(ttfts: list[float], spec: ReplaySpec) -> list[tuple[float, int, int]]:
    """(time, requests, prompt tokens) of each group of first tokens, silent ones left out."""
    groups: list[list[float]] = []
    timed = sorted(
        (ttft, request.prompt_tokens)
        for ttft, request in zip(ttfts, spec.requests, strict=True)
        if not request.silent
    )
    for ttft, tokens in timed:
        if groups and ttft - groups[-1][0] < GROUP_S:
            groups[-1][1] += 1
            groups[-1][2] += tokens
        else:
            groups.append([ttft, 1, tokens])
    return [(at, int(count), int(tokens)) for at, count, tokens in groups]


def _print_groups(replays: list[Replay]) -> None:
    for item in replays:
        published = [request.ttft for request in item.spec.requests]
        if any(ttft is None for ttft in published):
            continue
        console.print(f"[bold]{item.spec.run.id}[/]: first-token groups, time s:requests/tokens")
        for label, ttfts in (("published", published), ("replayed", item.ttfts)):
            groups = first_token_groups([t or 0.0 for t in ttfts], item.spec)[:GROUPS_SHOWN]
            shown = " ".join(f"{at:.3f}:{count}/{tokens}" for at, count, tokens in groups)
            console.print(f"  {label:9} {shown}")


def _args(spec: ReplaySpec, profile: Path) -> dict[str, Any]:
    tp = spec.run.tensor_parallel_size
    return {
        # One engine of TP ranks: single.yaml's shape, or tp.yaml's where TP > 1.
        "shape": "tp" if tp > 1 else "single",
        "accelerator": "cpu",
        "model": {"max_model_len": spec.max_model_len, "enable_prefix_caching": False},
        "engine": {"backend": "simulated", "profile": str(profile)},
        "pools": [
            {
                "role": "mixed",
                "replicas": 1,
                "tensor_parallel_size": tp,
                "engine_kwargs": spec.engine_kwargs,
            }
        ],
    }


def figures(spec: ReplaySpec, outcomes: list[Outcome]) -> dict[Figure, float]:
    """The run's figures as benchmark_serving.py computes them from what it received."""
    ttfts, tpots, tokens, end = [], [], 0, 0.0
    for request, outcome in zip(spec.requests, outcomes, strict=True):
        if outcome.status != 200 or not outcome.token_times:
            raise RuntimeError(f"{spec.run.id}: request {outcome.index} failed: {outcome.error}")
        times = outcome.token_times
        end = max(end, times[-1])
        if request.silent:
            ttfts.append(0.0)  # no token reached the client: its TTFT is recorded as 0
            continue
        ttft = times[0] - request.at
        ttfts.append(ttft)
        tokens += len(times)
        if len(times) > 1:
            tpots.append((times[-1] - request.at - ttft) / (len(times) - 1))
    start = min(request.at for request in spec.requests)
    return {
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "tpot_p50_ms": 1e3 * statistics.median(tpots),
        "output_tokens_per_s": tokens / (end - start),
    }


def errors(replays: list[Replay], runs: bool = False) -> dict[str, float]:
    """Per figure, the median and worst |ratio - 1| over ``replays`` (and how many runs
    publish it, with ``runs``): a profile's ``held_out_error`` takes this form."""
    out: dict[str, float] = {}
    for figure in FIGURES:
        values = [abs(r.ratios()[figure] - 1) for r in replays if figure in r.ratios()]
        if values:
            out[f"{figure} median"] = statistics.median(values)
            out[f"{figure} worst"] = max(values)
            if runs:
                out[f"{figure} runs"] = len(values)
    return out


def summary(replays: list[Replay]) -> dict[str, dict[str, float]]:
    """Per set: ``errors`` over its runs."""
    out: dict[str, dict[str, float]] = {}
    for name in ("calibration", "held-out"):
        found = errors([item for item in replays if item.spec.set == name], runs=True)
        if found:
            out[name] = found
    return out


def _print(replays: list[Replay]) -> None:
    table = Table(title="simulated / published, per run (offline replay)")
    for column in ("set", "run", "lengths", "profile", *FIGURES):
        table.add_column(column, justify="right" if column in FIGURES else "left")
    for item in sorted(replays, key=lambda r: (r.spec.set, r.spec.run.id)):
        ratios = item.ratios()
        cells = [f"{ratios[f]:.2f}" if f in ratios else "" for f in FIGURES]
        run = item.spec.run.id.replace("-sharegpt", "").removesuffix("-inf")
        table.add_row(item.spec.set, run, item.spec.lengths, item.profile, *cells)
    console.print(table)
    overall = Table(title="|simulated / published - 1| per set")
    for column in ("set", "figure", "runs", "median", "worst"):
        overall.add_column(column)
    for name, values in summary(replays).items():
        for figure in FIGURES:
            if f"{figure} runs" in values:
                overall.add_row(
                    name,
                    figure,
                    str(int(values[f"{figure} runs"])),
                    f"{values[f'{figure} median']:.1%}",
                    f"{values[f'{figure} worst']:.1%}",
                )
    console.print(overall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=("calibration", "held-out", "all"), default="all")
    parser.add_argument("--runs", help="only these run ids, comma-separated")
    parser.add_argument("--profiles", type=Path, default=PROFILES_DIR)
    parser.add_argument("--groups", action="store_true", help="print first-token groups")
    parser.add_argument("--out", type=Path, default=Path("results/sim_published"))
    args = parser.parse_args()
    specs = [s for s in replay_specs() if args.set in ("all", s.set)]
    if args.runs:
        wanted = set(args.runs.split(","))
        specs = [s for s in specs if s.run.id in wanted]
    replays = []
    for spec in specs:
        path = shipped_profile_path(spec, args.profiles)
        if not path.exists():
            console.print(f"[yellow]no profile {path.name} for {spec.run.id}: skipped")
            continue
        replays.append(replay(spec, path))
    _print(replays)
    if args.groups:
        _print_groups(replays)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "sim_published.json"
    rows = [
        {
            "run": r.spec.run.id,
            "set": r.spec.set,
            "lengths": r.spec.lengths,
            "profile": r.profile,
            "simulated": r.figures,
            "published": r.spec.run.figures,
            "ratio": r.ratios(),
        }
        for r in replays
    ]
    saved.write_text(json.dumps({"rows": rows, "summary": summary(replays)}, indent=1))
    console.print(f"saved {saved}")


if __name__ == "__main__":
    main()
