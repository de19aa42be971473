#!/usr/bin/env bash
# Make `mount -t fuse.verneuil SOURCE MNT` and fstab lines work: mount.fuse3
# runs `verneuil` through /bin/sh with the fixed PATH
# /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin, so link the
# venv's console script (or, when it is missing, a small wrapper that runs
# `python -m verneuil_fuse.cli.mount`) into /usr/local/sbin.
#
# Usage: scripts/install-mount-helper.sh [VENV_OR_PYTHON] [DEST_DIR]
#   VENV_OR_PYTHON  a venv directory or its python (default: the repo's .venv)
#   DEST_DIR        where to put `verneuil` (default /usr/local/sbin; needs root)
# Idempotent; prints what it did.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
src=${1:-$here/.venv}
dest_dir=${2:-/usr/local/sbin}
if [ -d "$src" ]; then
  venv=$src
  python=$src/bin/python
else
  python=$src
  venv=$(cd "$(dirname "$python")/.." && pwd)
fi
[ -x "$python" ] || { echo "install-mount-helper: no python at $python" >&2; exit 1; }
mkdir -p "$dest_dir"
dest=$dest_dir/verneuil
if [ -x "$venv/bin/verneuil" ]; then
  ln -sfn "$venv/bin/verneuil" "$dest"
  echo "install-mount-helper: $dest -> $venv/bin/verneuil"
else
  tmp=$(mktemp "$dest_dir/.verneuil.XXXXXX")
  printf '#!/bin/sh\nexec %q -m verneuil_fuse.cli.mount "$@"\n' "$python" >"$tmp"
  chmod 0755 "$tmp"
  mv -f "$tmp" "$dest"
  echo "install-mount-helper: $dest runs $python -m verneuil_fuse.cli.mount"
fi
