"""The state machine as data: its shape, and the helpers every write uses."""

import itertools

import pytest

from orchestrator.domain import states
from orchestrator.domain.states import CLAIMABLE, TERMINAL, TRANSITIONS, Status


def test_every_status_is_declared() -> None:
    assert set(TRANSITIONS) == set(Status)


def test_terminal_states_are_exactly_the_finished_ones() -> None:
    assert {Status.COMPLETED, Status.FAILED, Status.CANCELLED} == TERMINAL


def test_claimable_states_are_pending_and_retry() -> None:
    assert {Status.PENDING, Status.RETRY} == CLAIMABLE


@pytest.mark.parametrize(("source", "target"), list(itertools.product(Status, Status)))
def test_is_legal_matches_the_table(source: Status, target: Status) -> None:
    assert states.is_legal(source, target) == (target in TRANSITIONS[source])


@pytest.mark.parametrize("target", list(Status))
def test_sources_of_inverts_the_table(target: Status) -> None:
    assert states.sources_of(target) == sorted(
        s.value for s in Status if states.is_legal(s, target)
    )


def test_no_self_transitions_and_terminal_states_are_absorbing() -> None:
    for source, targets in TRANSITIONS.items():
        assert source not in targets
    for source in TERMINAL:
        assert not TRANSITIONS[source]


def test_every_state_is_reachable_from_a_submit() -> None:
    seen, frontier = set(states.INITIAL), list(states.INITIAL)
    while frontier:
        for target in TRANSITIONS[frontier.pop()]:
            if target not in seen:
                seen.add(target)
                frontier.append(target)
    assert seen == set(Status)


def test_transition_rows_list_each_legal_pair_once() -> None:
    rows = states.transition_rows()
    assert len(rows) == len(set(rows)) == sum(len(t) for t in TRANSITIONS.values())
