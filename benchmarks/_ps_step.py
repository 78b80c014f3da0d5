"""CPU per training step of ps_train, trainer and server apart, and where it goes.

``measure`` runs ps_train's MLP 1+1 (e2e_bench's config: synthetic MNIST-sized data, batch 32,
SGD, sync mode with the update riding on the backward, ps_train's defaults on rpc_core) in two
spawned processes that each run ``ps_train.launch.rank.run_rank``, as the local launcher does.
The trainer counts its ``train_step`` calls: after ``warm`` steps it reads both processes' CPU
time (the sum of every thread's on-CPU nanoseconds, ``/proc/<pid>/task/*/schedstat``), again
``steps`` steps later; the difference over ``steps`` is each role's CPU per step. CPU time does
not grow with the machine's load the way wall time does (a busy machine still stretches it a
little through cache and frequency effects), so it compares runs made at different moments.

With ``profile``, a second window of ``steps`` steps runs under yappi (CPU clock, every thread,
builtins included) in both processes; its self time by category (``CATEGORIES``), as shares of
the profiled window, is scaled to the unprofiled CPU per step. yappi slows Python calls more
than C calls, so a category's share is an estimate; the Python calls per step it counts are
exact.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (label, test on "path:function"): the first that matches names a function's category.
# Builtins (C functions) have no path: yappi names them like "<method 'acquire' of ...>".
CATEGORIES = (
    ("pickle dumps/loads (C)", lambda p, f: p == "" and ("dumps" in f or "loads" in f or "Pickler" in f)),
    ("socket and select calls (C)", lambda p, f: p == "" and any(w in f for w in ("socket", "select", "poll"))),
    ("locks and waits (C)", lambda p, f: p == "" and any(w in f for w in ("lock", "acquire", "release", "wait"))),
    ("torch ops and other C calls", lambda p, f: p == ""),
    ("rpc_core/protocol (encoding)", lambda p, f: "/rpc_core/protocol/" in p),
    ("rpc_core/transport (frames, sockets)", lambda p, f: "/rpc_core/transport/" in p),
    ("rpc_core/agent (calls, dispatch, futures)", lambda p, f: "/rpc_core/agent/" in p),
    ("rpc_core/autograd (contexts, send/recv)", lambda p, f: "/rpc_core/autograd/" in p),
    ("rpc_core, other (rref, api, functions)", lambda p, f: "/rpc_core/" in p),
    ("ps_train (step, server, mode)", lambda p, f: "/ps_train/" in p),
    ("torch's Python (optimizer, autograd, nn)", lambda p, f: "/torch/" in p),
    ("threading and queue (Python)", lambda p, f: p.endswith(("/threading.py", "/queue.py"))),
    ("other Python", lambda p, f: True),
)


TOP = 40  # functions kept per role, by self time


def category(path: str, func: str) -> str:
    for label, test in CATEGORIES:
        if test(path, func):
            return label
    raise AssertionError("the last category takes everything")


def process_cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every live thread of ``pid`` (ended threads' time is lost: the
    roles' threads live for the whole run)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # the thread ended meanwhile
            continue
    return total


@dataclass
class Window:
    """One window's CPU per step (µs) of each role, and its wall time per step."""

    steps: int
    trainer_us: float
    server_us: float
    wall_us: float


@dataclass
class StepCpu:
    """A run's unprofiled windows and, profiled, each role's self time per category (µs per
    step, as shares of the profiled window scaled to the median window's CPU), its Python
    calls per step, and the functions with the most self time."""

    windows: list[Window]
    by_category: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> category -> µs
    py_calls: dict[str, float] = field(default_factory=dict)  # role -> Python calls per step
    # role -> (µs per step, calls per step, "path:function"), the most self time first
    top: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)

    def median(self, role: str) -> float:
        values = sorted(getattr(w, f"{role}_us") for w in self.windows)
        return values[len(values) // 2]


# -- in the roles --------------------------------------------------------------------------------------------------
def profile_start() -> None:
    import yappi

    yappi.clear_stats()
    yappi.set_clock_type("cpu")
    yappi.start(builtins=True, profile_threads=True)


def profile_stop() -> dict[str, Any]:
    """Self CPU seconds by category and the number of Python calls since ``profile_start``."""
    import yappi

    yappi.stop()
    dump = os.environ.get("PS_STEP_PSTATS")  # a folder: each role's whole profile, pstats format
    if dump:
        yappi.get_func_stats().save(os.path.join(dump, f"{os.getpid()}.pstats"), type="pstat")
    by_cat: dict[str, float] = defaultdict(float)
    calls = 0
    funcs: list[tuple[float, int, str]] = []
    for s in yappi.get_func_stats():
        builtin = bool(s.builtin)
        path = "" if builtin else s.module
        by_cat[category(path, s.name)] += s.tsub
        funcs.append((s.tsub, s.ncall, f"{os.path.relpath(path, REPO) if path else ''}:{s.name}"))
        if not builtin:
            calls += s.ncall
    yappi.clear_stats()
    funcs.sort(reverse=True)
    return {"self_s": dict(by_cat), "py_calls": calls, "top": funcs[:TOP]}


def _role(cfg: Any, rank: int, port: int, secret: str, run_dir: str, server_pid: int, plan: dict, queue: Any) -> None:
    import ps_train.app  # noqa: F401 - registers the built-in workloads
    from ps_train.launch.rank import run_rank

    if rank == 1:
        _count_steps(server_pid, plan, queue)
    run_rank(cfg, rank, "127.0.0.1", port, secret, run_dir)


def _count_steps(server_pid: int, plan: dict, queue: Any) -> None:
    """Wrap the trainer's ``train_step``: read both roles' CPU at the windows' edges."""
    from ps_train import backend
    from ps_train.roles.step import StepTrainer

    original = StepTrainer.train_step
    warm, steps, windows = plan["warm"], plan["steps"], plan["windows"]
    edges = [warm + k * steps for k in range(windows + 1)]
    prof_start = edges[-1] + 1 if plan["profile"] else -1
    prof_end = prof_start + steps if plan["profile"] else -1
    count = [0]
    last: list[tuple[int, int, float]] = []

    def mark() -> tuple[int, int, float]:
        return process_cpu_ns(os.getpid()), process_cpu_ns(server_pid), time.perf_counter()

    def train_step(self: StepTrainer, batch: Any) -> dict[str, float]:
        k = count[0]
        count[0] += 1
        if k in edges:
            now = mark()
            if last:
                queue.put(("window", last[0], now, steps))
            last[:] = [now]
        elif k == prof_start:  # the server first, so its share is whole
            backend.rpc().rpc_sync("ps0", profile_start)
            profile_start()
        elif k == prof_end:
            mine = profile_stop()
            queue.put(("profile", {"trainer": mine, "server": backend.rpc().rpc_sync("ps0", profile_stop)}))
        return original(self, batch)

    StepTrainer.train_step = train_step  # type: ignore[method-assign]


# -- one process ---------------------------------------------------------------------------------------------------
def _single(steps: int, windows: int, warm: int, out: Any) -> None:
    """Child: e2e_bench's one-process MLP (``benchmarks._e2e_runs.single_main``'s loop), its
    CPU per step over ``windows`` windows of ``steps`` steps after ``warm``."""
    import torch
    import torch.nn.functional as F

    from benchmarks._e2e_runs import make_config
    from ps_train.config import optimizer_spec
    from ps_train.workloads.vision.data import BatchIterator, load_data
    from ps_train.workloads.vision.models import build_stages, reference_model

    torch.set_num_threads(1)
    cfg = make_config("mlp", 1, 1, "rpc_core", steps)
    train_set, _ = load_data(cfg.data)
    net = reference_model(build_stages(cfg.model, cfg.data.sample_shape(), cfg.data.class_count(), seed=cfg.seed))
    cls, kwargs = optimizer_spec(cfg.optim)
    opt = cls(net.parameters(), **kwargs)
    batches = BatchIterator(train_set, 0, 1, cfg.train.batch_size, cfg.seed)

    def step() -> None:
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        (logits.detach().argmax(1) == y).float().mean().item()
        loss.item()

    for _ in range(warm):
        step()
    found = []
    for _ in range(windows):
        c0, w0 = process_cpu_ns(os.getpid()), time.perf_counter()
        for _ in range(steps):
            step()
        found.append(((process_cpu_ns(os.getpid()) - c0) / steps / 1e3, (time.perf_counter() - w0) / steps * 1e6))
    out.put(found)


def measure_single(steps: int, windows: int = 3, warm: int = 200, timeout: float = 600.0) -> list[tuple[float, float]]:
    """(CPU µs, wall µs) per step of the one-process MLP, per window."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_single, args=(steps, windows, warm, q), daemon=True)
    p.start()
    try:
        found: list[tuple[float, float]] = q.get(timeout=timeout)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return found


# -- the launcher --------------------------------------------------------------------------------------------------
def measure(steps: int, windows: int = 3, warm: int = 200, profile: bool = False, timeout: float = 900.0) -> StepCpu:
    """Run ps_train's MLP 1+1: ``windows`` unprofiled windows of ``steps`` steps each, then
    (``profile``) one profiled window."""
    from benchmarks._e2e_runs import make_config

    total = warm + windows * steps + (steps + 2 if profile else 0) + 2
    cfg = make_config("mlp", 1, 1, "rpc_core", total, update_in_backward=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    secret = secrets.token_hex(16)
    plan = {"warm": warm, "steps": steps, "windows": windows, "profile": profile}
    found: list[Window] = []
    prof: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="ps_step_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        server = ctx.Process(target=_role, args=(cfg, 0, port, secret, d, 0, plan, queue))
        server.start()
        trainer = ctx.Process(target=_role, args=(cfg, 1, port, secret, d, server.pid, plan, queue))
        trainer.start()
        deadline = time.monotonic() + timeout
        while (len(found) < windows or (profile and prof is None)) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in (server, trainer)):
                break
            try:
                msg = queue.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - Empty: look at the processes again
                continue
            if msg[0] == "window":
                _, (t0, s0, w0), (t1, s1, w1), n = msg
                found.append(Window(n, (t1 - t0) / n / 1e3, (s1 - s0) / n / 1e3, (w1 - w0) / n * 1e6))
            elif msg[0] == "profile":
                prof = msg[1]
        for p in (trainer, server):
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    if len(found) < windows or (profile and prof is None):
        raise SystemExit(
            f"ps_train MLP 1+1 failed before it measured (exit codes {trainer.exitcode}, {server.exitcode})"
        )
    out = StepCpu(found)
    if prof is not None:
        for role in ("trainer", "server"):
            own, p = out.median(role), prof[role]
            total_s = sum(p["self_s"].values()) or 1.0
            out.by_category[role] = {c: own * t / total_s for c, t in p["self_s"].items()}
            out.py_calls[role] = p["py_calls"] / steps
            out.top[role] = [(own * t / total_s, n / steps, name) for t, n, name in p["top"]]
    return out
