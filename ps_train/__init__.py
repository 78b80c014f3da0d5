"""ps_train: parameter-server, model-parallel training for PyTorch on rpc_core.

Run ``python -m ps_train`` (Hydra configs live in ``conf/``). The modules that do not touch
RPC -- ``config``, ``models``, ``data``, ``metrics``, ``checkpoint`` -- are plain PyTorch and
can be used and tested in a single process.
"""
