"""The group of workers: finding each other, joining and leaving, starting and ending together.

rendezvous.py  how workers find each other at ``init_rpc`` (names, ranks, addresses)
registry.py    dynamic groups: rank 0 admits newcomers and removes leavers
lifecycle.py   init/shutdown hooks, barriers, all-gather, quiescence at shutdown
"""
