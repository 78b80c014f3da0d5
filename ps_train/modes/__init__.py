"""The update modes: how trainers' gradients become optimizer steps on the servers."""
