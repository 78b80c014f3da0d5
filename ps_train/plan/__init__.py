"""Sizing a ps_train job before running it: the analytic cost model (``cost``, with the
constants fitted on measured runs in ``calibration.json``), the shapes of a step per model
(``shapes``), the calls of a step (``steps``), a discrete-event simulator on SimPy
(``simulator``) and ``python -m ps_train.plan`` (``cli``). docs/scaling.md explains them."""
