"""Porting a torch.distributed.rpc program is a change of imports (docs/torch_compatibility.md).

``torch_rpc_program.py`` uses torch's RPC API names only. It runs as real scripts, one
process per rank launched like torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
first as written on torch.distributed.rpc (the oracle), then with ``torch.distributed.rpc``
replaced by ``rpc_core`` in its imports. Both must print the same result and exit cleanly."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from tests._world import free_port

PROGRAM = pathlib.Path(__file__).with_name("torch_rpc_program.py")
REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT = 120.0


def _start(script: pathlib.Path, world_size: int, extra_env=None) -> list:
    """Launch one process per rank, as torchrun would."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
            **(extra_env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                cwd=str(script.parent),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _result(script: pathlib.Path, procs: list) -> str:
    """Wait for every rank to exit cleanly; return rank 0's RESULT line."""
    outputs = []
    try:
        for rank, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{script.name} rank {rank} did not finish within {TIMEOUT:g} s")
            assert p.returncode == 0, f"{script.name} rank {rank} exited with {p.returncode}:\n{out}"
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [line for line in outputs[0].splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, outputs[0]
    return results[0]


def _ported(tmp_path: pathlib.Path) -> pathlib.Path:
    source = PROGRAM.read_text()
    ported = source.replace("import torch.distributed.rpc as rpc", "import rpc_core as rpc")
    ported = ported.replace("from torch.distributed.rpc import", "from rpc_core import")
    changed = [(a, b) for a, b in zip(source.splitlines(), ported.splitlines(), strict=True) if a != b]
    assert len(changed) == 2 and all(a.startswith(("import", "from")) for a, _ in changed), changed
    assert not re.search(r"^(import|from) torch\.distributed|[^\w.]torch\.distributed\.\w+\(", ported, re.M)
    path = tmp_path / "ported_program.py"
    path.write_text(ported)
    return path


def test_a_torch_rpc_program_runs_on_rpc_core_by_changing_its_imports(tmp_path):
    ported = _ported(tmp_path)
    ours = _start(ported, 3, {"RPC_CORE_AUTH_SECRET": "port-test"})
    oracle = _start(PROGRAM, 3) if torch.distributed.rpc.is_available() else None  # both at once
    got = _result(ported, ours)
    if oracle is not None:
        assert got == _result(PROGRAM, oracle)
    else:  # no torch RPC in this build: check the values the program computes
        assert '"weight": [-0.875, -0.875, -0.875]' in got and '"rrefs": [6.0, 6.0]' in got
