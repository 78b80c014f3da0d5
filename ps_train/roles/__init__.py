"""The roles of a run: the parameter server (``server``) and the trainer (``trainer``).

The server's parts: ``shards`` (the model shards it holds, and their forwards),
``checkpointing`` (its part of a checkpoint) and ``tables`` (what it takes of a model's
embedding tables, as Protocols). The trainer's: ``step`` (one step and its update
protocol, which ``Trainer`` runs in its loop).
"""
