#!/usr/bin/env bash
# The development machine, in one command, idempotent:
#   1. Debian packages: those a production host needs (scripts/packages.sh:
#      FUSE 3, SQLite, libcurl, zstd, zlib, a C compiler, Java for Spark),
#      then the development and test tools: protoc for scripts/gen_proto.sh,
#      s3fs and rclone (peers in the benchmark), prometheus (promtool and a
#      real scrape in the tests);
#   2. a virtual environment in .venv with the project installed (editable,
#      so the cffi modules are built in the source tree) and its test tools,
#      pip and the build tools pinned (PIP_PINS);
#   3. links so that mount(8) finds the `verneuil` mount program, and
#      `verneuilctl` on root's PATH.
# A production host wants scripts/install.sh instead (no test tools, a venv
# of its own, systemd units).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/packages.sh

DEV_PACKAGES=(
  protobuf-compiler                  # scripts/gen_proto.sh
  s3fs rclone                        # peers in the benchmark (make bench)
  prometheus                         # promtool check metrics, and a real scrape (tests)
)
# What the venv's own tools are upgraded to, the versions the suite passes
# with (an unpinned upgrade would change them under the project at any run).
PIP_PINS=(pip==26.3 setuptools==84.2.1 wheel==0.48.0 cffi==2.1.1)

echo "setup: Debian packages"
had_prometheus=0
command -v prometheus >/dev/null && had_prometheus=1
apt_install_missing "${RUNTIME_PACKAGES[@]}" "${SPARK_PACKAGES[@]}" "${DEV_PACKAGES[@]}"
# Debian's package starts a Prometheus server as a service; the tests start
# their own, so one this setup brought stops again.
if ((had_prometheus == 0)) && [ -d /run/systemd/system ]; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo systemctl disable --now prometheus.service >/dev/null 2>&1 || true
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
echo "setup: installing the project and its test tools into .venv"
.venv/bin/python -m pip install -q "${PIP_PINS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[test,spark]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import verneuil_fuse.format, pyfuse3" \
  || { echo "setup: the project did not install (see pip's output above)" >&2; exit 1; }

# mount.fuse3 runs `verneuil` through /bin/sh with a fixed PATH (docs/DESIGN.md).
if [ "$(id -u)" = 0 ] || [ -w /usr/local/sbin ]; then
  bash scripts/install-mount-helper.sh "$PWD/.venv"
  ln -sf "$PWD/.venv/bin/verneuilctl" /usr/local/sbin/verneuilctl
else
  echo "setup: not root: for mount -t fuse.verneuil and fstab, run: sudo bash scripts/install-mount-helper.sh"
fi
echo "setup: done (.venv ready; run tests with: bash scripts/test.sh)"
