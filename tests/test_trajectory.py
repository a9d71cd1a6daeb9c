"""Invariant 1 (token identity) checks, fed violations."""

from __future__ import annotations

import pytest

from molt_core.trajectory import Completion, InvariantError, Trajectory, collate


def good() -> Trajectory:
    t = Trajectory()
    t.add_prompt([5, 6, 7])
    t.add_completion(Completion([8, 9], [-0.5, -1.0], [3, 3]))
    return t


def test_good_trajectory_collates():
    t = good()
    t.check(vocab_size=16)
    b = collate([t, good()], [[1.0] * 5, [2.0] * 5])
    assert b["loss_mask"][0].tolist() == [False, False, False, True, True]
    assert b["versions"][0].tolist() == [-1, -1, -1, 3, 3]


def test_logprob_count_must_match_sampled_tokens():
    with pytest.raises(InvariantError, match="2 token ids but 1 log-probs"):
        Completion([8, 9], [-0.5], [3, 3])


def test_trainable_token_not_sampled_by_engine():
    t = good()
    t.loss_mask[1] = True      # a prompt token marked trainable: no sampling record
    with pytest.raises(InvariantError, match="position 1 has no sampling record"):
        t.check(16)


def test_out_of_range_token():
    t = good()
    t.token_ids[0] = 16
    with pytest.raises(InvariantError, match="token id 16 at position 0 is outside"):
        t.check(16)
    t.token_ids[0] = -1
    with pytest.raises(InvariantError, match="outside the vocabulary"):
        t.check(16)


def test_length_mismatch():
    t = good()
    t.versions.pop()
    with pytest.raises(InvariantError, match="versions has 4 entries for 5 tokens"):
        t.check(16)


def test_collate_rejects_wrong_advantage_length():
    with pytest.raises(InvariantError, match="advantages for trajectory 0"):
        collate([good()], [[1.0]])


def test_collate_never_shifts_a_row_of_the_wrong_length():
    long, short = good(), good()
    long.logprobs.append(-2.0)       # one entry too many: the next row's would slide into it
    short.versions.pop()
    for bad in (long, short):
        with pytest.raises(ValueError, match="cannot assign"):
            collate([bad, good()], None)
    b = collate([good(), good()], None)      # None: zero advantages, filled by the caller
    assert b["advantages"].shape == (2, 5) and not b["advantages"].any()
    assert b["behavior_logprobs"][1].tolist() == [0.0, 0.0, 0.0, -0.5, -1.0]


def test_an_empty_model_call_is_a_turn_with_no_tokens_in_every_segment():
    """A reply cut to nothing (it began with a stop string) is still a call: turns() keeps it,
    in place, so per-call rewards stay aligned; segments carry their calls, the empty one at a
    segment's end included, and two calls with nothing between stay two."""
    t = good()                                          # call 0: [3, 5)
    t.add_prompt([10])
    t.add_completion(Completion([], [], []))            # call 1: empty, at 6
    t.segments.append(len(t))                           # the template re-rendered the history
    t.add_prompt([5, 6, 7, 8, 9, 10])
    t.add_completion(Completion([11], [-0.1], [3]))     # call 2: [12, 13)
    t.add_completion(Completion([12], [-0.2], [3]))     # call 3: right after, no prompt between
    t.check(16)
    assert t.turns() == [(3, 5), (6, 6), (12, 13), (13, 14)]
    assert [s.turns() for s in t.split_segments()] == [[(3, 5), (6, 6)], [(6, 7), (7, 8)]]


def test_trainable_tokens_outside_the_recorded_calls_are_rejected():
    t = good()
    t.loss_mask[4], t.calls[0] = True, [3, 4]           # a call span that lost a sampled token
    with pytest.raises(InvariantError, match="position 4 has no sampling record"):
        t.check(16)
    t.calls[0] = [3, 9]                                 # past the end (a rollback kept the call)
    with pytest.raises(InvariantError, match=r"calls \[\[3, 9\]\] are not ordered \[start, end\) "
                                             "spans of its 5 tokens"):
        t.check(16)
