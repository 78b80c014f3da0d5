"""The built-in workloads (``ps_train.workload``): ``vision`` (image classifiers: MLP, CNN,
ResNet-18 on digits, MNIST, CIFAR-10, synthetic images) and ``ctr`` (DLRM-style
click-through-rate models with row-sharded embedding tables). Each sub-package registers
itself on import; ``BUILTIN`` lists them for ``ps_train.app``, which imports them."""

BUILTIN = ("ps_train.workloads.vision", "ps_train.workloads.ctr")
