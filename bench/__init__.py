"""relay's benchmark: `.venv/bin/python -m bench.run [--quick]` (see bench/run.py)."""
