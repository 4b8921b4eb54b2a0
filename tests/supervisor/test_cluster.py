"""The cluster's timing: beats at a steady rate, lapsed leases swept between them."""

from __future__ import annotations

from modelpool.supervisor.cluster import BEAT_S, RESCUE_S, next_round


def test_lapsed_leases_are_swept_between_beats_which_keep_a_steady_rate() -> None:
    now, next_beat, rounds = 100.0, 100.0, []
    while now < 103.0:
        beat, next_beat, wake_at = next_round(now, next_beat)
        rounds.append((round(now, 2), beat))
        now = wake_at + (0.3 if beat else 0.0)  # each beat took 0.3 s: no drift
    assert rounds == [(100.0, True), (100.8, False), (101.0, True), (101.8, False),
                      (102.0, True), (102.8, False)]
    assert RESCUE_S < BEAT_S


def test_after_an_outage_beats_resume_without_a_burst() -> None:
    beat, next_beat, wake_at = next_round(now=110.0, next_beat=101.0)  # 9 s late
    assert beat and next_beat == 110.0 + RESCUE_S and wake_at == next_beat
    beat, next_beat, _ = next_round(now=wake_at, next_beat=next_beat)
    assert beat  # the next one half a second later, not nine at once
