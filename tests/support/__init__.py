"""What the tests (and the benchmarks in scripts/) share: publishing replicas
straight into a store and running mounts (`replicas`), moto's S3 server and
a latency proxy (`s3server`), a fault-injecting HTTP proxy (`faultproxy`), a
reference spool writer in Python (`pyspoolwriter`), rebuilding a database
from a spool (`spoolutil`), and the copier tests' helpers (`copier_support`).

Test modules import them as ``support.<module>``: pytest puts ``tests/`` on
``sys.path`` for the test files in it; the scripts add it themselves."""
