#!/usr/bin/env bash
# A production install of verneuil_fuse from this clone, without the test
# and benchmark tools: the Debian packages it runs on (scripts/packages.sh),
# a virtual environment of its own with the project built into it, the
# `verneuil` mount helper where mount(8) finds it, `verneuilctl`, the
# copier's systemd unit and its settings, and example units for readers.
# Run again to upgrade (the venv is rebuilt from this clone; settings kept).
#
# Usage: scripts/install.sh [OPTIONS]
#        scripts/install.sh --uninstall [--purge] [OPTIONS]
#   --prefix DIR     the venv, docs and example units (default /opt/verneuil)
#   --sbin-dir DIR   where `verneuil` is linked (default /usr/local/sbin, on
#                    the fixed PATH mount.fuse3 runs helpers with)
#   --bin-dir DIR    where `verneuilctl` is linked (default /usr/local/bin)
#   --unit-dir DIR   where verneuil-copier.service goes (default /etc/systemd/system)
#   --etc-dir DIR    the copier's settings, never overwritten (default /etc/verneuil)
#   --with-spark     also Java and PySpark, for `verneuilctl query` and the data source
#   --no-apt         install no Debian package (say which are missing)
#   --uninstall      stop and disable the copier's unit, remove what the
#                    install put in place (the settings stay, and spools,
#                    caches and stores are never touched)
#   --purge          with --uninstall: remove the settings directory too
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$here/scripts/packages.sh"

PREFIX=/opt/verneuil
SBIN_DIR=/usr/local/sbin
BIN_DIR=/usr/local/bin
UNIT_DIR=/etc/systemd/system
ETC_DIR=/etc/verneuil
SPARK=0
APT=1
UNINSTALL=0
PURGE=0
UNIT=verneuil-copier.service
# The first line of every unit this script writes: --uninstall removes
# only files that carry it.
MARK="# Installed by verneuil_fuse's scripts/install.sh"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "install: $*" >&2; exit 1; }

while (($#)); do
  case "$1" in
    --prefix) PREFIX=${2:?}; shift ;;
    --sbin-dir) SBIN_DIR=${2:?}; shift ;;
    --bin-dir) BIN_DIR=${2:?}; shift ;;
    --unit-dir) UNIT_DIR=${2:?}; shift ;;
    --etc-dir) ETC_DIR=${2:?}; shift ;;
    --with-spark) SPARK=1 ;;
    --no-apt) APT=0 ;;
    --uninstall) UNINSTALL=1 ;;
    --purge) PURGE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
  shift
done
((PURGE == 0 || UNINSTALL == 1)) || die "--purge goes with --uninstall"
for d in PREFIX SBIN_DIR BIN_DIR UNIT_DIR ETC_DIR; do
  case "${!d}" in /*) ;; *) printf -v "$d" '%s/%s' "$PWD" "${!d}" ;; esac
done
VENV=$PREFIX/venv
# systemctl only for the system's own unit directory, on a host systemd runs.
SYSTEMD=0
[ -d /run/systemd/system ] && [ "$UNIT_DIR" = /etc/systemd/system ] && SYSTEMD=1

packages() {
  local wanted=("${RUNTIME_PACKAGES[@]}")
  ((SPARK)) && wanted+=("${SPARK_PACKAGES[@]}")
  if ((APT)); then
    apt_install_missing "${wanted[@]}"
    return
  fi
  local p missing=()
  for p in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) || echo "install: --no-apt: these Debian packages are missing: ${missing[*]}" >&2
}

build_venv() {
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  # The project again from this clone, whatever its version says.
  "$VENV/bin/python" -m pip uninstall -q -y verneuil_fuse >/dev/null 2>&1 || true
  local what=$here
  ((SPARK)) && what="$here[spark]"
  echo "install: building the project into $VENV"
  "$VENV/bin/python" -m pip install -q "$what" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import verneuil_fuse.format, verneuil_fuse.reader.chunk_engine, pyfuse3, writer_vfs" \
    || die "the project did not install into $VENV (see pip's output above)"
  touch "$PREFIX/.installed-by-verneuil"
}

# fill FILE: the file with @PREFIX@, @ETC_DIR@ and @VERNEUILCTL@ replaced.
fill() {
  sed -e "s|@PREFIX@|$PREFIX|g" -e "s|@ETC_DIR@|$ETC_DIR|g" -e "s|@VERNEUILCTL@|$VENV/bin/verneuilctl|g" "$1"
}

files() {
  mkdir -p "$SBIN_DIR" "$BIN_DIR" "$UNIT_DIR" "$ETC_DIR" "$PREFIX/share/doc" "$PREFIX/share/examples"
  bash "$here/scripts/install-mount-helper.sh" "$VENV" "$SBIN_DIR"
  ln -sfn "$VENV/bin/verneuilctl" "$BIN_DIR/verneuilctl"
  echo "install: $BIN_DIR/verneuilctl -> $VENV/bin/verneuilctl"
  cp "$here/README.md" "$here/docs/COPIER.md" "$here/docs/READER.md" "$PREFIX/share/doc/"
  for f in mnt-replicas.mount mnt-replicas.automount; do
    fill "$here/scripts/systemd/$f" >"$PREFIX/share/examples/$f"
  done
  fill "$here/scripts/systemd/$UNIT.in" >"$UNIT_DIR/$UNIT"  # its first line is $MARK
  echo "install: $UNIT_DIR/$UNIT"
  for f in copier.env config.json; do
    if [ -e "$ETC_DIR/$f" ]; then
      echo "install: $ETC_DIR/$f kept as it is"
    else
      fill "$here/scripts/systemd/$f" >"$ETC_DIR/$f"
      echo "install: $ETC_DIR/$f (an example: edit it)"
    fi
  done
}

verify() {
  if ! command -v systemd-analyze >/dev/null; then
    echo "install: no systemd-analyze: the units are not verified"
    return
  fi
  systemd-analyze verify "$UNIT_DIR/$UNIT" || die "systemd-analyze verify refused $UNIT_DIR/$UNIT"
  echo "install: systemd-analyze verify: $UNIT is fine"
}

install() {
  packages
  mkdir -p "$PREFIX"
  build_venv
  files
  verify
  if ((SYSTEMD)); then
    systemctl daemon-reload
  fi
  cat <<EOF
install: done. Next:
  edit $ETC_DIR/config.json (the spool and the store) and $ETC_DIR/copier.env, then
    systemctl enable --now $UNIT          # the copier; journalctl -u $UNIT for its log
  readers: examples of a .mount and an .automount unit in $PREFIX/share/examples/,
    or an fstab line (docs/READER.md); mount -t fuse.verneuil works now.
  remove it all with: $here/scripts/install.sh --uninstall [--purge]
EOF
}

# unlink_if_ours LINK: remove LINK when it points into the venv.
unlink_if_ours() {
  if [ -L "$1" ] && [[ "$(readlink "$1")" == "$VENV/"* ]]; then
    rm -f "$1"
    echo "uninstall: removed $1"
  elif [ -f "$1" ] && grep -qs "$VENV/bin/python" "$1"; then
    rm -f "$1"  # install-mount-helper.sh's wrapper
    echo "uninstall: removed $1"
  fi
}

uninstall() {
  if ((SYSTEMD)) && [ -e "$UNIT_DIR/$UNIT" ]; then
    systemctl disable --now "$UNIT" || true
  fi
  if [ -e "$UNIT_DIR/$UNIT" ]; then
    head -n 1 "$UNIT_DIR/$UNIT" | grep -qF "$MARK" || die "$UNIT_DIR/$UNIT was not written by this script: left alone"
    rm -f "$UNIT_DIR/$UNIT"
    echo "uninstall: removed $UNIT_DIR/$UNIT"
  fi
  ((SYSTEMD)) && systemctl daemon-reload
  unlink_if_ours "$SBIN_DIR/verneuil"
  unlink_if_ours "$BIN_DIR/verneuilctl"
  if [ -d "$PREFIX" ]; then
    [ -e "$PREFIX/.installed-by-verneuil" ] || die "$PREFIX holds no install of this script: left alone"
    rm -rf "$PREFIX"
    echo "uninstall: removed $PREFIX"
  fi
  if ((PURGE)) && [ -d "$ETC_DIR" ]; then
    rm -rf "$ETC_DIR"
    echo "uninstall: removed $ETC_DIR"
  elif [ -d "$ETC_DIR" ]; then
    echo "uninstall: $ETC_DIR kept (--purge removes it)"
  fi
  echo "uninstall: done (spools, caches and stores are left as they are)"
}

if ((UNINSTALL)); then
  uninstall
else
  install
fi
