"""rpc_core.memory: glibc's malloc thresholds are fixed so a worker reuses freed tensor
memory instead of faulting it back in every step. Each case runs in a fresh interpreter
(the setting is process-wide), counting minor page faults (getrusage) as the oracle."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies to glibc's malloc only")

# A CNN server's step: forward + backward on a worker thread, the graph kept until the next
# step (as a distributed autograd context keeps it until the next request releases it).
_STEPS = textwrap.dedent("""
    import resource, sys, threading, torch
    torch.set_num_threads(1)
    import rpc_core.memory
    tuned = rpc_core.memory.tune()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(64 * 7 * 7, 10))
    params = list(net.parameters())
    x = torch.randn(32, 1, 28, 28)
    out = []
    def steps(n):
        kept = None
        for _ in range(n):
            y = net(x)
            torch.autograd.grad(y.sum(), params, retain_graph=True)
            kept = y
        return kept
    def worker():
        steps(15)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        steps(20)
        out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    print(tuned, out[0])
""")


def _faults_per_step(**env_overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(env_overrides)
    proc = subprocess.run([sys.executable, "-c", _STEPS], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tuned, faults = proc.stdout.split()
    return tuned == "True", float(faults)


def test_tuned_malloc_reuses_freed_tensor_memory_instead_of_faulting_it_back():
    tuned, with_tuning = _faults_per_step()
    untouched, without = _faults_per_step(RPC_CORE_MALLOC_TUNE="0")
    assert tuned and not untouched
    # glibc's defaults trim and re-map the step's activations: hundreds of faults per step.
    assert with_tuning * 10 < without, (with_tuning, without)


def test_a_malloc_setting_of_the_users_own_is_left_alone():
    tuned, _ = _faults_per_step(MALLOC_ARENA_MAX="2", MALLOC_TRIM_THRESHOLD_="131072")
    assert not tuned
