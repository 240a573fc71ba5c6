"""control_plane.model.operator_state: the overrides and splits an operator sets, checked before any
of a change is applied, with messages that name the field."""

from __future__ import annotations

import pytest

from control_plane.model.mesh import EndpointAddress, EndpointHealth
from control_plane.model.operator_state import InvalidChange, OperatorState

A = EndpointAddress("127.0.0.1", 8001)


def test_overrides_are_set_and_cleared() -> None:
    state = OperatorState()
    state.override(A, {"weight": 7, "health": "DRAINING"})
    assert state.weights == {A: 7} and state.health == {A: EndpointHealth.DRAINING}
    state.override(A, {"weight": None})
    assert state.weights == {} and state.health == {A: EndpointHealth.DRAINING}
    state.override(A, {"health": None})
    assert state.health == {}


@pytest.mark.parametrize(
    "body,message",
    [
        ({"weight": 0}, "weight must be an integer in 1..1000000 or null, got 0"),
        ({"weight": True}, "weight must be an integer in 1..1000000 or null, got True"),
        ({"weight": 1 << 32}, "weight must be an integer in 1..1000000 or null, got 4294967296"),
        ({"weight": 3, "health": "SICK"}, "health must be one of"),
        ({"weigth": 3}, "unknown fields ['weigth']; expected weight and/or health"),
    ],
)
def test_a_bad_override_changes_nothing(body: dict[str, object], message: str) -> None:
    state = OperatorState()
    state.override(A, {"weight": 2})
    with pytest.raises(InvalidChange) as raised:
        state.override(A, body)
    assert message in str(raised.value)
    assert state.weights == {A: 2} and state.health == {}  # the valid weight was not applied


def test_splits_are_checked_ordered_and_cleared() -> None:
    state = OperatorState()
    split = OperatorState.parse_split({"10": 1, "2": 3})
    assert split == (("2", 3), ("10", 1))  # by version number, not text
    state.set_split("classifier", split)
    assert state.splits == {"classifier": split}
    state.set_split("classifier", OperatorState.parse_split({}))
    assert state.splits == {}
    with pytest.raises(InvalidChange, match="version 'x' is not a number"):
        OperatorState.parse_split({"x": 1})
    with pytest.raises(InvalidChange, match="must not all be 0"):
        OperatorState.parse_split({"1": 0, "2": 0})
    with pytest.raises(InvalidChange, match=r"version '1': weight must be an integer >= 0"):
        OperatorState.parse_split({"1": -1})
    with pytest.raises(InvalidChange, match="must sum to at most 4294967295"):
        OperatorState.parse_split({"1": 1 << 31, "2": 1 << 31})  # each fits, the sum does not
