"""The launcher's heartbeat board: how long a role may stay silent, on a clock the test steps."""

import multiprocessing as mp

from ps_train.launch.heartbeat import HeartbeatBoard


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_startup_allowance_counts_from_each_process_start_not_from_the_launch():
    clock = _Clock()
    board = HeartbeatBoard(mp.get_context("spawn"), 2, timeout=10.0, clock=clock)
    assert board.startup_grace == 60.0
    clock.now += 100  # the first start waited for the fork server, which imported what roles need meanwhile
    board.started(0)
    clock.now += 5
    board.started(1)
    clock.now += 50
    assert board.silent([0, 1]) == []  # 55 and 50 s since each started: within the allowance
    clock.now += 6
    assert board.silent([0, 1]) == [(0, 61.0)]  # rank 0 never beat within 60 s of its start
    board.counters[1] += 1  # rank 1's first beat: from now on the timeout applies
    assert board.silent([1]) == []
    clock.now += 10.5
    assert board.silent([1]) == [(1, 10.5)]


def test_a_role_that_beat_before_the_launcher_noted_its_start_gets_the_timeout():
    clock = _Clock()
    board = HeartbeatBoard(mp.get_context("spawn"), 1, timeout=10.0, clock=clock)
    board.counters[0] += 1  # it beat at once
    board.started(0)
    clock.now += 9
    assert board.silent([0]) == []
    clock.now += 2
    assert board.silent([0]) == [(0, 11.0)]


def test_a_replacement_gets_the_startup_allowance_again():
    clock = _Clock()
    board = HeartbeatBoard(mp.get_context("spawn"), 1, timeout=10.0, clock=clock)
    board.started(0)
    board.counters[0] += 3
    assert board.silent([0]) == []
    clock.now += 30  # it died; a new process takes its rank
    board.restart(0)
    clock.now += 59
    assert board.silent([0]) == []  # the dead one's beats do not count as the new one's
    clock.now += 2
    assert board.silent([0]) == [(0, 61.0)]
