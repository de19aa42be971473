# Benchmarks (docs/BENCHMARKS.md). Both need root (FUSE mounts) and the .venv
# from scripts/setup.sh; they install s3fs and rclone with apt-get if missing.
PYTHON ?= .venv/bin/python

.PHONY: bench bench-1g bench-quick

# The figures in docs/bench/ and the README: about 25 minutes on 2 cores.
bench:
	$(PYTHON) scripts/bench_all.py --out docs/bench

# The readers side by side on the 1 GiB database of issue 8 (docs/bench/1g): 21-30 minutes.
bench-1g:
	$(PYTHON) scripts/bench_all.py --size-mb 1024 --only sync --only ceiling --only read --out docs/bench/1g

# Small databases, one run each, a few minutes (what tests/test_bench_smoke.py runs).
bench-quick:
	$(PYTHON) scripts/bench_all.py --quick --out bench-results/quick
