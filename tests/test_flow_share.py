"""The fairness policy inside a flow key (orchestrator.domain.flow_share), held by simulation: for
random mixes of tenants, weights, caps, declared costs and real spends, no tenant ever holds
more than its cap, and tenants that wait throughout converge to their weights, within a bound
that does not grow with time:

    |spent_a / w_a - spent_b / w_b| <= (slots + 1) * U * (1 / w_a + 1 / w_b)

where ``spent`` is what a tenant's calls really spent (at least 1 each), ``slots`` the calls in
flight at once and ``U`` the most one call may spend or reserve (1 per call without units). Why:
when ``a`` is picked its virtual time is at most ``b``'s; after that ``a`` gains at most its last
estimate and the corrections of its calls in flight (each at most ``U / w_a``), and ``b`` loses at
most the corrections of its own (each at most ``U / w_b``). The bound is checked for every pair
whose second tenant its cap never held back (a capped tenant may get less than its weight:
that is the cap)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.domain.flow_share import cap, charge, estimate, joining_vtime, next_share


@dataclass
class Call:
    share: str
    estimate: int
    spent: int


@dataclass
class Key:
    """A key whose tenants all wait throughout: ``slots`` calls at once, ``units`` per call at
    most (None: no units), each tenant holding at most its cap of both."""

    slots: int
    units: int | None
    tenant_share: float | None
    weights: dict[str, float]
    vtime: dict[str, float] = field(default_factory=dict)
    spent: dict[str, float] = field(default_factory=dict)
    flying: list[Call] = field(default_factory=list)
    held_back_ever: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        for share in self.weights:
            self.vtime[share] = joining_vtime(self.vtime, list(self.vtime), 0.0)
            self.spent[share] = 0.0

    def held(self, share: str) -> tuple[int, int]:
        mine = [c for c in self.flying if c.share == share]
        return len(mine), sum(c.estimate for c in mine)

    def capped(self, share: str, cost: int) -> bool:
        calls, units = self.held(share)
        most_units = cap(self.units, self.tenant_share)
        return calls >= (cap(self.slots, self.tenant_share) or self.slots) or (
            most_units is not None and calls > 0 and units + cost > most_units
        )

    def start(self, declared: int, spent: int) -> None:
        if len(self.flying) >= self.slots:
            return
        cost = estimate(declared, self.units, self.tenant_share)
        back = {s for s in self.weights if self.capped(s, cost)}
        self.held_back_ever |= back
        share = next_share(self.vtime, self.weights, back)
        if share is None:
            return
        self.vtime[share] += charge(cost, self.units) / self.weights[share]
        self.flying.append(Call(share, cost, spent))

    def finish(self, index: int) -> None:
        if not self.flying:
            return
        call = self.flying.pop(index % len(self.flying))
        real = charge(call.spent, self.units)
        self.vtime[call.share] += (real - charge(call.estimate, self.units)) / self.weights[
            call.share
        ]
        self.spent[call.share] += real

    def check_caps(self) -> None:
        for share in self.weights:
            calls, units = self.held(share)
            assert calls <= (cap(self.slots, self.tenant_share) or self.slots)
            most_units = cap(self.units, self.tenant_share)
            assert most_units is None or units <= most_units


shares = st.dictionaries(
    st.sampled_from(["acme", "globex", "initech", "umbrella"]),
    st.floats(min_value=0.25, max_value=4),
    min_size=2,
    max_size=4,
)
events = st.lists(
    st.one_of(
        st.tuples(
            st.just("start"),
            st.integers(min_value=0, max_value=10**9) | st.integers(min_value=0, max_value=300),
            st.integers(min_value=0, max_value=300),
        ),
        st.tuples(st.just("finish"), st.integers(min_value=0, max_value=100), st.just(0)),
    ),
    min_size=1,
    max_size=400,
)


@settings(max_examples=300, deadline=None)
@given(
    weights=shares,
    slots=st.integers(min_value=1, max_value=6),
    units=st.none() | st.integers(min_value=1, max_value=300),
    tenant_share=st.none() | st.floats(min_value=0.1, max_value=1),
    script=events,
)
def test_no_tenant_exceeds_its_cap_and_waiting_tenants_converge_to_their_weights(
    weights: dict[str, float],
    slots: int,
    units: int | None,
    tenant_share: float | None,
    script: list[tuple[str, int, int]],
) -> None:
    key = Key(slots, units, tenant_share, weights)
    for kind, first, second in script:
        if kind == "start":
            key.start(first, min(second, units or 0))  # a call spends at most U here
        else:
            key.finish(first)
        key.check_caps()
    while key.flying:
        key.finish(0)
    most = units or 1
    for a, w_a in weights.items():
        for b, w_b in weights.items():
            if b in key.held_back_ever:
                continue
            bound = (slots + 1) * most * (1 / w_a + 1 / w_b)
            assert key.spent[a] / w_a - key.spent[b] / w_b <= bound + 1e-9


def test_a_declared_cost_is_an_estimate_between_1_and_what_one_share_may_hold() -> None:
    assert estimate(0, 100, None) == 1
    assert estimate(10**9, 100, None) == 100
    assert estimate(10**9, 100, 0.5) == 50
    assert estimate(7, 100, 0.5) == 7
    assert estimate(None, None, None) == 1
    assert charge(0, 100) == 1 and charge(40, 100) == 40 and charge(40, None) == 1
    assert cap(4, 0.5) == 2 and cap(1, 0.1) == 1 and cap(4, None) == 4 and cap(None, 0.5) is None
