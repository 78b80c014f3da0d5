"""The coordinator's answers to the rounds of a graceful shutdown (rank 0 sends each to every
member): a quiescence round's verdict, the nothing of a shutdown round or barrier. The
multi-process shutdown tests (test_agent, test_shutdown_bounded) run them end to end."""

from rpc_core.group.lifecycle import _CallCounts, _Coordinator, _Verdict

MEMBERS = None  # the whole group: gather_round's key when no worker names are given


def _counts(*per_rank: tuple[int, int, int, int]) -> dict[int, _CallCounts]:
    return {rank: _CallCounts(*c) for rank, c in enumerate(per_rank)}


def test_work_is_over_after_two_consecutive_idle_rounds_with_the_same_counts():
    c = _Coordinator()
    idle = _counts((3, 3, 0, 0), (0, 0, 3, 3))
    assert c._answer(("quiesce", 0, MEMBERS), idle) == _Verdict(over=False, idle=True)  # no round before it
    assert c._answer(("quiesce", 1, MEMBERS), dict(idle)) == _Verdict(over=True, idle=True)


def test_counts_that_moved_or_busy_members_keep_it_going():
    c = _Coordinator()
    assert c._answer(("quiesce", 0, MEMBERS), _counts((3, 3, 0, 0), (0, 0, 3, 3))) == _Verdict(False, True)
    # Rank 1 served one more request meanwhile: idle, but not the same counts.
    assert c._answer(("quiesce", 1, MEMBERS), _counts((4, 4, 0, 0), (0, 0, 4, 4))) == _Verdict(False, True)
    # A call still pending on rank 0, and a request rank 1 has not answered: busy.
    assert c._answer(("quiesce", 2, MEMBERS), _counts((5, 4, 0, 0), (0, 0, 5, 4))) == _Verdict(False, False)
    assert c._answer(("quiesce", 3, MEMBERS), _counts((5, 5, 0, 0), (0, 0, 5, 5))) == _Verdict(False, True)
    assert c._answer(("quiesce", 4, MEMBERS), _counts((5, 5, 0, 0), (0, 0, 5, 5))) == _Verdict(True, True)


def test_a_request_still_on_its_way_is_not_idle():
    # Rank 0 sent 2 calls, both timed out (done); rank 1 received only 1 so far.
    c = _Coordinator()
    on_its_way = _counts((2, 2, 0, 0), (0, 0, 1, 1))
    assert c._answer(("quiesce", 0, MEMBERS), on_its_way).idle is False
    assert c._answer(("quiesce", 1, MEMBERS), dict(on_its_way)) == _Verdict(False, False)


def test_only_the_previous_round_counts_and_a_new_group_starts_afresh():
    c = _Coordinator()
    idle = _counts((1, 1, 0, 0), (0, 0, 1, 1))
    c._answer(("quiesce", 0, MEMBERS), idle)
    assert c._answer(("quiesce", 2, MEMBERS), dict(idle)).over is False  # round 1 is not round 0
    c.quiesced = {}  # what start() does for a new group
    assert c._answer(("quiesce", 3, MEMBERS), dict(idle)).over is False


def test_barrier_and_shutdown_rounds_answer_nothing_all_gather_everyone():
    c = _Coordinator()
    payloads = {0: "a", 1: "b"}
    assert c._answer(("shutdown", 0, MEMBERS), payloads) is None
    assert c._answer(("barrier", 0, ("worker0", "worker1")), payloads) is None
    assert c._answer(("all_gather", 0, MEMBERS), payloads) == {0: "a", 1: "b"}
