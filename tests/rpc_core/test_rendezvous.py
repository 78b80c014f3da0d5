"""Rendezvous (rpc_core/group/rendezvous.py via init_rpc): env:// and tcp://, and one clear error for
each way it goes wrong.

Failing rendezvous never creates an agent, so most of these run ``init_rpc`` in threads of the
pytest process itself (one thread per would-be worker); the conftest fixture checks that no
agent is left behind. The successful paths run in worker processes."""

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

import rpc_core
from rpc_core import RendezvousError, RpcBackendOptions, WorkerInfo
from rpc_core.errors import AuthenticationError
from rpc_core.group.rendezvous import rendezvous
from tests._world import free_port, run_world

IO_TIMEOUT = 30.0


def _opts(port, **kw):
    kw.setdefault("init_timeout", 20.0)
    return RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", auth_secret="s", **kw)


def _init(name, rank, world_size, options):
    rpc_core.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def _run_threads(*calls):
    """Run each (fn, *args) in its own thread; return the exception each raised (or None)."""
    with ThreadPoolExecutor(len(calls)) as ex:
        futs = [ex.submit(fn, *args) for fn, *args in calls]
        return [f.exception(IO_TIMEOUT) for f in futs]


# -- names ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, message",
    [
        ("abc*", "Worker name must match"),
        (" ", "Worker name must match"),
        ("", "must be non-empty"),
        ("a" * 128, "shorter than 128"),
        ("tab\t", "Worker name must match"),
    ],
)
def test_invalid_worker_names_are_rejected(name, message):
    with pytest.raises(ValueError, match=message):
        _init(name, 0, 1, _opts(free_port()))


def test_worker_name_must_be_a_string():
    with pytest.raises(TypeError, match="must be a str"):
        _init(3, 0, 1, _opts(free_port()))


def test_names_may_use_letters_digits_underscore_colon_dash_up_to_127_chars():
    assert WorkerInfo("ps:0_a-B9", 1).name == "ps:0_a-B9"
    assert WorkerInfo("a" * 127, 0).id == 0


def test_worker_info_compares_hashes_prints_and_pickles_like_torchs():
    import pickle

    info = WorkerInfo("worker1", 1)
    assert info == WorkerInfo("worker1", 1) and info != WorkerInfo("worker1", 2)
    assert len({info, WorkerInfo("worker1", 1)}) == 1
    assert repr(info) == "WorkerInfo(id=1, name=worker1)"
    assert pickle.loads(pickle.dumps(info)) == info
    assert (info.name, info.id) == ("worker1", 1)


def test_duplicate_name_fails_on_every_worker_saying_so():
    port = free_port()
    errors = _run_threads((_init, "same", 0, 2, _opts(port)), (_init, "same", 1, 2, _opts(port)))
    for e in errors:
        assert isinstance(e, RendezvousError), e
        assert "worker name 'same' is not unique" in str(e)


def test_duplicate_rank_fails_saying_which_rank():
    port = free_port()
    errors = _run_threads(
        (_init, "a", 0, 3, _opts(port)),
        (_init, "b", 1, 3, _opts(port)),
        (_init, "c", 1, 3, _opts(port)),
    )
    for e in errors:
        assert isinstance(e, RendezvousError), e
        assert "rank 1 is not unique" in str(e)


def test_world_size_disagreement_is_reported_to_the_joiner():
    port = free_port()
    host_err, joiner_err = _run_threads(
        (_init, "a", 0, 2, _opts(port, init_timeout=1.0)),
        (_init, "b", 1, 3, _opts(port)),
    )
    assert isinstance(joiner_err, RendezvousError) and "world_size mismatch" in str(joiner_err)
    assert "says 3, rank 0 says 2" in str(joiner_err)
    assert isinstance(host_err, RendezvousError) and "missing ranks [1]" in str(host_err)


@pytest.mark.parametrize("rank, world_size", [(2, 2), (-1, 2), (0, 0)])
def test_rank_and_world_size_are_checked(rank, world_size):
    with pytest.raises(ValueError, match="rank must be|world_size must be"):
        _init("a", rank, world_size, _opts(free_port()))


def test_missing_world_size_and_rank_says_a_dynamic_worker_needs_its_rank():
    with pytest.raises(ValueError, match="rank parameter missing"):
        rpc_core.init_rpc("a", rpc_backend_options=_opts(free_port()))


# -- init_method ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, missing",
    [
        ({}, "MASTER_ADDR and MASTER_PORT"),
        ({"MASTER_ADDR": "127.0.0.1"}, "needs MASTER_PORT"),
        ({"MASTER_PORT": "29500"}, "needs MASTER_ADDR"),
    ],
)
def test_env_init_method_names_the_missing_variables(monkeypatch, env, missing):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RendezvousError, match=missing):
        _init("a", 0, 1, RpcBackendOptions(init_method="env://", auth_secret="s"))


def test_env_master_port_must_be_a_number(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(RendezvousError, match="MASTER_PORT: port 'http' is not a number"):
        _init("a", 0, 1, RpcBackendOptions(init_method="env://", auth_secret="s"))


@pytest.mark.parametrize(
    "init_method, message",
    [
        ("tcp://127.0.0.1", "no port"),
        ("tcp://[::1]", "no port"),
        ("tcp://:29500", "no host"),
        ("tcp://127.0.0.1:99999", "out of range"),
        ("tcp://127.0.0.1:x", "not a number"),
    ],
)
def test_malformed_tcp_init_method_says_what_is_wrong(init_method, message):
    with pytest.raises(RendezvousError, match=message):
        _init("a", 0, 1, RpcBackendOptions(init_method=init_method, auth_secret="s"))


def test_unsupported_init_method_is_rejected_by_the_options():
    with pytest.raises(ValueError, match="env://.*tcp://"):
        RpcBackendOptions(init_method="file:///tmp/rdzv")


def test_port_in_use_says_so_and_how_to_fix_it():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(RendezvousError, match=rf"cannot listen on 127\.0\.0\.1:{port}.*in use.*MASTER_PORT"):
            _init("a", 0, 2, _opts(port))


# -- a world that never fills -------------------------------------------------------------------------
def test_world_that_never_fills_times_out_naming_the_missing_ranks():
    with pytest.raises(RendezvousError, match=r"only 1 of 4 workers joined.*missing ranks \[1, 2, 3\].*init_timeout"):
        _init("a", 0, 4, _opts(free_port(), init_timeout=0.5))


def test_world_that_never_fills_fails_every_worker_that_did_join():
    port = free_port()
    errors = _run_threads((_init, "a", 0, 3, _opts(port, init_timeout=1.0)), (_init, "b", 1, 3, _opts(port)))
    for e in errors:
        assert isinstance(e, RendezvousError), e
        assert "only 2 of 3 workers joined" in str(e) and "missing ranks [2]" in str(e)


def test_worker_that_cannot_reach_rank_0_times_out_saying_where_it_looked():
    port = free_port()
    with pytest.raises(
        RendezvousError,
        match=rf"could not reach the rendezvous at 127\.0\.0\.1:{port}.*is rank 0 "
        r"running",
    ):
        _init("b", 1, 2, _opts(port, init_timeout=0.5))


# -- while it waits, each worker says whom it waits for ------------------------------------------------------
def _waiting_lines(caplog, who):
    return [
        r for r in caplog.records if r.name == "rpc_core" and r.getMessage().startswith(f"rpc_core rendezvous: {who}")
    ]


def test_a_rank_that_never_starts_is_named_in_the_log_while_the_others_wait(monkeypatch, caplog):
    monkeypatch.setenv("RPC_CORE_RENDEZVOUS_LOG_INTERVAL", "0.3")
    caplog.set_level("INFO", logger="rpc_core")
    port = free_port()
    # rank 2 of 3 never starts
    errors = _run_threads(
        (_init, "a", 0, 3, _opts(port, init_timeout=2.0)), (_init, "b", 1, 3, _opts(port, init_timeout=2.0))
    )
    assert all(isinstance(e, RendezvousError) for e in errors), errors
    on0 = _waiting_lines(caplog, "rank 0 ('a')")
    on1 = _waiting_lines(caplog, "worker 'b' (rank 1)")
    assert on0 and on1, [r.getMessage() for r in caplog.records]
    # rank 1 arrives at once: from then on, rank 0's lines name the rank that never came
    last = on0[-1].getMessage()
    assert f"at 127.0.0.1:{port} is waiting for ranks [2] (2 of 3 arrived)" in last, last
    assert "s of 2 s (init_timeout)" in last, last
    assert all(
        f"has reached rank 0 at 127.0.0.1:{port} and is waiting for the roster, which rank 0 sends once "
        "all 3 workers have arrived" in r.getMessage()
        for r in on1
    ), on1[0].getMessage()
    # one line per interval at most, INFO at first, WARNING once half of init_timeout is gone
    for lines in (on0, on1):
        assert len(lines) <= 2.0 / 0.3 + 1, [r.getMessage() for r in lines]
        assert lines[0].levelname == "INFO" and lines[-1].levelname == "WARNING"


def test_a_joiner_that_cannot_reach_rank_0_says_so_while_it_waits(monkeypatch, caplog):
    monkeypatch.setenv("RPC_CORE_RENDEZVOUS_LOG_INTERVAL", "0.2")
    caplog.set_level("INFO", logger="rpc_core")
    port = free_port()
    with pytest.raises(RendezvousError, match="could not reach the rendezvous"):
        rendezvous("d1", 1, None, f"tcp://127.0.0.1:{port}", b"s", 1.0)  # joins a dynamic group nobody founded
    lines = _waiting_lines(caplog, "worker 'd1' (rank 1)")
    assert lines and all(
        f"is waiting for rank 0 at 127.0.0.1:{port}, which it cannot reach yet" in r.getMessage() for r in lines
    ), [r.getMessage() for r in caplog.records]


def test_no_waiting_lines_with_the_interval_at_0(monkeypatch, caplog):
    monkeypatch.setenv("RPC_CORE_RENDEZVOUS_LOG_INTERVAL", "0")
    caplog.set_level("INFO", logger="rpc_core")
    with pytest.raises(RendezvousError, match="missing ranks"):
        _init("a", 0, 2, _opts(free_port(), init_timeout=0.5))
    assert not _waiting_lines(caplog, "")


# -- authentication at rendezvous -----------------------------------------------------------------------
def test_joiner_with_the_wrong_secret_is_rejected_and_rank_0_keeps_waiting_for_the_right_one():
    port = free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    with ThreadPoolExecutor(1) as ex:
        host = ex.submit(rendezvous, "a", 0, 2, init_method, b"right", 20.0)
        with pytest.raises(AuthenticationError, match="rejected our authentication.*same secret"):
            rendezvous("b", 1, 2, init_method, b"wrong", 20.0)
        joiner = rendezvous("b", 1, 2, init_method, b"right", 20.0)
        world0 = host.result(IO_TIMEOUT)
    try:
        assert [w.name for w in world0.workers] == ["a", "b"] == [w.name for w in joiner.workers]
        assert joiner.me == WorkerInfo("b", 1) and world0.me == WorkerInfo("a", 0)
    finally:
        for w in (world0, joiner):
            for listener in w.listeners:
                listener.close()
            for c in w.connections.values():
                c.close()


# -- successful worlds (worker processes) ---------------------------------------------------------------
def _body_env_rendezvous(ctx):
    name = f"trainer:{ctx.rank}_x-y"
    ctx.init(name=name, init_method="env://")
    me = rpc_core.get_worker_info()
    assert me == WorkerInfo(name, ctx.rank)
    peer = f"trainer:{1 - ctx.rank}_x-y"
    assert rpc_core.get_worker_info(peer).id == 1 - ctx.rank
    return rpc_core.rpc_sync(peer, rpc_core.get_worker_info).name


def test_env_init_method_reads_master_addr_and_master_port():
    port = free_port()
    got = run_world(_body_env_rendezvous, 2, init=False, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert got == ["trainer:1_x-y", "trainer:0_x-y"]


def _body_tcp_rendezvous(ctx):
    return [(w.name, w.id) for w in (rpc_core.get_worker_info(f"worker{r}") for r in range(ctx.world_size))]


def test_tcp_init_method_builds_the_same_table_everywhere():
    got = run_world(_body_tcp_rendezvous, 3)
    assert got == [[("worker0", 0), ("worker1", 1), ("worker2", 2)]] * 3


# -- silent connections to rank 0 during the rendezvous ----------------------------------------------
def _body_silent_during_rendezvous(ctx, n_silent):
    import time

    from rpc_core.group.rendezvous import rendezvous as rdzv
    from rpc_core.transport import handshake

    silent = []
    if ctx.rank == 1:
        # Rank 0 listens once a joiner got an answer: a joiner with the wrong world_size is
        # turned away, and rank 0 goes on waiting for the real ones.
        with pytest.raises(RendezvousError, match="world_size mismatch"):
            rdzv("probe", 1, 99, ctx.init_method, ctx.secret.encode(), IO_TIMEOUT)
        address = ctx.init_method[len("tcp://") :].rsplit(":", 1)
        for _ in range(n_silent):  # connect, then say nothing
            silent.append(socket.create_connection((address[0], int(address[1])), timeout=IO_TIMEOUT))
    start = time.monotonic()
    try:
        ctx.init(init_timeout=40.0)
        took = time.monotonic() - start
        peer = (ctx.rank + 1) % ctx.world_size
        assert rpc_core.rpc_sync(peer, rpc_core.get_worker_info).id == peer
        for s in silent:  # the handshakes still in progress ended with the rendezvous
            s.settimeout(IO_TIMEOUT)
            while s.recv(65536):
                pass
    finally:
        for s in silent:
            s.close()
    return took, handshake.handshake_timeout()


def test_silent_connections_do_not_delay_the_rendezvous():
    n_silent = 6
    results = run_world(_body_silent_during_rendezvous, 3, args=(n_silent,), init=False, timeout=90)
    took, handshake_timeout = results[1]
    # Handshakes run side by side: rank 1 joined behind 6 silent connections without waiting
    # for any of them to time out. Before, rank 0 ran them one after the other (10 s each),
    # and init_rpc failed at its 40 s limit.
    assert took < handshake_timeout, results
