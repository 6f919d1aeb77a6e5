"""BurstGPT: CSV parsing, filters and subset rules on generated CSVs; download and offline."""

from __future__ import annotations

import functools
import hashlib
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loadgen.data import burstgpt
from loadgen.data.burstgpt import (
    BURSTGPT_FILENAME,
    BurstGPTShapedGenerator,
    BurstGPTTrace,
    TraceUnavailableError,
    download_trace,
    filter_trace,
    read_trace_csv,
    replay_window,
    resolve_trace_file,
    subset_means,
    trace_subset,
    write_trace_csv,
)
from tests.support.local_ports import free_port

CONTEXT = 4096
# (timestamp, model, request, response, log type)
ROWS = [
    (5, "ChatGPT", 472, 18, "Conversation log"),  # general
    (45, "ChatGPT", 1087, 230, "Conversation log"),  # general
    (118, "GPT-4", 417, 276, "API log"),  # general, GPT-4, API
    (185, "ChatGPT", 1600, 100, "Conversation log"),  # prefill-heavy
    (200, "ChatGPT", 1400, 384, "Conversation log"),  # prefill-heavy, both bounds inclusive
    (210, "ChatGPT", 1399, 100, "Conversation log"),  # just short of prefill-heavy
    (214, "ChatGPT", 1500, 385, "Conversation log"),  # response just too long for it
    (261, "ChatGPT", 37, 1656, "Conversation log"),  # decode-heavy
    (267, "GPT-4", 54, 800, "Conversation log"),  # decode-heavy, lower bound
    (300, "ChatGPT", 54, 799, "Conversation log"),  # just short of decode-heavy
    (1106, "ChatGPT", 0, 0, "Conversation log"),  # failed
    (4525, "GPT-4", 614, 0, "API log"),  # failed
    (5000, "ChatGPT", 3900, 300, "Conversation log"),  # beyond the context: 4200
]


def _trace(rows: list[tuple[int, str, int, int, str]] = ROWS) -> BurstGPTTrace:
    columns = list(zip(*rows, strict=True))
    return BurstGPTTrace(
        timestamps=np.asarray(columns[0], dtype=float),
        request_tokens=np.asarray(columns[2], dtype=np.int64),
        response_tokens=np.asarray(columns[3], dtype=np.int64),
        models=np.asarray(columns[1], dtype=object),
        log_types=np.asarray(columns[4], dtype=object),
        source="rows",
    )


@pytest.fixture
def trace_csv(tmp_path: Path) -> Path:
    path = tmp_path / BURSTGPT_FILENAME
    write_trace_csv(_trace(), path)
    return path


def test_csv_round_trip(trace_csv: Path) -> None:
    header = trace_csv.read_text().splitlines()[0]
    assert header == "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"
    trace = read_trace_csv(trace_csv)
    assert len(trace) == len(ROWS)
    assert trace.request_tokens.tolist() == [r[2] for r in ROWS]
    assert trace.models[2] == "GPT-4" and trace.log_types[2] == "API log"
    assert trace.timestamps[-1] == 5000.0


def test_missing_column_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("Timestamp,Model,Request tokens\n1,ChatGPT,3\n")
    with pytest.raises(ValueError, match="Response tokens"):
        read_trace_csv(path)


def test_filters_drop_failures_and_select_model_and_log_type(trace_csv: Path) -> None:
    trace = read_trace_csv(trace_csv)
    assert len(filter_trace(trace)) == len(ROWS) - 2
    gpt4 = filter_trace(trace, models=["gpt-4"])
    assert gpt4.request_tokens.tolist() == [417, 54]
    api = filter_trace(trace, log_types=["API"])
    assert api.request_tokens.tolist() == [417]
    both = filter_trace(trace, models=["ChatGPT", "GPT-4"], log_types=["Conversation log"])
    assert len(both) == len(ROWS) - 3


def test_subset_rules(trace_csv: Path) -> None:
    trace = filter_trace(read_trace_csv(trace_csv))
    general = trace_subset(trace, "T-general", CONTEXT)
    assert 3900 not in general.request_tokens  # 4200 tokens do not fit 4096
    assert len(general) == len(ROWS) - 3
    prefill = trace_subset(trace, "T-prefill-heavy", CONTEXT)
    assert prefill.request_tokens.tolist() == [1600, 1400]
    decode = trace_subset(trace, "T-decode-heavy", CONTEXT)
    assert decode.response_tokens.tolist() == [1656, 800]
    assert len(trace_subset(trace, "T-general", max_model_len=1024)) == 4
    with pytest.raises(ValueError, match="unknown trace subset"):
        trace_subset(trace, "T-nothing", CONTEXT)


def test_replay_window_keeps_arrivals_and_clamps_lengths(trace_csv: Path) -> None:
    trace = filter_trace(read_trace_csv(trace_csv))
    window = replay_window(trace, start=len(trace) - 2, count=2, max_model_len=CONTEXT)
    assert window.timestamps.tolist() == [300.0, 5000.0]
    assert window.request_tokens.tolist() == [54, 3900]
    assert window.response_tokens.tolist() == [799, CONTEXT - 3900]  # clamped, not dropped
    with pytest.raises(ValueError, match="beyond the trace"):
        replay_window(trace, start=5, count=len(trace), max_model_len=CONTEXT)


def test_generator_has_burstgpt_shape_and_is_reproducible() -> None:
    generator = BurstGPTShapedGenerator(seed=3)
    trace = generator.generate(100_000)
    assert trace.synthetic and "synthetic" in trace.source
    assert np.array_equal(
        trace.request_tokens, BurstGPTShapedGenerator(seed=3).generate(100_000).request_tokens
    )
    assert 0.01 < float((trace.response_tokens == 0).mean()) < 0.03  # some failed rows
    assert set(trace.models) == {"ChatGPT", "GPT-4"}
    gaps = np.diff(trace.timestamps)
    assert gaps.std() / gaps.mean() > 1.2  # Gamma shape 0.5: burstier than Poisson
    means = subset_means(filter_trace(trace), CONTEXT)
    # The documented calibration (see loadgen.data.burstgpt), within sampling noise.
    assert means["T-general"][1:] == pytest.approx((636, 224), rel=0.05)
    assert means["T-prefill-heavy"][1:] == pytest.approx((2122, 134), rel=0.05)
    assert means["T-decode-heavy"][2] == pytest.approx(1132, rel=0.05)
    assert means["T-burst-replay"][1:] == pytest.approx((682, 222), rel=0.05)


def test_generated_csv_goes_through_the_same_parser(tmp_path: Path) -> None:
    path = tmp_path / "shaped.csv"
    write_trace_csv(BurstGPTShapedGenerator(seed=1).generate(500), path)
    trace = filter_trace(read_trace_csv(path))
    assert 450 < len(trace) <= 500
    assert len(trace_subset(trace, "T-general", CONTEXT)) > 400


def test_offline_download_fails_fast_naming_trace_file(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/{BURSTGPT_FILENAME}"
    started = time.monotonic()
    with pytest.raises(TraceUnavailableError, match="--trace-file") as raised:
        resolve_trace_file(None, tmp_path, url=url, timeout_s=2.0, show_progress=False)
    assert time.monotonic() - started < 5
    assert "--trace burstgpt-synthetic" in str(raised.value)
    assert not list(tmp_path.iterdir())  # no partial file left behind


def test_given_trace_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(TraceUnavailableError, match="does not exist"):
        resolve_trace_file(tmp_path / "nope.csv", tmp_path)


def test_cached_copy_is_used_without_network(tmp_path: Path, trace_csv: Path) -> None:
    assert resolve_trace_file(None, trace_csv.parent, url="http://127.0.0.1:1/x") == trace_csv


@pytest.fixture
def file_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(QuietHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        thread.join()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_download_checks_the_checksum(file_server: tuple[str, Path], tmp_path: Path) -> None:
    base, served = file_server
    write_trace_csv(_trace(), served / BURSTGPT_FILENAME)
    digest = hashlib.sha256((served / BURSTGPT_FILENAME).read_bytes()).hexdigest()
    target = tmp_path / "cache" / BURSTGPT_FILENAME
    path = download_trace(f"{base}/{BURSTGPT_FILENAME}", target, digest, show_progress=False)
    assert path == target and len(read_trace_csv(path)) == len(ROWS)

    other = tmp_path / "other" / BURSTGPT_FILENAME
    with pytest.raises(TraceUnavailableError, match="expected 0000"):
        download_trace(f"{base}/{BURSTGPT_FILENAME}", other, "0" * 64, show_progress=False)
    assert not other.exists() and other.with_suffix(".csv.unverified").exists()


def test_download_without_checksum_warns(
    file_server: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base, served = file_server
    write_trace_csv(_trace(), served / BURSTGPT_FILENAME)
    target = tmp_path / BURSTGPT_FILENAME
    download_trace(f"{base}/{BURSTGPT_FILENAME}", target, None, show_progress=False)
    assert target.exists()
    assert "not verified" in caplog.text


def test_http_error_is_a_clear_error(file_server: tuple[str, Path], tmp_path: Path) -> None:
    base, _ = file_server
    with pytest.raises(TraceUnavailableError, match="--trace-file"):
        download_trace(f"{base}/missing.csv", tmp_path / "x.csv", None, show_progress=False)


def test_release_constants() -> None:
    assert burstgpt.BURSTGPT_URL.endswith("/releases/download/v1.1/BurstGPT_1.csv")
    assert burstgpt.BURSTGPT_SHA256 is None or len(burstgpt.BURSTGPT_SHA256) == 64
