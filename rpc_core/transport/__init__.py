"""Connections between workers: authenticated stream sockets that carry frames. Bytes only.

    handshake.py  mutual authentication and the cross-memory-attach probe (every transport's)
    stream.py     ``Connection``: frames over a TCP or Unix socket, put together from
    sending.py    writing frames (scatter-gather, batching, buffers handed over by address)
    polling.py    how a reader waits for bytes (polls briefly while a core is free)
    buffers.py    where received bytes go (a reusable buffer, fresh tensor storage)
    cma.py        cross-memory attach: copying a same-host peer's buffers in one step
"""
