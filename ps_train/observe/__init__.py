"""Seeing a run: what the servers write to TensorBoard, the run's dashboard (custom-scalars
layout, HParams), profiler traces per role, and what reaches the console.

- ``server_metrics``: counters a server bumps per update and the timer thread that samples
  them into ``tb/<server>/`` (updates/s, staleness, rows, bytes, update time, peak RSS).
- ``dashboard``: the custom-scalars layout and the HParams experiment, written once per run
  at ``tb/``.
- ``traces``: ``profile.enabled=true``: each trainer records a window of steps with
  ``rpc_core.profiler``; every role writes ``traces/<role>.json`` with its rank (HTA's
  ``distributedInfo``); ``load_job_traces`` reads them back as one job.
- ``console``: warnings a user must see, on the console whatever ``logging.level`` says,
  and the per-role summary at the end of a run.

Nothing here imports the roles, the launcher or the models: they call it.
"""
