"""The benchmarks of docs/benchmarks.md, each run as ``python -m scripts.bench.NAME`` from the repository's root;
_common.py is what they share."""
