"""The roles of a run: the parameter server (``server``) and the trainer (``trainer``)."""
