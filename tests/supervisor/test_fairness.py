"""Fair turns in the queue: users take equal turns within a priority, and each user's
clients (connections, its submitted jobs) take equal turns within its share."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st
from test_queueing import cancel, drain, make_job

from modelpool.supervisor.queueing import Job, JobQueue, user_of


def test_a_flooding_client_and_a_polite_one_take_turns() -> None:
    queue = JobQueue()
    flood = [make_job(owner="flood") for _ in range(100)]
    polite = [make_job(owner="polite") for _ in range(10)]
    for job in flood + polite:  # the flood arrived first
        queue.push(job)
    first_20 = [job.owner for job in drain(queue)[:20]]
    assert first_20.count("polite") == 10
    assert first_20[:4] in (["flood", "polite"] * 2, ["polite", "flood"] * 2)
    assert queue.held == {}


def test_turns_are_weighted_by_batch_size() -> None:
    """A client sending 4 texts a request gets a quarter as many requests through as one
    sending single texts: the same number of texts."""
    queue = JobQueue()
    for _ in range(20):
        queue.push(make_job(texts=4, owner="big"))
        queue.push(make_job(texts=1, owner="small"))
    first = drain(queue)[:10]
    texts = {owner: sum(j.size for j in first if j.owner == owner) for owner in ("big", "small")}
    assert abs(texts["big"] - texts["small"]) <= 4


def test_fairness_stays_within_a_priority() -> None:
    queue = JobQueue()
    for _ in range(5):
        queue.push(make_job("batch", owner="a"))
    queue.push(make_job("high", owner="b"))
    queue.push(make_job("normal", owner="a"))
    assert [j.request.priority for j in drain(queue)][:2] == ["high", "normal"]


def test_jobs_waiting_are_counted_by_client() -> None:
    queue = JobQueue()
    jobs = [make_job(owner="a"), make_job(owner="a"), make_job(owner="b")]
    for job in jobs:
        queue.push(job)
    assert queue.held == {"a": 2, "b": 1}
    cancel(queue, jobs[0])
    assert queue.held == {"a": 1, "b": 1}
    # A cancelled request took no turn: a, first in line, still goes first.
    assert queue.pop_batch(1) == [jobs[1]]
    assert queue.held == {"b": 1}


# ---- fairness between users, then between a user's clients ---------------------------

FLOODER, POLITE = 1000, 2000  # peer uids; an owner is (uid, connection serial)


def served(jobs: list[Job]) -> Counter[Hashable]:
    return Counter(user_of(job.owner) for job in jobs)


def four_floods_and_one_polite() -> list[Job]:
    """What leaves a queue where one user's four connections had 100 requests each
    waiting before another user's one connection queued its 100."""
    queue = JobQueue()
    for serial in range(1, 5):
        for _ in range(100):
            queue.push(make_job(owner=(FLOODER, serial)))
    for _ in range(100):
        queue.push(make_job(owner=(POLITE, 9)))
    return drain(queue)


def test_a_user_flooding_through_four_connections_gets_half_not_four_fifths() -> None:
    first = four_floods_and_one_polite()[:100]
    assert served(first) == {FLOODER: 50, POLITE: 50}
    assert [user_of(j.owner) for j in first[:4]] == [FLOODER, POLITE] * 2


def test_the_connections_of_one_user_take_turns_within_its_share() -> None:
    flood = [j.owner for j in four_floods_and_one_polite()[:200] if user_of(j.owner) == FLOODER]
    assert Counter(flood) == {(FLOODER, serial): 25 for serial in range(1, 5)}
    for i in range(0, 100, 4):  # round robin: each connection once in every four turns
        assert len(set(flood[i:i + 4])) == 4


def test_a_users_jobs_take_one_turn_among_its_connections() -> None:
    """Submitted jobs are (uid, "jobs"): one more client of their user, not a user."""
    queue = JobQueue()
    for _ in range(60):
        queue.push(make_job(owner=(FLOODER, 1)))
        queue.push(make_job(owner=(FLOODER, "jobs")))
        queue.push(make_job(owner=(POLITE, 2)))
    first = Counter(j.owner for j in drain(queue)[:80])
    assert first == {(POLITE, 2): 40, (FLOODER, 1): 20, (FLOODER, "jobs"): 20}


def test_opening_more_connections_later_buys_no_larger_share() -> None:
    queue = JobQueue()
    for _ in range(100):
        queue.push(make_job(owner=(FLOODER, 1)))
        queue.push(make_job(owner=(POLITE, 9)))
    assert served(drain_n(queue, 20)) == {FLOODER: 10, POLITE: 10}
    for serial in range(2, 6):
        for _ in range(100):
            queue.push(make_job(owner=(FLOODER, serial)))
    assert served(drain_n(queue, 100)) == {FLOODER: 50, POLITE: 50}


def test_an_idle_user_banks_no_turns() -> None:
    queue = JobQueue()
    for _ in range(100):
        queue.push(make_job(owner=(FLOODER, 1)))
    drain_n(queue, 50)  # the polite user had nothing waiting meanwhile
    for _ in range(10):
        queue.push(make_job(owner=(POLITE, 9)))
    assert served(drain_n(queue, 20)) == {FLOODER: 10, POLITE: 10}


def test_users_turns_are_weighted_by_size_across_connections() -> None:
    queue = JobQueue()
    for _ in range(40):
        for serial in (1, 2):
            queue.push(make_job(texts=4, owner=(FLOODER, serial)))
        queue.push(make_job(texts=1, owner=(POLITE, 9)))
    first = drain_n(queue, 40)
    texts = {uid: sum(j.size for j in first if user_of(j.owner) == uid)
             for uid in (FLOODER, POLITE)}
    assert abs(texts[FLOODER] - texts[POLITE]) <= 4


def test_fair_turns_still_batch_and_keep_priorities() -> None:
    queue = JobQueue()
    for serial in range(1, 5):
        queue.push(make_job("low", owner=(FLOODER, serial)))
    urgent = make_job("high", owner=(POLITE, 9))
    queue.push(urgent)
    batch = queue.pop_batch(8)
    assert batch[0] is urgent and len(batch) == 5


def drain_n(queue: JobQueue, n: int) -> list[Job]:
    return [job for _ in range(n) for job in queue.pop_batch(1)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=15),
                         min_size=1, max_size=4), min_size=2, max_size=3),
       st.randoms(use_true_random=False))
def test_backlogged_users_and_connections_stay_within_one_job_of_fair(
        users: list[list[list[int]]], rnd: random.Random) -> None:
    """Start-time fair queueing's bound at both levels: while two users (or two clients
    of one user) both have work waiting, the sizes served to them differ by at most the
    two largest jobs, whatever the order of arrival and the number of connections."""
    queue = JobQueue()
    jobs = [make_job(texts=size, owner=(uid, conn))
            for uid, conns in enumerate(users) for conn, sizes in enumerate(conns)
            for size in sizes]
    rnd.shuffle(jobs)
    for job in jobs:
        queue.push(job)
    left = Counter(user_of(j.owner) for j in jobs)
    left_by_owner = Counter(j.owner for j in jobs)
    done: Counter[Hashable] = Counter()
    done_by_owner: Counter[Hashable] = Counter()
    for job in drain(queue):
        uid = user_of(job.owner)
        left[uid] -= 1
        left_by_owner[job.owner] -= 1
        done[uid] += job.size
        done_by_owner[job.owner] += job.size
        busy = [done[u] for u in left if left[u]]  # users still backlogged, since the start
        assert not busy or max(busy) - min(busy) <= 8
        mine = [o for o in left_by_owner if user_of(o) == uid and left_by_owner[o]]
        if left[uid] and len(mine) >= 2:
            counts = [done_by_owner[o] for o in mine]
            assert max(counts) - min(counts) <= 8
