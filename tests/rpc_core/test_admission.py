"""A listener's handshake slots (``transport.Admission``) under a flood of dials: one more than
the slots waits for a slot instead of evicting a connection whose handshake is under way, and
evicts the oldest only once it has been pending for the eviction grace. In-process, on socket
pairs: no workers needed."""

from __future__ import annotations

import socket
import threading

import pytest

from rpc_core import transport
from rpc_core.transport import handshake

PEER = ("127.0.0.1", 1)


@pytest.fixture
def pairs():
    made: list[tuple[socket.socket, socket.socket]] = []

    def make() -> tuple[socket.socket, socket.socket]:
        made.append(socket.socketpair())
        return made[-1]

    yield make
    for a, b in made:
        a.close()
        b.close()


def _admit_in_thread(admission: transport.Admission, sock: socket.socket) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(admission.admit(sock, PEER)), daemon=True)
    t.start()
    return t, result


def _is_open(sock: socket.socket) -> bool:
    """Whether the far end of ``sock``'s pair is still up (a hung-up end reads EOF at once)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True


@pytest.mark.timeout(60)
def test_a_dial_beyond_the_slots_waits_for_one_and_evicts_nobody_under_way(monkeypatch, pairs):
    monkeypatch.setenv("RPC_CORE_HANDSHAKE_TIMEOUT", "3600")  # grace 900 s: nothing is stale here
    admission = transport.Admission("test")
    held = [pairs() for _ in range(handshake.MAX_PENDING_HANDSHAKES)]
    assert all(admission.admit(ours, PEER) for ours, _ in held)
    newcomer, _ = pairs()
    t, result = _admit_in_thread(admission, newcomer)
    t.join(0.2)  # it waits for a slot (bounded check: it must still be waiting)
    assert t.is_alive() and result == []
    assert admission.authenticated(held[0][0])  # one handshake completes: its slot frees
    t.join(30)
    assert result == [True]
    assert all(_is_open(theirs) for _, theirs in held)  # nobody was closed to make room


@pytest.mark.timeout(60)
def test_a_stale_handshake_is_evicted_after_the_grace_and_close_wakes_a_waiter(monkeypatch, pairs):
    monkeypatch.setenv("RPC_CORE_HANDSHAKE_TIMEOUT", "0.2")  # grace 0.05 s
    admission = transport.Admission("test")
    held = [pairs() for _ in range(handshake.MAX_PENDING_HANDSHAKES)]
    assert all(admission.admit(ours, PEER) for ours, _ in held)
    newcomer, _ = pairs()
    assert admission.admit(newcomer, PEER)  # returns once the oldest went stale
    assert not _is_open(held[0][1])  # the oldest was hung up
    assert all(_is_open(theirs) for _, theirs in held[1:])
    assert not admission.authenticated(held[0][0])  # its thread learns it was closed

    monkeypatch.setenv("RPC_CORE_HANDSHAKE_TIMEOUT", "3600")
    late, _ = pairs()
    t, result = _admit_in_thread(admission, late)
    t.join(0.2)
    assert t.is_alive()
    admission.close()  # shutting down: the waiter gives up at once
    t.join(30)
    assert result == [False]
