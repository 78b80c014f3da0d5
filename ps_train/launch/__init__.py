"""Starting and watching the roles: the local launcher (``local``), restarts, heartbeats, ports.

Imports nothing, so ``ps_train.launch.ports`` stays a standard-library-only import.
"""
