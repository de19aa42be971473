# Benchmarks (docs/BENCHMARKS.md). They need root (FUSE mounts) and the .venv
# from scripts/setup.sh; they install s3fs, rclone and nginx with apt-get if missing.
PYTHON ?= .venv/bin/python

.PHONY: bench bench-1g bench-quick

# The figures in docs/bench/ and the README: about 25 minutes on 2 cores.
bench:
	$(PYTHON) scripts/bench_all.py --out docs/bench

# The readers side by side on a 1 GiB database (docs/bench/1g), behind moto
# and again behind the nginx rig (benchlib/nginx_rig.py): 25-35 minutes.
bench-1g:
	$(PYTHON) scripts/bench_all.py --size-mb 1024 --only sync --only ceiling --only read --only rig --out docs/bench/1g

# Small databases, one run each, a few minutes (what tests/test_bench_smoke.py runs).
bench-quick:
	$(PYTHON) scripts/bench_all.py --quick --out bench-results/quick
