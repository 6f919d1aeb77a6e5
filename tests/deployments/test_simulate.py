"""The offline simulation: the router's decisions over simulated engines in virtual time,
its results as a load generator run's, and decode runs that change nothing but speed."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from deployments.config import load_application
from deployments.launcher import config_path
from deployments.simulate import OfflineCluster, Worker, simulated_application, work
from engines.simulated.frontend import FrontEnd
from engines.simulated.scheduler import SimScheduler
from loadgen.study.simulate import SimulatedTarget, describe
from splitserve.latency.profile import load_profile
from splitserve.offline_exchange import (
    Answer,
    Arrival,
    Job,
    Outcome,
    RunSpeed,
    decode,
    encode,
    read_lines,
    write_lines,
)

PROFILE = "h100-llama-3.1-8b"


def _arrivals(count: int, rate: float, prompt: int = 1024, output: int = 64) -> list[Arrival]:
    rng = random.Random(0)
    at, arrivals = 0.0, []
    for index in range(count):
        at += rng.expovariate(rate)
        tokens = [rng.randint(10, 250) for _ in range(prompt)]
        arrivals.append(Arrival(index, at, tokens, output))
    return arrivals


def _run(config: str, arrivals: list[Arrival]) -> OfflineCluster:
    cluster = OfflineCluster(simulated_application(config, PROFILE))
    cluster.run(arrivals)
    return cluster


def test_decode_runs_give_the_same_token_times_as_single_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    arrivals = _arrivals(120, rate=8.0)
    batched = _run("dp", arrivals)
    monkeypatch.setattr(SimScheduler, "decode_run_length", lambda self, step: 1)
    stepped = _run("dp", arrivals)
    assert batched.queue.events < 0.7 * stepped.queue.events
    for fast, slow in zip(batched.outcomes, stepped.outcomes, strict=True):
        assert fast.token_times == pytest.approx(slow.token_times, abs=1e-9)


def test_every_request_gets_its_tokens_and_dp_spreads_them() -> None:
    cluster = _run("dp", _arrivals(60, rate=10.0, output=32))
    assert all(len(o.token_times) == 32 and o.outcome == "ok" for o in cluster.outcomes)
    served = [e.scheduler.prefix_queries for e in cluster.engines.values()]
    assert min(served) > 0.3 * sum(served)  # round robin: neither engine took it all
    assert all(len(engine.scheduler) == 0 for engine in cluster.engines.values())


def test_pd_always_prefills_remotely_and_the_decode_waits_for_the_hand_over() -> None:
    cluster = OfflineCluster(simulated_application("pd_always", PROFILE))
    decode = cluster.engines["decode-0"]
    calibrated = decode.scheduler.prefix_queries  # the router's calibration prefill
    cluster.run(_arrivals(20, rate=2.0, output=16))
    profile = decode.profile
    for outcome in cluster.outcomes:
        assert outcome.prefill == "remote:always"
        assert len(outcome.token_times) == 16
        # The second token comes after the KV's hand-over (alone, nothing queues here).
        gap = outcome.token_times[1] - outcome.token_times[0]
        assert gap >= profile.handover_seconds(1024)
    # Its prompts' KV arrived; it computed none of them.
    assert decode.scheduler.prefix_queries == calibrated


def test_a_burst_of_hand_overs_to_one_decode_engine_queues_on_its_link() -> None:
    """Prompts that arrive together are prefilled together; their KV then crosses the
    decode engine's link one prompt after another, not all at the link's full rate."""
    arrivals = [msgspec.structs.replace(a, at=0.0) for a in _arrivals(8, rate=1.0, output=2)]
    cluster = _run("pd_always", arrivals)
    decode = cluster.engines["decode-0"]
    moving = decode.profile.handover_bytes_seconds(1024)
    seconds = sorted(o.token_times[1] - o.token_times[0] for o in cluster.outcomes)
    # The last waits for the seven before it: far longer than a hand-over alone.
    assert seconds[-1] - seconds[0] >= 6 * moving


def test_the_hand_overs_reach_the_cost_meter_as_real_engines_report_them() -> None:
    cluster = _run("pd_always", _arrivals(20, rate=2.0, output=4))
    decode = cluster.engines["decode-0"]
    transfers = decode.stats().kv_transfer
    assert transfers is not None and transfers["handovers"]["get"] == 20
    assert transfers["bytes"]["get"] == 20 * 1024 * decode.profile.kv_bytes_per_token
    # Seconds per handed-over token: every prompt token's KV but the last one's.
    estimate = cluster.transfer_cost.estimate_s(1023)
    assert estimate == pytest.approx(decode.profile.handover_seconds(1024), rel=1e-6)


def test_the_cost_policy_keeps_prompts_local_once_it_has_measured_a_slow_link(
    tmp_path: Path,
) -> None:
    """pd.yaml with the cost policy, over the shipped profile's link and over one a
    hundred times slower: only the slow one's measured hand-overs keep prompts local."""
    application = yaml.safe_load(config_path("pd").read_text())
    application["applications"][0]["args"]["prefill_policy"] = {"name": "cost"}
    config = tmp_path / "pd_cost.yaml"
    config.write_text(yaml.safe_dump(application))
    shipped = load_profile(f"{PROFILE}-tp1-pp1")
    slow = shipped.model_copy(update={"handover_bytes_per_s": shipped.handover_bytes_per_s / 100})
    slow.save(tmp_path / "slow-link.yaml")
    arrivals = _arrivals(200, rate=20.0, prompt=2048, output=32)
    reasons = {}
    for link, profile in (("shipped", PROFILE), ("slow", str(tmp_path / "slow-link.yaml"))):
        cluster = OfflineCluster(simulated_application(str(config), profile))
        cluster.run(arrivals)
        reasons[link] = Counter(outcome.prefill for outcome in cluster.outcomes)
    # 2048 tokens of KV: about 26 ms over the shipped link, 2.6 s over the slow one. The
    # meter hears of a hand-over at its first token, and over the slow link the first
    # ones queue behind each other: prompts go remote until then (116 of 200 here).
    assert reasons["shipped"]["local:transfer_too_slow"] == 0
    assert reasons["slow"]["local:transfer_too_slow"] > 0.3 * len(arrivals)


def test_qos_refuses_what_would_break_the_ttft_objective() -> None:
    cluster = _run("pd", _arrivals(400, rate=2000.0, prompt=2048, output=8))
    outcomes = [o.outcome for o in cluster.outcomes]
    assert "rejected" in outcomes and "ok" in outcomes
    assert {o.status for o in cluster.outcomes if o.outcome == "rejected"} <= {429, 503}


def test_loadgen_simulate_writes_a_runs_results(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "loadgen",
        "simulate",
        "dp",
        "--latency-profile",
        PROFILE,
        "--workload",
        "general",
        "--qps",
        "20",
        "--num-requests",
        "50",
        "--no-plots",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.loads((tmp_path / "dp-general-qps20.json").read_text())
    assert run["summary"]["completed"] == 50
    vllm = json.loads((tmp_path / "dp-general-qps20.vllm.json").read_text())
    assert vllm["completed"] == 50
    assert 0 < vllm["median_ttft_ms"] < 1000


def test_the_simulator_runs_in_the_repository_whatever_the_callers_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Called from a folder that holds a module named like one of ours (bench/ holds
    kv_transfer.py) with a profile path relative to that folder: the simulator finds
    our package and the caller's profile."""
    (tmp_path / "kv_transfer.py").write_text("raise ImportError('the caller's module')\n")
    load_profile(f"{PROFILE}-tp1-pp1").save(tmp_path / "mine.yaml")
    monkeypatch.chdir(tmp_path)
    assert describe(SimulatedTarget("dp", "mine.yaml")).shape == "dp"


def test_the_phase_shifting_bench_runs_offline(tmp_path: Path) -> None:
    """bench/auto.py --simulate, the README's "which shape" figures, at a size a test can
    wait for: it reads loadgen's traffic records and the simulator's results."""
    bench = config_path("dp").parents[1] / "bench" / "auto.py"
    command = [
        sys.executable, str(bench), "--simulate", PROFILE, "--engines", "2",
        "--phase-s", "2", "--chat-rate", "10", "--summarize-rate", "5",
        "--slo-ttft-ms", "250", "--slo-tpot-ms", "20", "--burst-requests", "0",
        "--rounds", "1", "--only", "dp,pd", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    shapes = json.loads((tmp_path / "auto.json").read_text())["shapes"]
    for shape in ("dp", "pd"):
        (round_,) = shapes[shape]["rounds"]
        phases = [phase["phase"] for phase in round_["phases"]]
        assert phases == ["chat", "summarize", "chat"]
        assert all(phase["requests"] > 0 for phase in round_["phases"])


def test_advise_simulate_chooses_a_split_from_offline_cells(tmp_path: Path) -> None:
    advised = tmp_path / "advised.yaml"
    command = [
        sys.executable,
        "-m",
        "loadgen",
        "advise",
        "--simulate",
        PROFILE,
        "--shapes",
        "single,dp",
        "--qps",
        "8,64",
        "--num-requests",
        "40",
        "--slo-ttft-ms",
        "500",
        "--target",
        "gpu",
        "--out",
        str(tmp_path / "advice"),
        "--yaml",
        str(advised),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = sorted(p.name for p in (tmp_path / "advice" / "sweep" / "runs").glob("*.json"))
    assert runs == [
        "dp-general-qps64.json",
        "dp-general-qps8.json",
        "single-general-qps64.json",
        "single-general-qps8.json",
    ]
    assert advised.exists()
    assert "| dp | 2 |" in (tmp_path / "advice" / "advice.md").read_text()


def _answer(worker: Worker, **job: Any) -> Answer:
    """The worker's answer to ``job``, sent as the load generator sends it: a line."""
    answers: list[str] = []
    work([encode(Job(**job))], answers.append)
    (line,) = answers
    return decode(line, Answer)


def _speed(answer: Answer) -> RunSpeed:
    assert answer.speed is not None, answer.error
    return answer.speed


def test_a_worker_serves_the_same_prompts_at_another_rate_from_their_offsets(
    tmp_path: Path,
) -> None:
    arrivals = _arrivals(30, rate=5.0, output=8)
    requests = tmp_path / "requests.jsonl"
    write_lines(requests, arrivals)
    worker = Worker()
    job = {"config": "dp", "profile": PROFILE, "requests": str(requests)}
    slow = _speed(_answer(worker, **job, out=str(tmp_path / "slow.jsonl")))
    assert slow.requests == 30 and slow.engines == 2
    faster = [a.at / 4 for a in arrivals]
    fast = _speed(_answer(worker, **job, out=str(tmp_path / "fast.jsonl"), at=faster))
    assert fast.virtual_s < slow.virtual_s
    served = list(read_lines(tmp_path / "fast.jsonl", Outcome))
    assert [o.arrival_s for o in served] == faster
    # The same as a cluster of its own serving the requests at those times.
    alone = _run(
        "dp", [msgspec.structs.replace(a, at=at) for a, at in zip(arrivals, faster, strict=True)]
    )
    assert [o.token_times for o in served] == [o.token_times for o in alone.outcomes]
    first = _speed(_answer(worker, **job, out=str(tmp_path / "first.jsonl"), at=faster[:3]))
    assert first.requests == 3  # a shorter run serves the file's first requests
    assert [o.index for o in read_lines(tmp_path / "first.jsonl", Outcome)] == [0, 1, 2]
    wrong = _answer(worker, **job, out=str(tmp_path / "x.jsonl"), at=faster * 2)
    assert wrong == Answer(error="ValueError: 60 arrival offsets for 30 requests")
    unknown = _answer(worker, **{**job, "config": "nowhere"}, out=str(tmp_path / "y.jsonl"))
    assert unknown.error is not None and "nowhere" in unknown.error


def test_a_worker_answers_a_malformed_job_with_the_field_it_lacks() -> None:
    answers: list[str] = []
    work(['{"config": "dp", "profile": "p", "requests": "r"}'], answers.append)
    (line,) = answers
    answer = decode(line, Answer)
    assert answer.speed is None and answer.error is not None and "`out`" in answer.error


def test_advise_simulate_searches_every_placement_of_a_budget(tmp_path: Path) -> None:
    advised = tmp_path / "advised.yaml"
    command = [
        sys.executable, "-m", "loadgen", "advise", "--simulate", PROFILE, "--devices", "2",
        "--workload", "general", "--num-requests", "60", "--run-seconds", "3", "--qps-start", "8",
        "--slo-ttft-ms", "300", "--slo-tpot-ms", "25", "--out", str(tmp_path / "advice"),
        "--yaml", str(advised),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "advice" / "placement.json").read_text())
    labels = {p["placement"] for p in report["placements"]}
    assert labels == {"tp TP2", "dp 2 x TP1", "auto 2 x TP1", "pd 1:1 x TP1", "pd_always 1:1 x TP1"}
    assert all(p["error"] is None and p["goodput"] > 0 for p in report["placements"])
    best = max(p["goodput"] for p in report["placements"])
    winner = next(p for p in report["placements"] if p["placement"] == report["winner"])
    assert winner["goodput"] >= (1 - max(0.05, report["error_band"]["goodput"])) * best
    # The error printed beside the answer: the report's, the YAML's and the console's.
    assert report["error_band"]["runs"] >= 10
    assert "held-out public runs" in (tmp_path / "advice" / "placement.md").read_text()
    assert "held-out public runs" in advised.read_text().splitlines()[2]
    assert "held-out public runs" in done.stdout
    config = load_application(advised).models[0]  # the YAML serves as it is written
    assert config.accelerator == "gpu"
    assert config.router.traffic_profile is not None
    assert config.router.traffic_profile.request_rate == pytest.approx(winner["goodput"], 1e-3)
    assert len(list((tmp_path / "advice" / "placements").glob("*.yaml"))) == 5


def test_a_request_lost_on_its_way_to_the_scheduler_fails_the_run_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hand-over's KV arriving while its request is still in the front end once left
    the decode waiting forever, and the run polled forever: now it stops with a reason."""
    monkeypatch.setattr(FrontEnd, "kv_arrived", lambda self, request_id: True)
    arrivals = [msgspec.structs.replace(a, at=0.0) for a in _arrivals(4, rate=1.0, output=2)]
    with pytest.raises(RuntimeError, match="stalled"):
        _run("pd_always", arrivals)


def test_kv_that_crosses_before_its_burst_is_released_is_loaded_on_release() -> None:
    arrivals = [msgspec.structs.replace(a, at=0.0) for a in _arrivals(8, rate=1.0, output=2)]
    cluster = OfflineCluster(simulated_application("pd_always", PROFILE))
    decode = cluster.engines["decode-0"].scheduler
    calibrated = decode.prefix_queries  # the router's calibration prefill
    cluster.run(arrivals)
    assert all(len(o.token_times) == 2 for o in cluster.outcomes)
    assert decode.prefix_queries == calibrated
