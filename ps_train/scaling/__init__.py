"""The cost model of a parameter-server step (docs/scaling.md): what a step moves and computes
per model and server (``shapes``), the constants fitted on measured runs (``fit``; the shipped
ones in ``calibration.json``, with the machine they came from) that turn those into steps/s
and the resource that binds (``cost_model``). ``ps_train.plan`` sizes jobs with it."""
