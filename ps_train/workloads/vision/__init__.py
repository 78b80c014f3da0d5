"""The vision workload: image classifiers (model=mlp|cnn|resnet18) on in-memory splits
(data=digits|synthetic|mnist|fashion_mnist|cifar10).

``models`` builds the seeded stages, ``data`` the splits and the per-trainer batches,
``trainer`` the trainer (cross-entropy, accuracy); ``workload`` registers it (``VISION``)
with ``ps_train.workload`` on import.
"""
