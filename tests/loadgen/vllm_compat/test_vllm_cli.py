"""``python -m loadgen`` takes ``vllm bench serve``'s command lines: every flag of vLLM's
parser (read from vLLM itself) is served or refused by name, the command lines printed in
docs/LOADGEN.md run against the fake server, headers and ``$OPENAI_API_KEY`` reach the
server."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.benchmarks import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser

from loadgen.cli import build_parser, main
from loadgen.client.fake_server import FakeServerConfig, fake_server_in_thread
from loadgen.client.streaming import request_headers
from loadgen.data.burstgpt import BurstGPTShapedGenerator, write_trace_csv
from loadgen.scheduling.arrivals import RampUpArrivals, ramp_up_rates
from loadgen.vllm_compat.cli import NO_EFFECT_FLAGS, REFUSED_FLAGS, normalize_flag_names, resolve

REPO = Path(__file__).resolve().parents[3]
# The command lines of docs/LOADGEN.md's "vllm bench serve's command line" section, read
# from the page itself so that the page and this test cannot drift (M: the model, DIR:
# a folder, FILE: a data file; the server at 10.0.0.5:8000 becomes the fake one).
DOC = REPO / "docs" / "LOADGEN.md"
DOC_HEADING = "## `vllm bench serve`'s command line"
COMMAND = "python -m loadgen "


def documented_command_lines(doc: Path = DOC, heading: str = DOC_HEADING) -> list[str]:
    """The arguments of every ``python -m loadgen`` line in the first fenced code block
    under ``heading`` in ``doc``. Raises if the heading, its code block or any such line
    is missing, or if the block holds another command (a line this test would not run),
    so that a moved, emptied or reworded section fails the test instead of passing it."""
    lines = doc.read_text().splitlines()
    if heading not in lines:
        raise AssertionError(f"{doc}: no line {heading!r}; the command lines moved?")
    block: list[str] | None = None
    for line in lines[lines.index(heading) + 1 :]:
        text = line.strip()
        if block is None:
            if text.startswith("```"):
                block = []
            elif text.startswith("#"):
                break  # the next heading, and no code block in between
        elif text.startswith("```"):
            break
        else:
            block.append(text)
    if block is None:
        raise AssertionError(f"{doc}: no fenced code block under {heading!r}")
    others = [text for text in block if text and not text.startswith(("#", COMMAND))]
    if others:
        raise AssertionError(f"{doc}: no {COMMAND.strip()!r} at the start of {others[0]!r}")
    commands = [text.removeprefix(COMMAND) for text in block if text.startswith(COMMAND)]
    if not commands:
        raise AssertionError(f"{doc}: no {COMMAND.strip()!r} line in the block under {heading!r}")
    return commands


DOCUMENTED = documented_command_lines()

# Run small and fast against the fake server: fewer requests, higher rates.
SHRINK = {
    "--num-prompts": "16",
    "--request-rate": "400",
    "--ramp-up-start-rps": "100",
    "--ramp-up-end-rps": "400",
}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    config = FakeServerConfig(port=0, ttft_ms=1, itl_ms=0.2, tokens_per_chunk=2)
    with fake_server_in_thread(config) as url:
        yield url


def vllm_flags() -> dict[str, argparse.Action]:
    """Every option of ``vllm bench serve``, from vLLM's own parser."""
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    return {
        flag: action
        for action in parser._actions
        for flag in action.option_strings
        if flag not in ("-h", "--help")
    }


def sample_argv(flag: str, action: argparse.Action) -> list[str]:
    """The flag with a value of the type vLLM's parser wants."""
    samples = {
        "--backend": "openai", "--dataset-name": "random", "--endpoint": "/v1/completions",
        "--random-range-ratio": "0.1", "--percentile-metrics": "ttft",
        "--metric-percentiles": "99", "--goodput": "ttft:100", "--header": "a=b",
        "--metadata": "a=b", "--lora-assignment": "random", "--ramp-up-strategy": "linear",
        "--extra-body": "{}", "--lora-modules": "a",
    }  # fmt: skip
    if action.nargs == 0:
        return [flag]
    if flag in samples:
        return [flag, samples[flag]]
    if action.type in (int, float):
        return [flag, "1"]
    return [flag, "x"]


def test_every_vllm_flag_is_served_or_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = vllm_flags()
    parser = build_parser()
    ours = parser._option_string_actions
    assert sorted(set(flags) - set(ours)) == []
    assert sorted(set(REFUSED_FLAGS) - set(flags)) == []  # no refusal of a flag vLLM lost
    served = []
    for flag, action in flags.items():
        argv = sample_argv(flag, action)
        if flag in REFUSED_FLAGS:
            with pytest.raises(SystemExit) as exited:
                parser.parse_args(argv)
            assert exited.value.code == 2
            error = capsys.readouterr().err
            assert f"argument {flag}" in error and "does not serve" in error, error
        else:
            args = parser.parse_args(argv)  # served: parsed, and never a refusal
            assert isinstance(args, argparse.Namespace)
            served.append(flag)
    assert len(served) > 50 and "--save-result" in served and "--goodput" in served


def test_every_flag_has_help_text() -> None:
    missing = [
        action.option_strings
        for action in build_parser()._actions
        if action.option_strings and not action.help
    ]
    assert missing == []


def test_loadgen_does_not_import_vllm() -> None:
    code = (
        "import sys\n"
        "from loadgen.cli import build_parser\n"
        "from loadgen.vllm_compat.cli import resolve\n"
        "import loadgen.vllm_compat.result, loadgen.vllm_compat.datasets\n"
        "resolve(build_parser().parse_args(['--dataset-name', 'random', '--save-result']))\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile"], "argument --profile: a flag of vllm bench serve"),
        (["--dataset-name", "sharegpt"], "sharegpt is a dataset of vllm bench serve"),
        (["--backend", "openai-embeddings"], "openai-embeddings is a backend"),
        (["--hf-split", "train"], "an option of hf"),
        (["--no-self-timed"], "an option of timed_trace"),
    ],
)
def test_refusals_name_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


RAMP = ["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--endpoint", "/v1/embeddings"], "a path ending in /completions"),
        (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "speaks"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"], "--ramp-up-end-rps"),
        ([*RAMP, "--request-rate", "3"], "leave out --request-rate"),
        (["--dataset-name", "burstgpt"], "needs --dataset-path"),
        (["--dataset-name", "random", "--dataset-path", "x.csv"], "--dataset-path is for"),
        (["--dataset-name", "custom", "--dataset-path", "p.jsonl"], "--skip-chat-template"),
        (["--goodput", "ttft:300", "--slo-ttft-ms", "200"], "disagrees"),
        (["--goodput", "itl:3"], "choose from ttft, tpot, e2el"),
        (["--percentile-metrics", "ttft,gpu"], "--percentile-metrics gpu"),
        (["--header", "novalue"], "expected KEY=VALUE"),
        (["--result-filename", "x.json"], "add that flag"),
        (["--arrivals", "poisson", "--burstiness", "0.5"], "--burstiness shapes gamma"),
    ],
)
def test_inconsistent_command_lines_are_clear_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--base-url", "http://127.0.0.1:9"]) == 1
    assert message in capsys.readouterr().out.replace("\n", "")


def test_underscored_flag_names_work_as_in_vllm() -> None:
    argv = ["--random_input_len", "7", "--dataset_name=random", "--metadata", "a_b=c_d"]
    assert normalize_flag_names(argv) == [
        "--random-input-len", "7", "--dataset-name=random", "--metadata", "a_b=c_d",
    ]  # fmt: skip


def test_no_effect_flags_are_announced() -> None:
    args = build_parser().parse_args(["--tokenizer-mode", "mistral", "--trust-remote-code"])
    notes = resolve(args).notes
    assert [note.split(":")[0] for note in notes] == list(NO_EFFECT_FLAGS)


def test_dataset_flags_of_another_dataset_are_announced() -> None:
    args = build_parser().parse_args(
        ["--dataset-name", "random", "--custom-output-len", "5", "--disable-shuffle"]
    )
    notes = resolve(args).notes
    assert any(n.startswith("--custom-output-len: no effect with --dataset-name random")
               for n in notes)  # fmt: skip
    assert any(n.startswith("--disable-shuffle: no effect") for n in notes)


def test_api_key_and_headers() -> None:
    environ = {"OPENAI_API_KEY": "sk-1"}
    assert request_headers({}, environ) == {"Authorization": "Bearer sk-1"}
    assert request_headers({"X-A": "b"}, environ) == {"Authorization": "Bearer sk-1", "X-A": "b"}
    # A --header Authorization wins, whatever its case.
    assert request_headers({"authorization": "Basic x"}, environ) == {"authorization": "Basic x"}
    assert request_headers({}, {}) == {}


def test_api_key_and_header_reach_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    required = {"Authorization": "Bearer sk-test", "X-Team": "perf"}
    config = FakeServerConfig(port=0, required_headers=required)
    argv = ["--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "2",
            "--no-plots", "--no-progress", "--result-dir", str(tmp_path)]  # fmt: skip
    with fake_server_in_thread(config) as url:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        assert main([*argv, "--base-url", url, "--header", "X-Team=perf", "--save-result",
                     "--save-detailed", "--result-filename", "ok.json"]) == 0  # fmt: skip
        monkeypatch.delenv("OPENAI_API_KEY")
        # No key: /v1/models is refused, and the run says so.
        assert main([*argv, "--base-url", url, "--header", "X-Team=perf"]) == 1
    result = json.loads((tmp_path / "ok.json").read_text())
    assert result["completed"] == 4 and result["errors"] == [""] * 4


def test_ramp_up_rates_and_schedule() -> None:
    assert ramp_up_rates("linear", 1, 5, 5) == [1, 2, 3, 4, 5]
    exponential = ramp_up_rates("exponential", 1, 16, 5)
    assert exponential == pytest.approx([1, 2, 4, 8, 16])
    schedule = RampUpArrivals("linear", 10, 1000, burstiness=math.inf).schedule(100)
    gaps = [b - a for a, b in itertools.pairwise(schedule)]
    # The gap before request i is 1 / its rate: 10 + 990 i / 99 requests/s.
    assert schedule[0] == 0
    assert (gaps[0], gaps[-1]) == (pytest.approx(1 / 20), pytest.approx(1 / 1000))


def documented_argv(line: str, url: str, tmp_path: Path) -> list[str]:
    trace = tmp_path / "trace.csv"
    write_trace_csv(BurstGPTShapedGenerator(seed=2).generate(400), trace)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(9)))
    port = url.rsplit(":", 1)[1]
    words = {"M": "fake-model", "DIR": str(tmp_path / "out"), "FILE.csv": str(trace),
             "FILE.jsonl": str(prompts), "10.0.0.5": "127.0.0.1", "8000": port}  # fmt: skip
    argv = [words.get(word, word) for word in line.split()]
    for flag, value in SHRINK.items():
        if flag in argv and argv[argv.index(flag) + 1] != "inf":
            argv[argv.index(flag) + 1] = value
    if "--host" not in argv:
        argv += ["--base-url", url]
    return [*argv, "--no-plots", "--disable-tqdm", "--num-warmups", "1"]


@pytest.mark.parametrize(
    "page",
    [
        f"intro\n{DOC_HEADING}\ntext only\n## next\n```\n{COMMAND}--x\n```\n",
        f"{DOC_HEADING}\n```bash\n# only a comment\n```\n",
        f"{DOC_HEADING}\n```\n{COMMAND}--x\npython3 -m loadgen --x\n```\n",
        f"## another heading\n```\n{COMMAND}--x\n```\n",
    ],
    ids=["no-block", "no-loadgen-line", "another-command", "no-heading"],
)
def test_the_documented_lines_reader_fails_loudly(page: str, tmp_path: Path) -> None:
    doc = tmp_path / "PAGE.md"
    doc.write_text(page)
    with pytest.raises(AssertionError, match=r"PAGE\.md: no "):
        documented_command_lines(doc)


@pytest.mark.parametrize(
    "line", DOCUMENTED, ids=lambda line: line.split("--dataset-name ")[-1][:18]
)
def test_documented_command_lines_run(line: str, server: str, tmp_path: Path) -> None:
    assert main(documented_argv(line, server, tmp_path)) == 0
    # Our own files are named after the fake server's shape; vLLM's after the backend.
    (saved,) = [p for p in (tmp_path / "out").glob("*.json") if not p.name.startswith("fake-")]
    result: dict[str, Any] = json.loads(saved.read_text())
    assert result["completed"] == result["num_prompts"] == 16 and result["failed"] == 0
    if "--goodput" in line:
        assert result["request_goodput"] is not None
    if "--label" in line:
        assert result["label"] == "burst" and saved.name.startswith("burst-")
    if "--ramp-up-strategy" in line:
        assert result["ramp_up_strategy"] == "linear" and result["rps_change_events"]
        assert (result["hardware"], result["tp"]) == ("h100", "1")
    if "prefix_repetition" in line:
        (ours,) = (tmp_path / "out").glob("*.vllm.json")  # always with the per-request lists
        assert set(json.loads(ours.read_text())["input_lens"]) == {512 + 128}
    if "--percentile-metrics ttft,e2el,client_queue_time" in line:
        assert "p99_client_queue_time_ms" in result and "mean_itl_ms" not in result
