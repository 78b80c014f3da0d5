"""What the comparison leaves out, what it explains, and the quick subset.

EXCLUDED: tests not run at all, each needing CUDA or TorchScript RPC (the only grounds).
Tests that fail on rpc_core because a TorchScript function cannot be compiled against its
types are found at run time (``routing.NeedsTorchScript``) and reported as excluded too.
TORCH_PRIVATE: tests torch passes that rpc_core fails because they touch a torch-private
object, with the object and why rpc_core does not emulate it.
DIFFERS: tests torch passes that assert a behaviour rpc_core changes on purpose.
"""

from __future__ import annotations

_CUDA = "needs CUDA (device maps, CUDA tensors)"

EXCLUDED: dict[str, str] = {
    "rpc.TensorPipeAgentRpcTest.test_dynamic_rpc_existing_rank_can_communicate_with_new_rank_cuda": _CUDA,
}

TORCH_PRIVATE: dict[str, str] = {}

DIFFERS: dict[str, str] = {
    "dist_autograd.DistAutogradTest.test_backward_unused_send_function": (
        "asserts that torch's backward is still running after 10 s (its FAST mode waits forever for the "
        "gradient of a send the loss did not use); rpc_core's backward ends with the local gradients "
        "(tests/rpc_core/test_torch_compat.py::test_backward_past_an_unused_send_finishes)"
    ),
}

# The representative subset (`--quick`, and tests/torch_suite/test_quick.py): one or two per
# suite, each a few seconds; calls, RRefs, profiling names, dist autograd, the optimizer, the
# examples.
QUICK: tuple[str, ...] = (
    "rpc.RpcTest.test_self_add",
    "rpc.RpcTest.test_rref_proxy_class",
    "rpc.RpcTest.test_profiler_remote_events_profiled",
    "dist_autograd.DistAutogradTest.test_backward_simple",
    "dist_autograd.DistAutogradTest.test_no_grad_copy",
    "dist_optimizer.DistOptimizerTest.test_dist_optim",
    "parameter_server.ParameterServerTest.test_batch_updating_parameter_server",
    "reinforcement_learning.ReinforcementLearningRpcTest.test_rl_rpc",
    "remote_module.RemoteModuleTest.test_forward_sync",
)
