"""Earlier versions of code kept as the baselines benchmarks compare against."""
