"""Benchmark harness for statesnap: run ``python -m benchmarks.bench_io --help``.

Not a test package: pytest only collects ``tests/``.
"""
