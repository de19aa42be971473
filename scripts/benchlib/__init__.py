"""Helpers of scripts/bench_all.py (the whole-system benchmark, docs/BENCHMARKS.md).

- `moto_ranged`: moto's S3 server, launched with ranged GETs that read only
  the range (stock moto copies the whole object for each ranged GET);
- `proxy`: a latency-adding TCP proxy (TCP_NODELAY) that counts requests
  and bytes, so every system's GETs are counted by the same meter;
- `peers`: s3fs-fuse and rclone mounts of one object on that server;
- `report`: the Markdown table and the PNG plots from the results JSON.
"""
