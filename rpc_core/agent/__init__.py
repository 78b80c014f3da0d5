"""The worker: the agent that serves and makes calls, and the parts it is made of.

pool.py         the elastic thread pool that runs requests (never starves)
middleware.py   the hooks of higher layers (RRefs, distributed autograd, the profiler)
futures.py      the futures calls return, and remote errors rebuilt with their type
worlds.py       ``WorkerInfo``, and the ``World`` a rendezvous gives
outbound.py     who reads the answers on an outgoing connection
early_exit.py   torch.futures.wait_all / collect_all that return at the first failed call
roster.py       ``Roster``: who is in the group
deadlines.py    ``Deadlines``: the timer thread (call deadlines, lazy-answer kicks, call_later)
completion.py   ``PendingCalls``: calls this worker made, until each is answered, fails or times out
dispatch.py     ``Dispatch``: running the requests that arrive, and answering them
departures.py   ``Departures``: calls to a member that left, until its last answers arrive
connections.py  ``Connections``: dialling and accepting connections, and losing them
heartbeats.py   ``Heartbeats``: noticing peers that went silent while calls wait on them
agent.py        ``Agent``: the worker, which makes the parts above and wires them together
calls.py        issuing a user call (``rpc_sync``, ``rpc_async``), the call wrappers
"""
