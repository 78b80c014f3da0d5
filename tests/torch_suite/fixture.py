"""rpc_core's agent fixture for torch's RPC test suites (torch's ``RpcAgentTestFixture`` API).

Imported only after ``routing.install()``: the base class is then torch's fixture as the
routed test modules see it.
"""

from __future__ import annotations

from typing import Any

from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture

import rpc_core


class RpcCoreAgentTestFixture(RpcAgentTestFixture):
    @property
    def rpc_backend(self) -> Any:
        return rpc_core.BackendType.RPC_CORE

    @property
    def rpc_backend_options(self) -> rpc_core.RpcBackendOptions:
        # The secret comes from RPC_CORE_AUTH_SECRET, set once for every rank of the run.
        return rpc_core.RpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self) -> str:
        # torch's TensorPipe fixture accepts any message for a peer that shut down ("the
        # shutdown sequence is not well defined"); so does this one.
        return ".*"

    def get_timeout_error_regex(self) -> str:
        return "RPC ran for more than"
