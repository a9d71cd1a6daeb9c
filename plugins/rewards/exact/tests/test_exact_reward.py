"""Exact-match reward."""

from __future__ import annotations

from molt_reward_exact import exact_match


def test_exact_match_normalisation():
    assert exact_match("  Paris \n", "Paris") == (1.0, {"reason": "match"})
    assert exact_match("New   York", "New York")[0] == 1.0
    assert exact_match("paris", "Paris")[0] == 0.0
    assert exact_match("paris", "Paris", case_sensitive=False)[0] == 1.0
    assert exact_match(" Paris", "Paris", strip=False) == (0.0, {"reason": "mismatch"})
