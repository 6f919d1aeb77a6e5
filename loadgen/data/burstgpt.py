"""The BurstGPT trace: find or download the CSV, filter it, cut the study's subsets.

The CSV (release v1.1, ``BurstGPT_1.csv``, first two months, 1.43 M rows) has the
columns ``Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type``;
timestamps are seconds from the start of the collection.

Every subset first keeps the rows that can be replayed: not failed (``Response
tokens`` > 0, the trace's mark of a failure), at least one request token, and
request + response within the served context (``max_model_len``). Then:

=================  ===========================================  =====================
subset             rule                                         study's means (Tab. 2)
=================  ===========================================  =====================
T-general          every replayable row                         638 in / 224 out
T-prefill-heavy    request >= 1400 and response <= 384          2159 / 132
T-decode-heavy     response >= 800                              848 / 1166
T-burst-replay     consecutive rows from ``--trace-start``,     672 / 215
                   their own arrival times; lengths clamped to
                   the context instead of dropped (dropping
                   would change the arrivals)
=================  ===========================================  =====================

The thresholds were chosen so that, on a trace with BurstGPT's shape (see
``BurstGPTShapedGenerator``) and a 4096-token context, the subsets' means land near the
study's Table 2: there T-general is about 635/224, T-prefill-heavy 2120/134,
T-decode-heavy 600/1130 (the generator draws request and response lengths
independently, so it cannot reproduce the longer prompts of the study's decode-heavy
rows) and the replay 680/222.
The real trace could not be read where this was written (no network):
``python -m loadgen trace-stats --trace-file BurstGPT_1.csv`` prints the subsets'
means on it, to confirm or retune ``SUBSET_RULES``.

Without the file, ``--trace burstgpt-synthetic`` draws a trace with BurstGPT's shape
instead (Zipf request lengths, bimodal response lengths, Gamma inter-arrivals, after
the BurstGPT paper); it is labelled synthetic everywhere it appears.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import numpy as np
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

logger = logging.getLogger("loadgen.data.burstgpt")

BURSTGPT_URL = "https://github.com/HPMLL/BurstGPT/releases/download/v1.1/BurstGPT_1.csv"
BURSTGPT_FILENAME = "BurstGPT_1.csv"
# sha256 and size of data/BurstGPT_1.csv as recorded by the git-lfs pointer in
# github.com/HPMLL/BurstGPT (commit 5d93d82); the project's README says that file is
# the release's BurstGPT_1.csv. It could not be checked against the release asset here
# (no network): verify on a machine with internet (`sha256sum BurstGPT_1.csv`). Set it
# to None to skip the check (a warning is logged instead).
BURSTGPT_SHA256: str | None = "4bb3783693d0a435686fbfc885615d2349bd067239079fa4b749f2e679e12122"
BURSTGPT_SIZE_BYTES = 52_283_111
BURSTGPT_COLUMNS = (
    "Timestamp",
    "Model",
    "Request tokens",
    "Response tokens",
    "Total tokens",
    "Log Type",
)
DOWNLOAD_CONNECT_TIMEOUT_S = 10.0
DOWNLOAD_READ_TIMEOUT_S = 60.0
DOWNLOAD_CHUNK_BYTES = 1 << 20
# 1,429.7 k rows over the two months of BurstGPT_1.csv: about 0.27 requests/s.
BURSTGPT_MEAN_RATE = 1_429_700 / (61 * 24 * 3600)
STUDY_MEANS: dict[str, tuple[int, int]] = {
    "T-general": (638, 224),
    "T-prefill-heavy": (2159, 132),
    "T-decode-heavy": (848, 1166),
    "T-burst-replay": (672, 215),
}


def default_cache_dir() -> Path:
    root = os.environ.get("SPLITSERVE_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "splitserve"
    return base / "burstgpt"


class TraceUnavailableError(RuntimeError):
    """The BurstGPT CSV is neither given, cached nor downloadable."""


@dataclass(frozen=True)
class BurstGPTTrace:
    """Rows of a BurstGPT-format trace as columns."""

    timestamps: np.ndarray
    request_tokens: np.ndarray
    response_tokens: np.ndarray
    models: np.ndarray
    log_types: np.ndarray
    source: str
    synthetic: bool = False

    def __len__(self) -> int:
        return len(self.timestamps)

    def select(self, mask: np.ndarray) -> BurstGPTTrace:
        return replace(
            self,
            timestamps=self.timestamps[mask],
            request_tokens=self.request_tokens[mask],
            response_tokens=self.response_tokens[mask],
            models=self.models[mask],
            log_types=self.log_types[mask],
        )

    def mean_lengths(self) -> tuple[float, float]:
        if not len(self):
            return (float("nan"), float("nan"))
        return float(self.request_tokens.mean()), float(self.response_tokens.mean())


# ---- reading and writing the CSV ----------------------------------------------------------


def read_trace_csv(path: Path) -> BurstGPTTrace:
    """Parse a BurstGPT CSV; the header must name the trace's columns."""
    timestamps: list[float] = []
    requests: list[int] = []
    responses: list[int] = []
    models: list[str] = []
    log_types: list[str] = []
    with path.open(newline="") as file:
        reader = csv.reader(file)
        header = [name.strip() for name in next(reader, [])]
        missing = [name for name in BURSTGPT_COLUMNS if name not in header]
        if missing:
            raise ValueError(f"{path} is not a BurstGPT CSV: missing columns {missing}")
        at = {name: header.index(name) for name in BURSTGPT_COLUMNS}
        for row in reader:
            if not row:
                continue
            timestamps.append(float(row[at["Timestamp"]]))
            requests.append(int(float(row[at["Request tokens"]])))
            responses.append(int(float(row[at["Response tokens"]])))
            models.append(row[at["Model"]].strip())
            log_types.append(row[at["Log Type"]].strip())
    return BurstGPTTrace(
        timestamps=np.asarray(timestamps, dtype=float),
        request_tokens=np.asarray(requests, dtype=np.int64),
        response_tokens=np.asarray(responses, dtype=np.int64),
        models=np.asarray(models, dtype=object),
        log_types=np.asarray(log_types, dtype=object),
        source=str(path),
    )


def write_trace_csv(trace: BurstGPTTrace, path: Path) -> None:
    """Write rows in BurstGPT's own format (for offline use and tests)."""
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(BURSTGPT_COLUMNS)
        for index in range(len(trace)):
            request = int(trace.request_tokens[index])
            response = int(trace.response_tokens[index])
            writer.writerow(
                [
                    f"{trace.timestamps[index]:g}",
                    trace.models[index],
                    request,
                    response,
                    request + response,
                    trace.log_types[index],
                ]
            )


# ---- finding or downloading the file -------------------------------------------------------


def resolve_trace_file(
    trace_file: Path | None,
    cache_dir: Path | None = None,
    url: str = BURSTGPT_URL,
    timeout_s: float = DOWNLOAD_CONNECT_TIMEOUT_S,
    show_progress: bool = True,
) -> Path:
    """``--trace-file`` if given, else the cached copy, else a fresh download."""
    if trace_file is not None:
        if not trace_file.is_file():
            raise TraceUnavailableError(f"--trace-file {trace_file} does not exist")
        return trace_file
    cache_dir = cache_dir or default_cache_dir()
    cached = cache_dir / BURSTGPT_FILENAME
    if cached.is_file():
        return cached
    return download_trace(url, cached, BURSTGPT_SHA256, timeout_s, show_progress)


def download_trace(
    url: str,
    destination: Path,
    sha256: str | None,
    timeout_s: float = DOWNLOAD_CONNECT_TIMEOUT_S,
    show_progress: bool = True,
) -> Path:
    """Download with a progress bar, check the checksum, move into place."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_suffix(destination.suffix + ".part")
    digest = hashlib.sha256()
    timeout = httpx.Timeout(DOWNLOAD_READ_TIMEOUT_S, connect=timeout_s)
    try:
        with (
            httpx.stream("GET", url, follow_redirects=True, timeout=timeout) as response,
            partial.open("wb") as sink,
        ):
            response.raise_for_status()
            total = int(response.headers.get("content-length", 0)) or None
            with _download_progress(show_progress) as progress:
                task = progress.add_task(f"BurstGPT {destination.name}", total=total)
                for block in response.iter_bytes(DOWNLOAD_CHUNK_BYTES):
                    sink.write(block)
                    digest.update(block)
                    progress.advance(task, len(block))
    except (httpx.HTTPError, OSError) as error:
        partial.unlink(missing_ok=True)
        raise TraceUnavailableError(_offline_message(url, destination, error)) from error
    _check_digest(digest.hexdigest(), sha256, partial, destination)
    partial.replace(destination)
    return destination


def _download_progress(show: bool) -> Progress:
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        disable=not show,
        transient=True,
    )


def _check_digest(actual: str, expected: str | None, partial: Path, destination: Path) -> None:
    if expected is None:
        logger.warning("no sha256 on record for %s: its content was not verified", destination)
        return
    if actual != expected:
        unverified = destination.with_suffix(destination.suffix + ".unverified")
        partial.replace(unverified)
        raise TraceUnavailableError(
            f"the downloaded trace has sha256 {actual}, expected {expected}; it is kept at"
            f" {unverified}. If you trust it, pass it with --trace-file {unverified}"
        )


def _offline_message(url: str, destination: Path, error: Exception) -> str:
    return (
        f"could not download the BurstGPT trace from {url} ({type(error).__name__}: {error})."
        f" Without network: fetch {BURSTGPT_FILENAME} on another machine and pass it with"
        f" --trace-file PATH (or copy it to {destination}); or run the BurstGPT-shaped"
        " generator with --trace burstgpt-synthetic."
    )


# ---- filters and subsets ---------------------------------------------------------------------


def filter_trace(
    trace: BurstGPTTrace,
    models: list[str] | None = None,
    log_types: list[str] | None = None,
) -> BurstGPTTrace:
    """Keep the chosen models and log types (case-insensitive), drop failed rows."""
    mask = (trace.response_tokens > 0) & (trace.request_tokens > 0)
    if models:
        wanted = {name.lower() for name in models}
        mask &= np.array([str(m).lower() in wanted for m in trace.models], dtype=bool)
    if log_types:
        wanted = {_normal_log_type(name) for name in log_types}
        mask &= np.array([_normal_log_type(str(t)) in wanted for t in trace.log_types], dtype=bool)
    return trace.select(mask)


def _normal_log_type(name: str) -> str:
    """'Conversation log', 'conversation' and 'API log' / 'api' name the same types."""
    return name.lower().removesuffix(" log").strip()


@dataclass(frozen=True)
class SubsetRule:
    """Which rows a trace subset keeps, beyond being replayable within the context."""

    name: str
    min_request: int = 1
    min_response: int = 1
    max_response: int | None = None
    summary: str = ""

    def mask(self, trace: BurstGPTTrace, max_model_len: int) -> np.ndarray:
        requests, responses = trace.request_tokens, trace.response_tokens
        mask = (requests >= self.min_request) & (responses >= self.min_response)
        mask &= requests + responses <= max_model_len
        if self.max_response is not None:
            mask &= responses <= self.max_response
        return mask


SUBSET_RULES: dict[str, SubsetRule] = {
    "T-general": SubsetRule("T-general", summary="every row that fits the context"),
    "T-prefill-heavy": SubsetRule(
        "T-prefill-heavy",
        min_request=1400,
        max_response=384,
        summary="request >= 1400 and response <= 384",
    ),
    "T-decode-heavy": SubsetRule("T-decode-heavy", min_response=800, summary="response >= 800"),
}
REPLAY_SUBSET = "T-burst-replay"
TRACE_SUBSETS = (*SUBSET_RULES, REPLAY_SUBSET)
MIN_REPLAY_OUTPUT = 1


def trace_subset(trace: BurstGPTTrace, name: str, max_model_len: int) -> BurstGPTTrace:
    """The rows of a length subset (T-general, T-prefill-heavy, T-decode-heavy)."""
    if name not in SUBSET_RULES:
        raise ValueError(f"unknown trace subset {name!r}; choose from {list(SUBSET_RULES)}")
    return trace.select(SUBSET_RULES[name].mask(trace, max_model_len))


def replay_window(
    trace: BurstGPTTrace, start: int, count: int, max_model_len: int
) -> BurstGPTTrace:
    """``count`` consecutive rows from ``start``, lengths clamped into the context."""
    if start < 0 or start + count > len(trace):
        raise ValueError(
            f"--trace-start {start} + {count} requests is beyond the trace's {len(trace)} rows"
        )
    window = trace.select(np.arange(start, start + count))
    requests = np.minimum(window.request_tokens, max_model_len - MIN_REPLAY_OUTPUT)
    responses = np.clip(window.response_tokens, MIN_REPLAY_OUTPUT, max_model_len - requests)
    return replace(window, request_tokens=requests, response_tokens=responses)


def subset_means(trace: BurstGPTTrace, max_model_len: int) -> dict[str, tuple[int, float, float]]:
    """Rows and mean request/response tokens of every subset (``trace-stats``)."""
    means = {}
    for name in SUBSET_RULES:
        subset = trace_subset(trace, name, max_model_len)
        means[name] = (len(subset), *subset.mean_lengths())
    replay = replay_window(trace, 0, len(trace), max_model_len)
    means[REPLAY_SUBSET] = (len(replay), *replay.mean_lengths())
    return means


# ---- a trace with BurstGPT's shape, for offline use ---------------------------------------


@dataclass(frozen=True)
class BurstGPTShapedGenerator:
    """Draws BurstGPT-format rows with the shapes the BurstGPT paper reports.

    Request tokens: Zipf(-Mandelbrot) over 1..``max_request``, p(k) ~ (k + offset)^-s,
    the heavy tail the paper fits. Response tokens: bimodal, a mixture of a short mode
    and a long mode (log-normal each). Inter-arrivals: Gamma with shape < 1 (bursty),
    at the trace's mean rate. A few rows are failures (0 response tokens), as in the
    real file. Parameters are ours, tuned so the means land near the study's Table 2;
    the rows are synthetic and every result built on them says so.
    """

    seed: int = 0
    zipf_exponent: float = 6.0
    zipf_offset: float = 2800.0
    max_request: int = 32_000
    short_share: float = 0.3
    short_median: float = 24.0
    short_sigma: float = 0.8
    long_median: float = 232.0
    long_sigma: float = 0.75
    max_response: int = 12_500
    gamma_shape: float = 0.5
    mean_rate: float = BURSTGPT_MEAN_RATE
    failure_share: float = 0.02
    gpt4_share: float = 0.2
    api_share: float = 0.15

    def generate(self, rows: int) -> BurstGPTTrace:
        rng = np.random.default_rng(self.seed)
        requests = self._zipf_lengths(rng, rows)
        responses = self._bimodal_lengths(rng, rows)
        responses[rng.random(rows) < self.failure_share] = 0
        gaps = rng.gamma(self.gamma_shape, 1.0 / (self.mean_rate * self.gamma_shape), rows)
        return BurstGPTTrace(
            timestamps=np.round(np.cumsum(gaps)),
            request_tokens=requests,
            response_tokens=responses,
            models=np.where(rng.random(rows) < self.gpt4_share, "GPT-4", "ChatGPT").astype(object),
            log_types=np.where(
                rng.random(rows) < self.api_share, "API log", "Conversation log"
            ).astype(object),
            source=f"burstgpt-synthetic (seed {self.seed})",
            synthetic=True,
        )

    def _zipf_lengths(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        ranks = np.arange(1, self.max_request + 1, dtype=float)
        weights = (ranks + self.zipf_offset) ** -self.zipf_exponent
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        return np.searchsorted(cdf, rng.random(rows)).astype(np.int64) + 1

    def _bimodal_lengths(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        short = rng.random(rows) < self.short_share
        medians = np.where(short, self.short_median, self.long_median)
        sigmas = np.where(short, self.short_sigma, self.long_sigma)
        lengths = np.round(medians * np.exp(sigmas * rng.standard_normal(rows)))
        return np.clip(lengths, 1, self.max_response).astype(np.int64)
