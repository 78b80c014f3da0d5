"""Shared checks for rpc_core tests that run in the pytest process itself."""

import pytest


@pytest.fixture(autouse=True)
def _no_agent_left_behind():
    """A test that runs rpc_core in this process must leave it uninitialized."""
    yield
    from rpc_core.agent import agent

    if agent._agent is not None:
        import rpc_core

        rpc_core.shutdown(graceful=False)
        pytest.fail("the test left an rpc_core agent running in the pytest process")
