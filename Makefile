# Benchmarks (docs/BENCHMARKS.md). They need root (FUSE mounts) and the .venv
# from scripts/setup.sh; they install s3fs, rclone and nginx with apt-get if missing.
PYTHON ?= .venv/bin/python

.PHONY: bench bench-1g bench-quick bench-catalog

# The figures in docs/bench/ and the README: about 25 minutes on 2 cores,
# then the mount of 1k, 10k and 100k databases (docs/bench/catalog.json):
# about 15 minutes more, most of it moto taking 100,000 manifests.
bench:
	$(PYTHON) scripts/bench_all.py --out docs/bench
	$(PYTHON) scripts/bench_catalog.py --out docs/bench/catalog.json

# The readers side by side on a 1 GiB database (docs/bench/1g), behind moto
# and again behind the nginx rig (benchlib/nginx_rig.py): 25-35 minutes.
bench-1g:
	$(PYTHON) scripts/bench_all.py --size-mb 1024 --only sync --only ceiling --only read --only rig --out docs/bench/1g

# Small databases, one run each, a few minutes (what tests/test_bench_smoke.py runs).
bench-quick:
	$(PYTHON) scripts/bench_all.py --quick --out bench-results/quick

# The mount of many databases alone (scripts/bench_catalog.py).
bench-catalog:
	$(PYTHON) scripts/bench_catalog.py --out docs/bench/catalog.json
