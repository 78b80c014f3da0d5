"""Environment variables (rpc_core/knobs.py): one rule for booleans, clear errors, read when
needed, and every variable rpc_core reads is listed there and in docs/rpc_core.md."""

import pathlib
import re

import pytest

from rpc_core import knobs, memory, transport
from rpc_core.transport import cma, handshake, stream, unix

ROOT = pathlib.Path(__file__).resolve().parents[2]
BOOLEANS = [knobs.UDS, knobs.CMA, knobs.MALLOC_TUNE]


@pytest.mark.parametrize("knob", BOOLEANS, ids=lambda k: k.name)
@pytest.mark.parametrize(
    "raw, value",
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        (" ON ", True),
        ("0", False),
        ("false", False),
        ("NO", False),
        ("off", False),
    ],
)
def test_booleans_accept_the_same_words_everywhere(monkeypatch, knob, raw, value):
    monkeypatch.setenv(knob.name, raw)
    assert knobs.flag(knob) is value


@pytest.mark.parametrize("knob", BOOLEANS, ids=lambda k: k.name)
def test_unset_or_empty_means_the_default(monkeypatch, knob):
    monkeypatch.delenv(knob.name, raising=False)
    assert knobs.flag(knob) is True
    monkeypatch.setenv(knob.name, "")
    assert knobs.flag(knob) is True


@pytest.mark.parametrize("knob", BOOLEANS, ids=lambda k: k.name)
def test_anything_else_is_an_error_naming_the_variable_and_the_words(monkeypatch, knob):
    monkeypatch.setenv(knob.name, "nein")
    with pytest.raises(ValueError, match=rf"{knob.name}='nein'.*1/true/yes/on.*0/false/no/off"):
        knobs.flag(knob)


@pytest.mark.parametrize(
    "name, raw",
    [
        ("RPC_CORE_SPIN_US", "-1"),
        ("RPC_CORE_SPIN_US", "fast"),
        ("RPC_CORE_HANDSHAKE_TIMEOUT", "0"),
        ("RPC_CORE_HANDSHAKE_TIMEOUT", "nan"),
        ("RPC_CORE_HANDSHAKE_TIMEOUT", "inf"),
    ],
)
def test_numbers_out_of_range_are_errors_naming_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    read = knobs.spin_seconds if name == "RPC_CORE_SPIN_US" else knobs.handshake_timeout
    with pytest.raises(ValueError, match=rf"{name}='{raw}': expected"):
        read()


def test_knobs_are_read_when_needed_not_at_import(monkeypatch, listener_pair):
    monkeypatch.setenv("RPC_CORE_HANDSHAKE_TIMEOUT", "2.5")
    assert handshake.handshake_timeout() == 2.5
    monkeypatch.setenv("RPC_CORE_UDS", "off")
    assert not unix.Unix().enabled()
    monkeypatch.setenv("RPC_CORE_CMA", "no")
    assert not cma.enabled()
    monkeypatch.setenv("RPC_CORE_AUTH_SECRET", "s3cret")
    from rpc_core import RpcBackendOptions

    assert RpcBackendOptions().auth_secret == b"s3cret"
    monkeypatch.setenv("RPC_CORE_SPIN_US", "150")
    a, b = listener_pair()
    assert a._spin == pytest.approx(150e-6)  # a connection reads it when it is made


def test_malloc_tuning_honours_its_switch(monkeypatch):
    monkeypatch.setattr(memory, "_done", False)
    monkeypatch.setenv("RPC_CORE_MALLOC_TUNE", "false")  # a word other than 0 used to be ignored
    assert memory.tune() is False


def test_every_variable_rpc_core_reads_is_a_knob_and_documented():
    read = set()
    for path in (ROOT / "rpc_core").rglob("*.py"):
        read |= set(re.findall(r"RPC_CORE_[A-Z_]+", path.read_text()))
    assert read == set(knobs.KNOBS), "rpc_core mentions variables that knobs.py does not parse (or the reverse)"
    table = (ROOT / "docs" / "rpc_core.md").read_text()
    for name, knob in knobs.KNOBS.items():
        assert re.search(rf"\| `{name}` \| `?{re.escape(knob.default) or 'unset'}`? \|", table), name
    for path in (ROOT / "rpc_core").rglob("*.py"):
        if path.name != "knobs.py":
            assert not re.search(r"environ[^\n]*RPC_CORE_", path.read_text()), f"{path} reads a knob itself"


@pytest.fixture
def listener_pair():
    """Connects a pair of Connections over 127.0.0.1 on demand (closed after the test)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    made = []
    ex = ThreadPoolExecutor(1)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(30)

    def make():
        def accept():
            s, _ = srv.accept()
            return stream.Connection(s, handshake.run_acceptor(s, b"k", timeout=30))

        got = ex.submit(accept)
        a = transport.TCP.dial(srv.getsockname(), b"k", timeout=30)
        b = got.result(30)
        made.extend((a, b))
        return a, b

    yield make
    for c in made:
        c.close()
    srv.close()
    ex.shutdown()


def test_a_bad_value_stops_init_rpc_at_once(monkeypatch):
    import rpc_core

    monkeypatch.setenv("RPC_CORE_CMA", "maybe")
    with pytest.raises(ValueError, match="RPC_CORE_CMA='maybe'"):
        rpc_core.init_rpc(
            "worker0",
            rank=0,
            world_size=1,
            rpc_backend_options=rpc_core.RpcBackendOptions(init_method="tcp://127.0.0.1:1", auth_secret="k"),
        )
