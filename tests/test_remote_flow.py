"""How many GETs the remote backend keeps in flight (``tokload.remote.fetch._Limit``), driven by
a simulated store: no server, no client, simulated time.

The store answers ``n`` GETs in flight at ``min(n / latency, capacity(n))`` per second,
where ``capacity(n)`` is what the client's CPU allows, and falls as connections grow (as
measured with obstore: ``bench/bench_remote.py``); past the knee, ``n = latency *
capacity``, each GET waits ``n / capacity`` instead of ``latency``.  The limit should
settle near the knee: enough to cover the latency, not so many that CPU is wasted.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokload.remote.fetch import MAX_IN_FLIGHT, MIN_IN_FLIGHT, _Limit

CPU_PER_GET = 110e-6  # seconds of client CPU per GET with few connections


def _capacity(n: int) -> float:
    return 1.0 / (CPU_PER_GET * (1 + n / 2000))


def _answer(
    ctl: _Limit, t: float, latency: float, demand: int | None = None
) -> tuple[float, float]:
    """The store answers the next GET after time ``t``: the time it does, and its rate."""
    n = ctl.limit if demand is None else min(ctl.limit, demand)
    rate = min(n / latency, _capacity(n))
    t += 1.0 / rate
    ctl.answered(t, n / rate, demand is None or demand >= ctl.limit)
    return t, rate


def _simulate(latency: float, seconds: float, demand: int | None = None) -> tuple[_Limit, float]:
    """Run the store for ``seconds``; returns the controller and the rate at the end."""
    ctl = _Limit(0.0)
    t = rate = 0.0
    while t < seconds:
        t, rate = _answer(ctl, t, latency, demand)
    return ctl, rate


def _knee(latency: float) -> int:
    n = 1
    while n / latency < _capacity(n):
        n += 1
    return n


def test_the_limit_settles_near_what_covers_the_latency() -> None:
    for latency in (0.0005, 0.02, 0.1):
        ctl, rate = _simulate(latency, 30.0)
        knee = max(MIN_IN_FLIGHT, _knee(latency))
        best = max(min(n / latency, _capacity(n)) for n in range(1, 4 * knee))
        assert rate >= 0.85 * best, (latency, ctl.limit, knee, rate, best)
        assert ctl.limit <= 3 * knee, (latency, ctl.limit, knee)


def test_the_limit_ramps_up_within_seconds_at_100_ms() -> None:
    ctl, _ = _simulate(0.1, 4.0)
    assert ctl.limit >= 0.8 * _knee(0.1), ctl.limit


def test_the_start_doubles_while_the_rate_grows() -> None:
    """Slow start: from the first limit (64) to what covers 100 ms (about 680 here)
    within a second, where rising by half every four round trips took 2.4 s; it
    ends when doubling no longer raises the rate, without running away."""
    ctl, _ = _simulate(0.1, 1.0)
    assert ctl.limit >= 0.8 * _knee(0.1), ctl.limit
    ctl, _ = _simulate(0.1, 2.0)
    assert not ctl.starting
    assert ctl.limit <= 2 * _knee(0.1), ctl.limit
    # the client's CPU is the bound at once: no doubling pays, and a drain follows
    # (the least latency seen at the first limit was spent partly in a queue)
    ctl = _Limit(0.0)
    t = 0.0
    while ctl.starting:
        t, _ = _answer(ctl, t, 0.0005)
    assert t < 0.5
    assert ctl.drained == 64 and ctl.limit == 32


def _period(ctl: _Limit, t: float, seconds: float, rate: float, latency: float) -> float:
    """Completions at ``rate`` per second for ``seconds``, each after ``latency``."""
    for _ in range(int(seconds * rate)):
        t += 1.0 / rate
        ctl.answered(t, latency, True)
    return t


def test_a_period_slowed_by_its_own_launches_does_not_end_the_start() -> None:
    """The GETs a doubling launches at once queue on the client's CPU: their period's
    latency is a third longer than the least, yet its rate doubled, so the start goes
    on (a start ended by that latency stopped at half of what 100 ms needs)."""
    ctl = _Limit(0.0)
    t = _period(ctl, 0.0, 0.25, 640, 0.1)  # the first limit, 64 over 100 ms
    assert ctl.limit == 128 and ctl.starting
    t = _period(ctl, t, 0.25, 1280, 0.13)
    assert ctl.limit == 256 and ctl.starting


def test_a_start_whose_doublings_stop_paying_keeps_what_paid() -> None:
    ctl = _Limit(0.0)
    t = _period(ctl, 0.0, 0.25, 640, 0.1)
    t = _period(ctl, t, 0.25, 1280, 0.1)
    assert ctl.limit == 256
    for _ in range(2):  # twice no faster: the pipe is full at 128
        t = _period(ctl, t, 0.25, 1300, 0.2)
    assert not ctl.starting
    assert ctl.limit == 130  # what 1,300 GETs/s need at 100 ms, at least the 128 that paid
    assert ctl.drained is None


def test_a_collapse_is_cut_within_two_periods() -> None:
    """The client collapses while more than 200 GETs are in flight (their completions
    wait for the GIL, each on a thread of its own: the rate falls tenfold).  The limit
    comes under 200 within two periods (of 0.4 s at 100 ms), where falling by FALL a
    period took seconds.  (It starts between two drains: the drain that measures the
    least latency every WINDOW seconds has just ended.)"""
    ctl, _ = _simulate(0.1, 11.0)
    assert ctl.limit > 400 and ctl.drained is None and ctl.least_t > 10.0
    t = 11.0
    while t < 12.0:
        n = ctl.limit
        rate = _capacity(n) / 10 if n > 200 else min(n / 0.1, _capacity(n))
        t += 1.0 / rate
        ctl.answered(t, n / rate, True)
    assert ctl.limit <= 200, ctl.limit


def test_a_demand_below_the_limit_decides_nothing() -> None:
    """Readers that keep fewer GETs in flight than allowed: the rate says nothing of
    the limit, which stays where it was."""
    ctl, _ = _simulate(0.02, 10.0, demand=20)
    assert ctl.limit == 64


def test_an_idle_spell_decides_nothing() -> None:
    ctl = _Limit(0.0)
    for k in range(100):
        ctl.answered(k * 0.001, 0.001, True)
    before = ctl.limit
    ctl.answered(60.0, 0.001, True)  # the first answer after a minute of nothing
    assert ctl.limit == before


def test_a_pause_then_a_few_answers_decide_nothing() -> None:
    """Nothing answered for 0.43 s (this process or the store paused), then one GET,
    which waited through the pause: its period says nothing of the limit (it read as
    a collapse to 2 GETs/s and cut the limit to the least, 16)."""
    ctl, _ = _simulate(0.1, 5.0)
    t = ctl.last
    while ctl.t0 != t:  # on to the end of a period
        t, _ = _answer(ctl, t, 0.1)
    before = ctl.limit
    ctl.answered(t + 0.43, 0.53, True)
    assert ctl.t0 == t + 0.43, "the period ended"
    assert ctl.limit == before


def test_after_an_idle_spell_it_starts_again() -> None:
    """What a store 20 ms away taught does not hold for the next loader, on a store
    100 ms away: after a second with nothing in flight, the start begins afresh
    (without it, a least latency of 20 ms made 100 ms look like a queue)."""
    ctl, _ = _simulate(0.02, 5.0)
    assert not ctl.starting and ctl.least < 0.021
    ctl.resumed(ctl.last + 0.5)  # a pause shorter than IDLE changes nothing
    assert not ctl.starting
    ctl.resumed(ctl.last + _Limit.IDLE)
    assert ctl.starting and ctl.limit == 64 and ctl.least == float("inf")
    t = ctl.last
    end = t + 1.5
    while t < end:
        t, _ = _answer(ctl, t, 0.1)
    assert ctl.limit >= 0.8 * _knee(0.1), ctl.limit


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=1e-5, max_value=2.0),
            st.floats(min_value=1e-5, max_value=5.0),
            st.booleans(),
        ),
        max_size=400,
    )
)
def test_the_limit_stays_within_its_bounds(events: list[tuple[float, float, bool]]) -> None:
    ctl = _Limit(0.0)
    t = 0.0
    for dt, latency, bound in events:
        t += dt
        ctl.answered(t, latency, bound)
        assert MIN_IN_FLIGHT <= ctl.limit <= MAX_IN_FLIGHT


def test_a_store_that_becomes_slower_is_seen_by_a_drain() -> None:
    """The least latency seen is checked by draining: a store whose latency goes from
    20 to 100 ms gets the limit that covers 100 ms within seconds, not a limit still
    lowered because every GET seems to wait four fifths of its time."""
    ctl = _Limit(0.0)
    t = 0.0
    for latency, until in ((0.02, 20.0), (0.1, 35.0)):
        while t < until:
            t, _ = _answer(ctl, t, latency)
    assert ctl.least >= 0.099
    assert ctl.limit >= 0.8 * _knee(0.1), (ctl.limit, _knee(0.1))
