"""The live progress display of a run: sent, done, errors, rejections, TTFT p50."""

from __future__ import annotations

from collections import deque
from types import TracebackType

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

LIVE_WINDOW = 200  # recent completions behind the live TTFT median
REFRESH_PER_SECOND = 4


class RunProgress:
    """Counts a run's requests; renders them with rich unless disabled."""

    def __init__(self, title: str, total: int, console: Console, enabled: bool = True) -> None:
        self.sent = 0
        self.done = 0
        self.errors = 0
        self.rejected = 0
        self._recent_ttfts: deque[float] = deque(maxlen=LIVE_WINDOW)
        self._total = total
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} done"),
            TextColumn("sent {task.fields[sent]}"),
            TextColumn("[red]err {task.fields[errors]}"),
            TextColumn("[yellow]rej {task.fields[rejected]}"),
            TextColumn("TTFT p50 {task.fields[ttft]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
            transient=False,
            refresh_per_second=REFRESH_PER_SECOND,
        )
        self._task = self._progress.add_task(
            title, total=total, sent=0, errors=0, rejected=0, ttft="-"
        )

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._refresh()
        self._progress.stop()

    @property
    def in_flight(self) -> int:
        return self.sent - self.done

    def request_sent(self) -> None:
        self.sent += 1
        self._progress.update(self._task, sent=self.sent)

    def request_done(self, outcome: str, ttft_s: float | None) -> None:
        self.done += 1
        if outcome == "error":
            self.errors += 1
        elif outcome == "rejected":
            self.rejected += 1
        if ttft_s is not None:
            self._recent_ttfts.append(ttft_s)
        # Counters only: the TTFT median is computed at render time, four times a second.
        self._progress.update(
            self._task, completed=self.done, errors=self.errors, rejected=self.rejected
        )

    def live_ttft_p50(self) -> float | None:
        return float(np.median(self._recent_ttfts)) if self._recent_ttfts else None

    def refresh(self) -> None:
        self._refresh()

    def _refresh(self) -> None:
        p50 = self.live_ttft_p50()
        self._progress.update(self._task, ttft="-" if p50 is None else f"{p50 * 1000:.1f} ms")
