"""The built-in workloads (``ps_train.workload``): ``vision`` (image classifiers: MLP, CNN,
ResNet-18 on digits, MNIST, CIFAR-10, synthetic images) and ``ctr`` (DLRM-style
click-through-rate models with row-sharded embedding tables). Each registers itself when its
``workload`` module is imported; ``BUILTIN`` lists those for ``ps_train.app``, which imports
them. The packages themselves import nothing, so a tool that uses one part (``python -m
ps_train.prepare``: ``ctr/data/``) does not load the rest."""

BUILTIN = ("ps_train.workloads.vision.workload", "ps_train.workloads.ctr.workload")
