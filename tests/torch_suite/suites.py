"""The selection of torch's RPC test suites, and their test classes for each library.

torch builds its runnable classes by mixing a suite (``RpcTest``), an agent fixture
(``TensorPipeRpcAgentTestFixture``) and a process helper (``rpc_utils.generate_tests``).
``test_classes(lib)`` does the same with torch's TensorPipe fixture (``lib="torch"``) or
``RpcCoreAgentTestFixture`` (``lib="rpc_core"``, after ``routing.install()``), and a
helper that forks the ranks from this process (which has imported torch and the suites)
instead of spawning fresh interpreters: a rank starts in ~0.1 s instead of the seconds a
torch import costs on a small machine. Every rank of a test uses ``tcp://127.0.0.1:<free
port>`` (torch's ``RPC_INIT_WITH_TCP=1`` mode), as rpc_core has no ``file://`` rendezvous.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
from dataclasses import dataclass
from typing import Any

# Suite name -> (torch's module, its classes torch instantiates for every agent, without CUDA)
SUITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "rpc": ("torch.testing._internal.distributed.rpc.rpc_test", ("RpcTest", "TensorPipeAgentRpcTest")),
    "dist_autograd": (
        "torch.testing._internal.distributed.rpc.dist_autograd_test",
        ("DistAutogradTest", "TensorPipeAgentDistAutogradTest"),
    ),
    "dist_optimizer": ("torch.testing._internal.distributed.rpc.dist_optimizer_test", ("DistOptimizerTest",)),
    "parameter_server": (
        "torch.testing._internal.distributed.rpc.examples.parameter_server_test",
        ("ParameterServerTest",),
    ),
    "reinforcement_learning": (
        "torch.testing._internal.distributed.rpc.examples.reinforcement_learning_rpc_test",
        ("ReinforcementLearningRpcTest",),
    ),
    "remote_module": (
        "torch.testing._internal.distributed.nn.api.remote_module_test",
        ("RemoteModuleTest", "ThreeWorkersRemoteModuleTest"),
    ),
}
# Suites of those modules left out whole, and why (listed in the table).
NOT_SELECTED: dict[str, str] = {
    "CudaRpcTest": "needs CUDA",
    "TensorPipeAgentCudaRpcTest": "needs CUDA",
    "CudaDistAutogradTest": "needs CUDA",
    "TensorPipeCudaDistAutogradTest": "needs CUDA",
    "CudaRemoteModuleTest": "needs CUDA",
    "FaultyAgentDistAutogradTest": "runs on torch's fault-injection agent (FAULTY_TENSORPIPE), not on a real agent",
}
LIBS = ("torch", "rpc_core")


@dataclass(frozen=True)
class TestId:
    """One test of the selection: ``rpc.RpcTest.test_self_add``."""

    suite: str
    cls: str
    method: str

    def __str__(self) -> str:
        return f"{self.suite}.{self.cls}.{self.method}"

    @classmethod
    def parse(cls, text: str) -> TestId:
        parts = text.split(".")
        if len(parts) != 3 or parts[0] not in SUITES:
            raise ValueError(f"test id {text!r}: expected SUITE.CLASS.test_name with SUITE one of {sorted(SUITES)}")
        return cls(*parts)


def _fixture(lib: str) -> type:
    if lib == "torch":
        from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
            TensorPipeRpcAgentTestFixture,
        )

        return TensorPipeRpcAgentTestFixture
    from tests.torch_suite.fixture import RpcCoreAgentTestFixture

    return RpcCoreAgentTestFixture


def _fork_helper() -> type:
    from torch.testing._internal.common_distributed import MultiProcessTestCase
    from torch.testing._internal.common_utils import find_free_port

    class ForkHelper(MultiProcessTestCase):
        """torch's SpawnHelper, forking the ranks from this (preloaded) process."""

        def setUp(self) -> None:
            super().setUp()
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(find_free_port())
            self._start_processes(multiprocessing.get_context("fork").Process)

    return ForkHelper


def prepare_environment(timeout: float) -> None:
    """Before torch's test modules are imported: tcp:// rendezvous, the per-test timeout
    (read by common_distributed at import), and a secret for rpc_core's ranks."""
    os.environ["RPC_INIT_WITH_TCP"] = "1"
    os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"  # its hint names a file that does not exist here
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(int(timeout))
    os.environ.setdefault("RPC_CORE_AUTH_SECRET", os.urandom(16).hex())


def test_classes(lib: str, suites: list[str]) -> dict[str, dict[str, Any]]:
    """{suite: {class name: runnable class}} for ``lib``."""
    if lib not in LIBS:
        raise ValueError(f"lib={lib!r}: expected one of {LIBS}")
    fixture, helper = _fixture(lib), _fork_helper()
    out: dict[str, dict[str, Any]] = {}
    for suite in suites:
        module_name, class_names = SUITES[suite]
        module = importlib.import_module(module_name)
        out[suite] = {}
        for name in class_names:
            base = getattr(module, name)
            cls = type(f"{lib}_{name}", (base, fixture, helper), {"__module__": __name__})
            # Found by name when a test pickles itself into an RPC (test_my_parameter_server).
            setattr(sys.modules[__name__], cls.__name__, cls)
            out[suite][name] = cls
    return out


def test_names(cls: Any) -> list[str]:
    return sorted(n for n in dir(cls) if n.startswith("test") and callable(getattr(cls, n)))
