"""The repository's tools (experiments, benchmarks, mutation testing, the GPU check), run as modules from the
repository's root: ``python -m scripts.experiment``, ``python -m scripts.bench.env_replay``. Not part of the
nemo_rcgrpo wheel. scripts/gpu_site/ is no package: its sitecustomize.py is loaded through PYTHONPATH."""
