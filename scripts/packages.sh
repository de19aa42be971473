# The Debian packages verneuil_fuse needs, sourced by scripts/install.sh
# (a production host) and scripts/setup.sh (development and tests), and the
# function both use to install those missing.

# To build the project (its C parts: the writer's VFS, UMASH, the reader's
# chunk engine) and run it: FUSE 3, SQLite, libcurl, zstd, zlib, a compiler.
RUNTIME_PACKAGES=(
  fuse3 libfuse3-dev pkg-config      # pyfuse3 builds against libfuse3; fusermount3
  gcc libc6-dev                      # the cffi modules and the SQLite extension
  libcurl4-openssl-dev libzstd-dev zlib1g-dev  # the reader's chunk engine in C (csrc/chunk_engine.c)
  sqlite3 libsqlite3-dev             # the shell, and sqlite3.h/sqlite3ext.h
  python3-venv
)
# For `verneuilctl query` and the Spark data source.
SPARK_PACKAGES=(
  default-jre-headless               # the JVM under PySpark
)

# apt_install_missing PACKAGE...: apt-get install those not installed yet
# (python3-venv only when the system python lacks ensurepip).
apt_install_missing() {
  local missing=() p
  for p in "$@"; do
    if [ "$p" = python3-venv ] && python3 -c 'import ensurepip' 2>/dev/null; then
      continue
    fi
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "installing Debian packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}
