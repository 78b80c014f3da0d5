"""A torch.distributed.rpc program that meets the errors a ported program meets, and reports
what its handlers saw. Written against torch's API names only: test_torch_compat.py runs it
as it is (torch, the oracle) and with its RPC imports swapped for rpc_core's, and compares
the reports.

Each scenario returns a dict of plain values. ``attempt`` is the program's error handling:
``except RuntimeError`` (or the class torch raises) and a regex over the message, as
torch's own tests and programs written for it match errors; it reports whether the handler
caught the error and the message matched. Rank 0 runs the scenarios; rank 1 serves them.
``PRE_INIT`` scenarios run in one process that never initializes RPC.
"""

import io
import re
import sys
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef

EXPECTED = "Expected error"
CONSTANTS = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_PROCESS_GROUP_TIMEOUT",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
]
BOUND = 30.0  # s: the longest the program waits for a wait_all that should return at once


def attempt(fn, handled, pattern):
    """Run ``fn`` as a program that catches ``handled`` and matches ``pattern`` would."""
    try:
        fn()
    except handled as e:
        if re.search(pattern, str(e)):
            return f"caught {handled.__name__}"
        return f"caught {handled.__name__}, message differs: {str(e)[:300]!r}"
    except Exception as e:  # noqa: BLE001 - what escaped the handler is the finding
        return f"escaped: {type(e).__name__}: {str(e)[:300]!r}"
    return "no error"


# -- functions the scenarios call on worker1 ---------------------------------------------------------
_release = threading.Event()
_stderr = io.StringIO()


class _Tee(io.TextIOBase):
    """worker1's sys.stderr: what is printed or logged there, kept for the logging scenario."""

    def __init__(self, real):
        self.real = real

    def write(self, s):
        _stderr.write(s)
        return self.real.write(s)

    def flush(self):
        self.real.flush()


def raise_now():
    raise ValueError(EXPECTED)


def wait_for_release():
    _release.wait(60)
    return "released"


def release():
    _release.set()


def captured_stderr():
    return _stderr.getvalue()


@rpc.functions.async_execution
def async_wrong_type():
    return torch.zeros(2, 2)


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, by):
        self.count += by
        return self.count

    def fails(self):
        raise ValueError(EXPECTED)

    @staticmethod
    def describe():
        return "Counter"


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2

    @torch.jit.export
    def triple(self, x):
        return x * 3


def scripted_doubler():
    return torch.jit.script(Doubler())


class SimulateBackwardError(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise Exception("Simulate error on backward pass")


def double_with_failing_backward(t):
    return SimulateBackwardError.apply(t)


# -- scenarios: before init_rpc --------------------------------------------------------------------------
def before_init():
    not_initialized = "^RPC has not been initialized"
    agent_not_set = "Current RPC agent is not set! Did you initialize the RPC framework"
    return {
        "rpc_sync": attempt(lambda: rpc.rpc_sync("worker1", torch.add, args=(1, 2)), RuntimeError, not_initialized),
        "rpc_async": attempt(lambda: rpc.rpc_async("worker1", torch.add, args=(1, 2)), RuntimeError, not_initialized),
        "remote": attempt(lambda: rpc.remote("worker1", torch.add, args=(1, 2)), RuntimeError, not_initialized),
        "get_worker_info": attempt(rpc.get_worker_info, RuntimeError, not_initialized),
        "shutdown": attempt(rpc.shutdown, RuntimeError, not_initialized),
        "RRef": attempt(lambda: RRef(1), RuntimeError, agent_not_set),
        "get_rpc_timeout": attempt(rpc.get_rpc_timeout, RuntimeError, agent_not_set),
        "dist_autograd.context": attempt(
            lambda: dist_autograd.context().__enter__(), RuntimeError, "Need to initialize distributed autograd"
        ),
    }


def invalid_arguments(port):
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    return {
        "num_worker_threads": attempt(
            lambda: rpc.TensorPipeRpcBackendOptions(num_worker_threads=0),
            RuntimeError,
            "num_worker_threads must be positive",
        ),
        "rpc_timeout": attempt(
            lambda: rpc.TensorPipeRpcBackendOptions(rpc_timeout=-5), RuntimeError, "RPC Timeout must be non-negative"
        ),
        "abc*": attempt(lambda: rpc.WorkerInfo("abc*", 0), RuntimeError, "Worker name must match"),
        "space": attempt(lambda: rpc.WorkerInfo(" ", 0), RuntimeError, "Worker name must match"),
        "empty": attempt(lambda: rpc.WorkerInfo("", 0), RuntimeError, "must be non-empty"),
        "long": attempt(lambda: rpc.WorkerInfo("a" * 500, 0), RuntimeError, "shorter than 128"),
        "init_rpc": attempt(
            lambda: rpc.init_rpc("abc*", rank=0, world_size=1, rpc_backend_options=options),
            RuntimeError,
            "Worker name must match",
        ),
    }


def constants():
    return {name: getattr(rpc.constants, name) for name in CONSTANTS}


# -- scenarios: rank 0, with worker1 serving ------------------------------------------------------------
def wait_all_with_a_failed_call():
    """One call fails at once, the other runs until released: torch.futures.wait_all raises
    the failure without waiting for the other (torch's docs: it "will exit early"), and
    collect_all's future fails with it. Reports whether the other call was done when each
    raised (it is released only after both did, or after BOUND s)."""
    slow = rpc.rpc_async("worker1", wait_for_release)
    bad = rpc.rpc_async("worker1", raise_now)
    seen = {}

    def waiter():
        seen["wait_all"] = attempt(lambda: torch.futures.wait_all([slow, bad]), ValueError, EXPECTED)
        seen["slow done when wait_all raised"] = slow.done()
        seen["collect_all"] = attempt(lambda: torch.futures.collect_all([slow, bad]).wait(), ValueError, EXPECTED)
        seen["slow done when collect_all raised"] = slow.done()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    t.join(BOUND)
    rpc.rpc_sync("worker1", release)
    t.join(60)
    # Both ended now: collect_all's future raises the failure as well.
    seen["collect_all, both ended"] = attempt(
        lambda: torch.futures.collect_all([slow, bad]).wait(), ValueError, EXPECTED
    )
    seen["slow"] = slow.wait()
    return seen


def failed_futures():
    """A failed call's future through then(), collect_all and an RRef whose creation failed."""
    out = {}
    fut = rpc.rpc_async("worker1", raise_now)
    out["wait"] = attempt(fut.wait, ValueError, EXPECTED)
    out["wait again"] = attempt(fut.wait, ValueError, EXPECTED)
    callback_error = f"(?s)^Got the following error when running the callback: ValueError: .*{EXPECTED}"
    out["then, callback waits"] = attempt(fut.then(lambda f: f.wait()).wait, RuntimeError, callback_error)

    def handled_in_callback(f):
        try:
            f.wait()
        except ValueError as e:
            return "callback caught ValueError" if EXPECTED in str(e) else str(e)
        return "no error"

    out["then, callback catches"] = fut.then(handled_in_callback).wait()
    failed = rpc.remote("worker1", raise_now)
    out["remote: to_here"] = attempt(failed.to_here, ValueError, EXPECTED)
    out["remote: _get_type"] = attempt(failed._get_type, ValueError, EXPECTED)
    out["remote: proxy"] = attempt(lambda: failed.rpc_sync().increment(1), ValueError, EXPECTED)
    out["remote: proxy async"] = attempt(lambda: failed.rpc_async().increment(1).wait(), ValueError, EXPECTED)
    return out


def async_execution_wrong_type():
    pattern = r"Functions decorated with @rpc\.async_function must return a torch\.futures\.Future object,"
    return {
        "rpc_sync": attempt(lambda: rpc.rpc_sync("worker1", async_wrong_type), RuntimeError, pattern),
        "rpc_async": attempt(lambda: rpc.rpc_async("worker1", async_wrong_type).wait(), RuntimeError, pattern),
        "remote": attempt(lambda: rpc.remote("worker1", async_wrong_type).to_here(), RuntimeError, pattern),
    }


def distributed_backward_errors():
    """torch's test_backward_autograd_engine_error, and the same with the failing backward on worker1."""
    out = {}
    pattern = "Error on Node [0-9]+: Simulate error on backward pass"
    with dist_autograd.context() as context_id:
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        tmp = (t1 + t2) * (t1 + t2)
        t3 = SimulateBackwardError.apply(tmp)
        val = rpc.rpc_sync("worker1", torch.add, args=(t2, t3))
        val = rpc.rpc_sync("worker1", torch.mul, args=(val, t2))
        out["raised here"] = attempt(lambda: dist_autograd.backward(context_id, [val.sum()]), RuntimeError, pattern)
    with dist_autograd.context() as context_id:
        t = torch.rand((3, 3), requires_grad=True)
        val = rpc.rpc_sync("worker1", double_with_failing_backward, args=(t,))
        out["raised on worker1"] = attempt(
            lambda: dist_autograd.backward(context_id, [val.sum()]), RuntimeError, pattern
        )
    return out


def local_value_on_a_user():
    rref = rpc.remote("worker1", torch.add, args=(torch.ones(1), torch.ones(1)))
    pattern = (
        r"For UserRRef\(rref_id=GloballyUniqueId\(created_on=0, local_id=\d+\), "
        r"fork_id=GloballyUniqueId\(created_on=0, local_id=\d+\)\), can't call localValue\(\) on user "
        r"WorkerInfo\(id=0, name=worker0\)\. Call it on owner WorkerInfo\(id=1, name=worker1\)"
    )
    return {"local_value": attempt(rref.local_value, RuntimeError, pattern)}


def rref_proxies():
    """A missing method fails from the RRef's type, before any call (the first ``rpc_async()``
    asks the owner for the type; later uses know it), as torch's test_rref_proxy_non_exist."""
    counter = rpc.remote("worker1", Counter)
    missing = "has no attribute 'non_exist'"
    out = {"first rpc_async": attempt(lambda: counter.rpc_async().non_exist().wait(), AttributeError, missing)}
    out["rpc_sync"] = attempt(lambda: counter.rpc_sync().non_exist(), AttributeError, missing)
    fut = counter.rpc_async().non_exist()
    out["rpc_async: future done at once"] = fut.done()
    out["rpc_async"] = attempt(fut.wait, AttributeError, missing)
    out["remote"] = attempt(lambda: counter.remote().non_exist(), AttributeError, missing)
    out["method raises"] = attempt(lambda: counter.rpc_sync().fails(), ValueError, EXPECTED)
    out["calls"] = [
        counter.rpc_sync().increment(1),
        counter.rpc_async().increment(2).wait(),
        counter.remote().increment(3).to_here(),
        counter.rpc_sync().describe(),
    ]
    # A scripted module's methods are not attributes of its type: not checked, as on torch.
    scripted = rpc.remote("worker1", scripted_doubler)
    out["scripted"] = [
        scripted.rpc_sync().forward(torch.ones(2)).tolist(),
        scripted.rpc_async().triple(torch.ones(2)).wait().tolist(),
    ]
    # Each on an RRef of its own: torch's handle keeps what its first _get_type returned
    # (a Future for blocking=False, which its proxies use) and returns that ever after.
    out["_get_type"] = [
        rpc.remote("worker1", Counter)._get_type().__name__,
        rpc.remote("worker1", Counter)._get_type(blocking=False).wait().__name__,
    ]
    return out


def callee_logs_the_error():
    """torch prints a called function's exception on the callee, with a traceback."""
    attempt(lambda: rpc.rpc_sync("worker1", raise_now), ValueError, EXPECTED)
    text = rpc.rpc_sync("worker1", captured_stderr)
    return {
        "function named": "raise_now" in text,
        "error": "ValueError" in text and EXPECTED in text,
        "traceback": "Traceback (most recent call last)" in text,
    }


def after_shutdown():
    return {
        "rpc_sync": attempt(
            lambda: rpc.rpc_sync("worker1", torch.add, args=(1, 2)), RuntimeError, "^RPC has not been initialized"
        )
    }


SCENARIOS = [
    wait_all_with_a_failed_call,
    failed_futures,
    async_execution_wrong_type,
    distributed_backward_errors,
    local_value_on_a_user,
    rref_proxies,
    callee_logs_the_error,
]


def backward_past_an_unused_send(seconds=30):
    """torch's test_backward_unused_send_function: the result of an RPC is not used and the
    loss is computed locally. torch's backward waits for that send's gradient forever (its
    test asserts it is still running after 10 s); reports whether backward finished within
    ``seconds`` with the local gradients."""
    done = threading.Event()

    def run():
        with dist_autograd.context() as context_id:
            t1 = torch.rand((3, 3), requires_grad=True)
            t2 = torch.rand((3, 3), requires_grad=True)
            rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
            val = torch.mul(t1, t2)
            dist_autograd.backward(context_id, [val.sum()])
            grads = dist_autograd.get_gradients(context_id)
            if torch.equal(grads[t1], t2) and torch.equal(grads[t2], t1):
                done.set()

    threading.Thread(target=run, daemon=True).start()
    return {"finished": done.wait(seconds)}


def run_worker(rank, world_size, scenarios):
    """Rank 0 runs ``scenarios`` (names) and returns {name: report}; the others serve."""
    if rank == 1:
        sys.stderr = _Tee(sys.stderr)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    out = {}
    if rank == 0:
        start = time.monotonic()
        for name in scenarios:
            out[name] = globals()[name]()
        out["seconds"] = time.monotonic() - start
    rpc.shutdown()
    if rank == 0:
        out["after_shutdown"] = after_shutdown()
    return out
