"""A request's priority, as clients name it: the router's QoS and the load generator's
workloads and offline exchange share the one set."""

from __future__ import annotations

from typing import Literal

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")
