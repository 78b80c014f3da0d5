"""Tests of the ps_train application; helpers are imported as ``tests.ps_train._app``."""
