"""rpc_core.memory: glibc's malloc thresholds are fixed so a worker reuses freed tensor
memory instead of faulting it back in every step. Each case runs in a fresh interpreter
(the setting is process-wide), all of them side by side, counting each one's own minor page
faults (getrusage) as the oracle."""

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


def _start(**env_overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(env_overrides)
    return subprocess.Popen(
        [sys.executable, "-c", _STEPS], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _faults_per_step(proc):
    """(whether rpc_core tuned malloc, minor page faults per step) of a ``_start``ed case."""
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    tuned, faults = out.split()
    return tuned == "True", float(faults)


@pytest.fixture(scope="module")
def cases():
    """Every case's interpreter at once (each counts its own page faults, RUSAGE_SELF; most of
    its time is importing torch on one core): name -> ``_faults_per_step``."""
    procs = {
        "default": _start(),
        "turned_off": _start(RPC_CORE_MALLOC_TUNE="0"),
        "users_own": _start(MALLOC_ARENA_MAX="2", MALLOC_TRIM_THRESHOLD_="131072"),
    }
    try:
        return {name: _faults_per_step(p) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_tuned_malloc_reuses_freed_tensor_memory_instead_of_faulting_it_back(cases):
    tuned, with_tuning = cases["default"]
    untouched, without = cases["turned_off"]
    assert tuned and not untouched
    # glibc's defaults trim and re-map the step's activations: hundreds of faults per step.
    assert with_tuning * 10 < without, (with_tuning, without)


def test_a_malloc_setting_of_the_users_own_is_left_alone(cases):
    tuned, _ = cases["users_own"]
    assert not tuned


# Twelve threads that each allocate and free tensors: glibc gives each new thread an arena of
# its own up to its limit (eight per core), so the count of arenas shows the cap.
_ARENAS = textwrap.dedent("""
    import ctypes, re, sys, tempfile, threading, torch
    import rpc_core.memory
    tuned = rpc_core.memory.tune()
    def work():
        for _ in range(5):
            del [torch.ones(256, 1024) for _ in range(8)][:]
    threads = [threading.Thread(target=work) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        arenas = len(re.findall(r'<heap nr="', open(f.name).read()))
    print(tuned, arenas, rpc_core.memory.arena_max())
""")


@pytest.mark.timeout(180)
def test_tuned_malloc_caps_the_arenas_that_keep_free_memory():
    def run(**env_overrides):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        env.update(env_overrides)
        out = subprocess.run(
            [sys.executable, "-c", _ARENAS], env=env, capture_output=True, text=True, timeout=150, check=True
        ).stdout.split()
        return out[0] == "True", int(out[1]), int(out[2])

    tuned, arenas, cap = run()
    untuned, arenas_untuned, _ = run(RPC_CORE_MALLOC_TUNE="0")
    assert tuned and not untuned
    assert arenas <= cap < arenas_untuned, (arenas, cap, arenas_untuned)


# A process whose tensors are tens of MB passes lower thresholds: a 4 MiB tensor then gets a
# mapping of its own (handed back when freed) instead of a piece of a heap. malloc_info counts
# the live mappings.
_THRESHOLDS = textwrap.dedent("""
    import ctypes, re, sys, tempfile, torch
    import rpc_core.memory
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    def mappings():
        with tempfile.NamedTemporaryFile(suffix=".xml") as f:
            fp = libc.fopen(f.name.encode(), b"w")
            libc.malloc_info(0, fp)
            libc.fclose(fp)
            return int(re.findall(r'<total type="mmap" count="(\\d+)"', open(f.name).read())[-1])
    low = sys.argv[1] == "low"
    first = rpc_core.memory.tune(1 << 20, 32 << 20) if low else rpc_core.memory.tune()
    again = rpc_core.memory.tune()  # as init_rpc calls it after a launcher's call
    before = mappings()
    x = torch.ones(1 << 20)  # 4 MiB
    print(first, again, *rpc_core.memory.thresholds(), mappings() - before)
""")


@pytest.mark.timeout(180)
def test_lower_thresholds_map_large_tensors_apart_and_the_first_call_keeps_them():
    def run(which):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        out = subprocess.run(
            [sys.executable, "-c", _THRESHOLDS, which], env=env, capture_output=True, text=True, timeout=150, check=True
        ).stdout.split()
        return out[0] == "True", out[1] == "True", int(out[2]), int(out[3]), int(out[4])

    assert run("low") == (True, True, 1 << 20, 32 << 20, 1)
    assert run("default") == (True, True, 32 << 20, 64 << 20, 0)


def test_thresholds_outside_glibcs_range_are_refused():
    import rpc_core.memory

    with pytest.raises(ValueError, match="mmap_threshold"):
        rpc_core.memory.tune(mmap_threshold=1024)
    with pytest.raises(ValueError, match="trim_threshold"):
        rpc_core.memory.tune(trim_threshold=1 << 30)
