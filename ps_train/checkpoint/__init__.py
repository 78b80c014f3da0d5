"""Checkpoints: the on-disk format (``files``) and who writes and reads which part (``protocol``)."""
