"""Sizing a ps_train job before running it: ``python -m ps_train.plan`` (``cli``, its settings
in ``settings``) asks the analytic cost model (``ps_train.scaling``) and, with ``--simulate``,
a discrete-event simulator on SimPy (``simulator``) that plays each trainer step's calls
(``steps``) priced by the same constants. docs/scaling.md explains them."""
