"""The benchmarks, each a module run from the repository root as ``python -m benchmarks.<name>``
(``--help`` lists its options). Modules whose names start with ``_`` are their shared helpers.
How to run them and how their results become docs/benchmarks.md: docs/benchmarking.md."""
