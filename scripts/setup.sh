#!/usr/bin/env bash
# Everything a fresh Debian machine of this kind needs, idempotent:
#   1. Debian packages (FUSE 3 for pyfuse3, SQLite headers and shell, a C
#      compiler, protoc for scripts/gen_proto.sh, Java for Spark);
#   2. a virtual environment in .venv with the project installed (editable,
#      so the cffi modules are built in the source tree) and its test tools;
#   3. links so that mount(8) finds the `verneuil` mount program.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  fuse3 libfuse3-dev pkg-config      # pyfuse3 builds against libfuse3
  gcc libc6-dev                      # the cffi modules and the SQLite extension
  libcurl4-openssl-dev libzstd-dev zlib1g-dev  # the reader's chunk engine in C (csrc/chunk_engine.c)
  sqlite3 libsqlite3-dev             # the shell, and sqlite3.h/sqlite3ext.h
  protobuf-compiler                  # scripts/gen_proto.sh
  default-jre-headless               # the JVM under PySpark
  s3fs rclone                        # peers in the benchmark (make bench)
  python3-venv
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3-venv is only needed when the system python lacks ensurepip.
if python3 -c 'import ensurepip' 2>/dev/null; then
  missing=("${missing[@]/python3-venv}")
fi
missing=($(printf '%s\n' "${missing[@]}" | grep -v '^$' || true))
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
echo "setup: installing the project and its test tools into .venv"
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel cffi 2>&1 | grep -v "^WARNING: Location" || true
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
