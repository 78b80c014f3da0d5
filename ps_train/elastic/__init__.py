"""Elastic trainers (``cluster.elastic=true``): ps0's record of who trains (``membership``), a
trainer's side (``trainer``) and what the run folder keeps (``files``)."""
