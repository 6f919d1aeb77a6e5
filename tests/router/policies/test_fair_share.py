"""Fair shares between API keys: turns within a priority, and admission by share."""

from __future__ import annotations

import itertools

from engines.protocol import TURN_LIMIT, GenerateRequest
from router.policies.fair_share import FairShares, Flow, Turn
from router.policies.qos import AdmissionControl
from router.settings import QoSConfig

HEAVY = Flow("heavy", weight=3)
LIGHT = Flow("light")


def _served_in_turn(turns: list[tuple[str, Turn]], count: int) -> list[str]:
    """The flows of the first ``count`` requests an engine would start: by turn, then
    by arrival (the list's order), as vLLM's priority scheduling orders them."""
    ranked = sorted(enumerate(turns), key=lambda item: (item[1][1].number, item[0]))
    return [name for _, (name, _) in ranked[:count]]


def test_backlogged_keys_are_started_in_proportion_to_their_weights() -> None:
    shares = FairShares()
    # The heavy key's backlog arrives first, the light key's after: arrival alone would
    # start every heavy request before any light one.
    turns = [(flow.name, shares.join(flow, "normal")) for flow in [HEAVY] * 12 + [LIGHT] * 12]
    first = _served_in_turn(turns, 16)
    assert (first.count("heavy"), first.count("light")) == (12, 4)
    assert _served_in_turn(turns, 8).count("heavy") == 6


def test_a_key_that_was_idle_starts_next_not_behind_another_keys_backlog() -> None:
    shares = FairShares()
    flood = [shares.join(LIGHT, "normal") for _ in range(20)]
    for turn in flood[:5]:
        turn.started()  # the engines got through five of them
    late = shares.join(Flow("late"), "normal")
    queued = sorted(turn.number for turn in flood[5:])
    assert queued[0] <= late.number < queued[1]  # after the one in line, before the rest


def test_an_engine_that_starts_a_keys_later_turns_first_leaves_other_keys_in_place() -> None:
    # Two engines each start their own queue: one reaches the flood's last turns while
    # the other still holds its first. A key arriving now goes in line with those.
    shares = FairShares()
    flood = [shares.join(LIGHT, "normal") for _ in range(10)]
    for turn in flood[7:]:
        turn.started()
    late = shares.join(Flow("late"), "normal")
    assert late.number <= min(turn.number for turn in flood[:7])
    for turn in flood[:7]:
        turn.started()
    after = shares.join(Flow("after"), "normal")  # nothing waits but "late"
    assert after.number == late.number


def test_a_key_alone_takes_every_turn_in_arrival_order() -> None:
    shares = FairShares()
    numbers = [shares.join(HEAVY, "high").number for _ in range(50)]
    assert numbers == sorted(numbers) and len(set(numbers)) == 50
    standing = shares.standing(HEAVY, "high")
    assert (standing.share, standing.waiting, standing.under_share()) == (1.0, 50, False)


def test_a_keys_share_is_its_weight_over_the_waiting_keys_weights() -> None:
    shares = FairShares()
    flooding = [shares.join(LIGHT, "low") for _ in range(8)]
    heavy = shares.standing(HEAVY, "low")  # arriving: counted among the waiting keys
    assert heavy.share == 0.75 and heavy.under_share() and heavy.under_share(cap=8)
    assert not heavy.under_share(cap=0)
    light = shares.standing(LIGHT, "low")
    assert (light.share, light.under_share()) == (1.0, False)
    held = [shares.join(HEAVY, "low") for _ in range(6)]
    heavy = shares.standing(HEAVY, "low")
    assert heavy.under_share()  # 6 of the 14 waiting: under 0.75 of them
    assert not heavy.under_share(cap=8)  # but its 0.75 of a full queue of 8 is 6
    assert shares.standing(LIGHT, "low").share == 0.25
    held += [shares.join(HEAVY, "low") for _ in range(18)]
    assert not shares.standing(HEAVY, "low").under_share()  # 24 of 32: its 0.75
    # Other priorities keep shares of their own.
    assert shares.standing(HEAVY, "normal").share == 1.0
    for turn in flooding + held:
        turn.release()
        turn.release()  # once only
    assert shares.waiting(LIGHT, "low") == shares.waiting(HEAVY, "low") == 0
    assert shares.standing(LIGHT, "low").share == 1.0  # no weight left behind


def test_engines_order_a_requests_priority_before_its_turn() -> None:
    def request(priority: int, turn: int) -> GenerateRequest:
        return GenerateRequest("r", "s", [1], None, priority=priority, turn=turn)

    ranked = sorted(
        itertools.product((0, 1, 2), (0, 5, TURN_LIMIT, TURN_LIMIT + 7)),
        key=lambda pair: request(*pair).scheduling_priority(),
    )
    assert [priority for priority, _ in ranked] == [0] * 4 + [1] * 4 + [2] * 4
    assert request(2, TURN_LIMIT + 7).scheduling_priority() < 2**63  # vLLM's int64
    assert request(1, 9).scheduling_priority() < request(1, 10).scheduling_priority()


def _admission(**qos: object) -> AdmissionControl:
    return AdmissionControl(QoSConfig.model_validate({"enabled": True, **qos}))


def test_past_a_full_queue_a_key_under_its_share_is_admitted_and_one_over_refused() -> None:
    admission = _admission(queue_caps={"high": 8, "normal": 8, "low": 8})
    shares = FairShares()
    for _ in range(8):
        shares.join(LIGHT, "normal")
    full = lambda: 8  # noqa: E731 - the router-wide queue, at normal's cap
    none = lambda: None  # noqa: E731
    over = admission.check("normal", full, none, shares.standing(LIGHT, "normal"))
    assert over is not None and over.reason == "queue_full"
    other = Flow("other")
    assert admission.check("normal", full, none, shares.standing(other, "normal")) is None
    for _ in range(4):  # half of the cap is its share of a full queue
        shares.join(other, "normal")
    refused = admission.check("normal", full, none, shares.standing(other, "normal"))
    assert refused is not None and refused.reason == "queue_full"
    assert admission.check("normal", full, none) is not None  # no shares kept: the cap


def test_a_key_under_its_share_is_not_refused_by_the_queues_ttft_estimate() -> None:
    admission = _admission(early_rejection_s={"low": 0.5})
    shares = FairShares()
    for _ in range(3):
        shares.join(LIGHT, "low")
    empty, slow = (lambda: 0), (lambda: 4.0)
    over = admission.check("low", empty, slow, shares.standing(LIGHT, "low"))
    assert over is not None and over.reason == "ttft_slo"
    assert admission.check("low", empty, slow, shares.standing(HEAVY, "low")) is None
