"""The worker: the agent that serves and makes calls, and the parts it is made of.

    pool.py         the elastic thread pool that runs requests (never starves)
    middleware.py   the hooks of higher layers (RRefs, distributed autograd, the profiler)
    futures.py      the futures calls return, and remote errors rebuilt with their type
    worlds.py       ``WorkerInfo``, and the ``World`` a rendezvous gives
    outbound.py     who reads the answers on an outgoing connection
    roster.py       who is in the group
    deadlines.py    the timer thread: call deadlines, lazy-answer kicks, call_later
    completion.py   calls this worker made, until each is answered, fails or times out
    dispatch.py     running the requests that arrive, and answering them
    heartbeats.py   noticing peers that went silent while calls wait on them
    connections.py  dialling and accepting connections, and losing them
    agent.py        ``Agent``: the worker, put together from the parts above
    calls.py        issuing a user call (``rpc_sync``, ``rpc_async``), the call wrappers
"""
