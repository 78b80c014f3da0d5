"""The cost model of a parameter-server step (docs/scaling.md): what a step moves and computes
per model and server (``shapes``), and the constants fitted on measured runs that turn those
into steps/s and the resource that binds (``cost_model``)."""
