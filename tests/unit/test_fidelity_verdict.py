"""The held-out fidelity benchmark's verdict: which misses fail ``.ci/run``."""

from __future__ import annotations

from benchmarks.fidelity import ALLOWED_MISSES, ALLOWED_WIDE, verdict


def _row(shape: str, dest: str, figure: str, inside: bool, width_ok: bool = True) -> dict:
    return {"shape": shape, "destination": dest, "figure": figure, "real": [1, 2, 3],
            "range": [1, 3], "inside": inside, "width_ok": width_ok}


def test_an_allowed_miss_is_reported_with_its_reason_and_does_not_fail():
    rows = [_row("field", "rate.example", "deferred", False),
            _row("field", "near.example", "p50", True)]
    failing, allowed = verdict(["field rate.example deferred"], rows, strict=False)
    assert failing == []
    assert allowed == ["field rate.example deferred: "
                       + ALLOWED_MISSES[("field", "rate.example", "deferred")]]


def test_any_other_miss_fails_and_strict_fails_them_all():
    rows = [_row("field", "rate.example", "p50", True, width_ok=False),
            _row("field", "near.example", "p95", False),
            _row("filtered", "rate.example", "deferred", False)]
    misses = ["field rate.example p50", "field near.example p95",
              "filtered rate.example deferred"]
    failing, allowed = verdict(misses, rows, strict=False)
    assert failing == ["field near.example p95", "filtered rate.example deferred"]
    assert len(allowed) == 1
    assert verdict(misses, rows, strict=True) == (misses, [])


def test_only_the_chaotic_shapes_figures_are_allowed():
    """What a site held dead decides (issue #20): the rate limiter's deferrals and
    delays, the down host's deferral count, and the two 421 limiters' deferral counts,
    where the replay leans one refusal low for a cause not found; never a delay of a
    destination not held dead, a bounce or another shape."""
    assert set(ALLOWED_MISSES) == {
        ("field", "rate.example", "deferred"), ("field", "rate.example", "p50"),
        ("field", "rate.example", "p95"), ("field", "down.example", "deferred"),
        ("field", "below.example", "deferred"), ("field", "near.example", "deferred")}


def test_a_range_allowed_wide_still_fails_a_held_out_run_outside_it():
    """ALLOWED_WIDE excuses the width test alone: the down host's delays may range over
    both of their values, but a held-out run outside that range is a miss."""
    wide = _row("field", "down.example", "p50", True, width_ok=False)
    failing, allowed = verdict(["field down.example p50"], [wide], strict=False)
    assert failing == []
    assert allowed == ["field down.example p50 (its width only): "
                       + ALLOWED_WIDE[("field", "down.example", "p50")]]
    outside = _row("field", "down.example", "p95", False, width_ok=False)
    failing, allowed = verdict(["field down.example p95"], [outside], strict=False)
    assert failing == ["field down.example p95"] and allowed == []
    assert verdict(["field down.example p50"], [wide], strict=True) == (
        ["field down.example p50"], [])


def test_only_the_down_hosts_delays_may_range_wide():
    assert set(ALLOWED_WIDE) == {("field", "down.example", "p50"),
                                 ("field", "down.example", "p95")}
