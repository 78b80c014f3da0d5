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
    # Not run: its ranks wait for each other until the timeout once the TorchScript call fails.
    "dist_autograd.DistAutogradTest.test_trainer_ps_torchscript_functions": (
        "needs TorchScript RPC: a `@torch.jit.script` function taking an `RRef[Tensor]` (`my_script_ref_add`)"
    ),
    "remote_module.ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire_script_not_supported": (
        "needs TorchScript RPC: a scriptable RemoteModule (`_module_interface_cls`)"
    ),
}

_WAIT_ALL = (
    "`torch.distributed.rpc.api._wait_all`: a private context manager that collects the futures of the "
    "`rpc_async` calls made inside it through the thread-local `_thread_local_var` and waits for them; "
    "rpc_core has no such thread-local list (wait on the futures, or `torch.futures.wait_all`)"
)
_GRAPH = (
    "inspects torch's C++ autograd nodes of distributed autograd by their C++ names "
    "(`SendRpcBackward`, `torch::distributed::autograd::RecvRpcBackward`) through "
    "`DistAutogradContext._send_functions()`: rpc_core keeps a send as its list of tensors and a recv as "
    "a Python autograd Function, with the same gradients (the backward tests above compare them with local "
    "autograd)"
)
# The tests that inspect those nodes, each with a dense and a sparse (``_sparse``) variant.
_GRAPH_TESTS = (
    "graph_for_builtin_call",
    "graph_for_builtin_remote_call",
    "graph_for_py_nested_call",
    "graph_for_py_nested_call_itself",
    "graph_for_py_nested_remote_call",
    "graph_for_py_nested_remote_call_itself",
    "graph_for_python_call",
    "graph_for_python_remote_call",
    "remote_complex_args",
    "rpc_complex_args",
)
TORCH_PRIVATE: dict[str, str] = {
    "rpc.RpcTest.test_duplicate_name": (
        "`torch.distributed.rpc._init_rpc_backend` over a c10d store from `torch.distributed.rendezvous`: "
        "rpc_core's rendezvous is its own (`init_method`) and takes no c10d store; the same 'is not unique' "
        "error through the public `init_rpc` is `test_duplicate_name_2`, which passes"
    ),
    "rpc.RpcTest.test_py_nested_pickle": (
        "`torch.distributed.rpc.internal.PythonUDF` and `_internal_rpc_pickler`: torch's internal pickler "
        "and message types"
    ),
    "rpc.RpcTest.test_use_rpc_pickler": "`torch.distributed.rpc.api._use_rpc_pickler`: torch's internal pickler",
    "rpc.RpcTest.test_use_rref_after_shutdown": (
        "`torch.distributed.rpc.internal.serialize` (torch's internal pickler) on a deleted RRef; the "
        "`to_here()` part of the test passes the same message"
    ),
    "rpc.RpcTest.test_register_rpc_backend_and_set_and_start_rpc_backend": (
        "`torch.distributed.rpc.backend_registry.register_backend` and `mock.patch` of "
        "`rpc.api._set_and_start_rpc_agent` / `dist_autograd._init`: torch's backend registry and C++ "
        "bindings; rpc_core has one backend"
    ),
    "rpc.RpcTest.test_server_process_global_profiler": (
        "`torch.distributed.rpc._server_process_global_profile`: torch's server-side profiler "
        "(docs/torch_compatibility.md: not supported; callees' events come back with the caller's profile)"
    ),
    "rpc.RpcTest.test_shutdown_errors": (
        "monkey-patches `rpc.api._broadcast_to_followers` and `_delete_all_user_and_unforked_owner_rrefs`, "
        "torch's shutdown internals"
    ),
    "rpc.RpcTest.test_rref_leak": (
        "`mock.patch` of `rpc.api._delete_all_user_and_unforked_owner_rrefs` and `api._ignore_rref_leak`: "
        "torch raises 'Leaking RRef' from its shutdown internals; rpc_core's shutdown releases every RRef"
    ),
    "rpc.RpcTest.test_wait_all": _WAIT_ALL,
    "rpc.RpcTest.test_wait_all_multiple_call": _WAIT_ALL,
    "rpc.RpcTest.test_wait_all_raise_in_body": _WAIT_ALL,
    "rpc.RpcTest.test_wait_all_raise_in_user_func": _WAIT_ALL,
    "rpc.RpcTest.test_wait_all_timeout": _WAIT_ALL,
    "rpc.RpcTest.test_disable_gil_profiling": (
        "`rpc.enable_gil_profiling` and the agent's `agent.gil_average_wait_time_us`: torch's C++ agent times "
        "its GIL waits (docs/torch_compatibility.md: not supported)"
    ),
    "remote_module.ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire": (
        "`torch.distributed.nn.api.remote_module._REMOTE_MODULE_PICKLED_ATTRIBUTES`: the names of the private "
        "attributes torch's RemoteModule pickles; rpc_core's RemoteModule travels by its own fields "
        "(docs/torch_compatibility.md), and the forward calls through a sent one pass "
        "(`test_create_remote_module_from_module_rref`)"
    ),
    "rpc.TensorPipeAgentRpcTest.test_infer_backend_from_options": (
        "`rpc.TensorPipeAgent`, torch's C++ agent class (docs/torch_compatibility.md: not supported)"
    ),
    **{f"dist_autograd.DistAutogradTest.test_{name}": _GRAPH for name in _GRAPH_TESTS},
    # The same graphs with sparse tensors (their gradients: the *_sparse backward tests).
    **{f"dist_autograd.TensorPipeAgentDistAutogradTest.test_{name}_sparse": _GRAPH for name in _GRAPH_TESTS},
}

DIFFERS: dict[str, str] = {
    "rpc.RpcTest.test_rref_timeout": (
        "a call's own timeout bounds its dial too (docs/rpc_core.md, `RPC_CORE_HANDSHAKE_TIMEOUT`): the test's "
        "`remote()` with a 10 ms timeout is its first call to worker1, and on a loaded machine the connection "
        "is not up within 10 ms, so the request is never sent and worker1 has no owner RRef and no fork (0 and "
        "0, which its debug counters say); `to_here()` raises that the RRef may not exist, as in torch. torch "
        "always sends the request and only stops waiting. It passes when the dial is quicker (alone: 1 owner, 1 "
        "fork)"
    ),
    "rpc.RpcTest.test_cannot_infer_backend_from_options": (
        "rpc_core has one options class (`TensorPipeRpcBackendOptions` is `RpcBackendOptions`, "
        "docs/torch_compatibility.md), so options of a class derived from it are rpc_core's and start it"
    ),
    "rpc.TensorPipeAgentRpcTest.test_mismatched_type_for_options": (
        "rpc_core has one options class (`TensorPipeRpcBackendOptions` is `RpcBackendOptions`), so "
        "options of a class derived from it are accepted"
    ),
    "rpc.RpcTest.test_reinit": (
        "with tcp:// rendezvous torch's rank 0 fails a second `init_rpc` with 'Address already in use' (its "
        "store starts before the check: a TODO in the test); rpc_core's rank 0 raises 'RPC is already "
        "initialized', as every other rank does"
    ),
    "rpc.TensorPipeAgentRpcTest.test_op_with_invalid_args": (
        "torch runs a builtin through TorchScript's operator schemas ('failed to match any schema'); rpc_core "
        "calls the Python function, which raises torch's Python argument error (a TypeError)"
    ),
    "rpc.TensorPipeAgentRpcTest.test_dynamic_rpc_init_rpc_without_rank": (
        "a member of a dynamic group (`world_size=None`) gives its rank to rpc_core's `init_rpc` "
        "(docs/torch_compatibility.md); torch's picks one from its store"
    ),
    "rpc.RpcTest.test_wait_all_exit_early_script_function": (
        "a TorchScript function's error reaches the caller as `torch.jit.Error`, its own class (rpc_core keeps "
        "every remote exception's class); torch's RPC turns it into a RuntimeError, which the test expects"
    ),
    "rpc.RpcTest.test_profiler_export_trace": (
        "rpc_core's `export_chrome_trace` writes the object form of the Trace Event Format "
        "(`{\"traceEvents\": [...]}`, a process row per node), which ps_train's traces merge; torch's legacy "
        "profiler writes the bare array the test iterates. Both open in Perfetto and chrome://tracing"
    ),
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
    "remote_module.ThreeWorkersRemoteModuleTest.test_create_remote_module_from_module_rref",
)
