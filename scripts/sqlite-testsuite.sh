#!/usr/bin/env bash
# SQLite's own TCL regression suite, with the `verneuil` VFS (csrc/) compiled
# into `testfixture` and registered as SQLite's default VFS; optionally every
# write transaction's staged snapshot is rebuilt and compared with the
# database (the self-check). See docs/SQLITE_TESTSUITE.md.
#
# Usage: scripts/sqlite-testsuite.sh [MODE] [OPTIONS] [TESTFILE...]
#   MODE (default --ci):
#     --ci              the CI subset (scripts/sqlite_testsuite/ci-subset.txt),
#                       a few minutes on 2 cores
#     --full            SQLite's `quick` set minus exclusions.txt (about 15
#                       minutes on 2 cores)
#     --suite NAME      any permutations.test file set: veryquick, quick, full
#     TESTFILE...       just these files (e.g. insert.test trans.test)
#   OPTIONS:
#     --vfs verneuil|unix   default verneuil; unix = the plain unix VFS (proves
#                           the harness itself)
#     --no-selfcheck        do not check every commit (default: check)
#     --jobs N              parallel test files (default 2; the machine has 2)
#     --timeout SECONDS     per test file (default 600; 1500 with --full or --suite)
#     --budget SECONDS      stop starting new files after this long (default
#                           none; files not run are reported as such)
#     --baseline            re-run failed files with the plain unix VFS and
#                           count failures it reproduces as the environment's
#                           (default for --full and --suite)
#     --strict              any failure fails the run (default for --ci and
#                           TESTFILEs)
#     --as-user USER|none   run testfixture as USER (default: nobody when run
#                           as root, so that SQLite's permission tests work)
#     --out DIR             results directory (default under the cache)
#     --build-only          fetch and build testfixture, print its path
#     --fetch-only          fetch the source package only
#     --no-install          never call apt-get (fail instead)
#   Environment:
#     VERNEUIL_SQLITE_CACHE   cache dir (default ~/.cache/verneuil/sqlite-src)
#
# Exit status: 0 all ran tests passed; 1 test failures; 2 usage; 3 the source
# package could not be fetched (the pytest wrapper skips on 3 only); 4 the
# build failed.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HERE="$ROOT/scripts/sqlite_testsuite"
CACHE="${VERNEUIL_SQLITE_CACHE:-$HOME/.cache/verneuil/sqlite-src}"
MODE=ci
SUITE=""
VFS=verneuil
SELFCHECK=1
JOBS=2
# Per test file, by default: 600 s stops a hung file of the CI subset soon
# enough; the full sets hold e_walauto.test, 600-700 s alone with the
# self-check (about 49,000 WAL commits checked).
TIMEOUT_DEFAULT=600
TIMEOUT_SUITE_DEFAULT=1500
TIMEOUT=""
BUDGET=0
BASELINE=""
AS_USER=auto
OUT=""
BUILD_ONLY=0
FETCH_ONLY=0
INSTALL=1
FILES=()

log() { echo "sqlite-testsuite: $*" >&2; }
die() { local code="$1"; shift; log "$*"; exit "$code"; }

while [ $# -gt 0 ]; do
	case "$1" in
	--ci) MODE=ci ;;
	--full) MODE=suite; SUITE=quick ;;
	--suite) MODE=suite; SUITE="${2:?--suite NAME}"; shift ;;
	--vfs) VFS="${2:?--vfs verneuil|unix}"; shift ;;
	--no-selfcheck) SELFCHECK=0 ;;
	--selfcheck) SELFCHECK=1 ;;
	--jobs) JOBS="${2:?}"; shift ;;
	--timeout) TIMEOUT="${2:?}"; shift ;;
	--budget) BUDGET="${2:?}"; shift ;;
	--out) OUT="${2:?}"; shift ;;
	--baseline) BASELINE=1 ;;
	--strict) BASELINE=0 ;;
	--as-user) AS_USER="${2:?}"; shift ;;
	--build-only) BUILD_ONLY=1 ;;
	--fetch-only) FETCH_ONLY=1 ;;
	--no-install) INSTALL=0 ;;
	-h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
	-*) die 2 "unknown option $1" ;;
	*) MODE=files; FILES+=("$1") ;;
	esac
	shift
done
if [ -z "$TIMEOUT" ]; then
	TIMEOUT=$TIMEOUT_DEFAULT
	[ "$MODE" = suite ] && TIMEOUT=$TIMEOUT_SUITE_DEFAULT
fi
case "$VFS" in verneuil|unix) ;; *) die 2 "--vfs must be verneuil or unix" ;; esac
[ "$JOBS" -ge 1 ] 2>/dev/null || die 2 "--jobs must be a positive integer"
[ "$JOBS" -le 2 ] || log "warning: --jobs $JOBS on a 2-core machine"

mkdir -p "$CACHE"
# One fetch/build at a time per cache (pytest and a manual run may overlap).
exec 9>"$CACHE/.lock"
if ! flock -w 1800 9; then
	die 4 "timed out waiting for $CACHE/.lock"
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
APT_UPDATED=0
apt_update() {
	[ "$APT_UPDATED" -eq 1 ] && return 0
	timeout 600 $SUDO apt-get update -qq >&2 && APT_UPDATED=1
}

# --- 1. tools ---------------------------------------------------------------
need_pkgs=()
for p in tcl8.6-dev dpkg-dev gcc make xz-utils; do
	dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "install ok installed" ||
		need_pkgs+=("$p")
done
if [ "${#need_pkgs[@]}" -gt 0 ]; then
	[ "$INSTALL" -eq 1 ] || die 4 "missing packages: ${need_pkgs[*]} (--no-install)"
	log "installing ${need_pkgs[*]}"
	apt_update || die 4 "apt-get update failed"
	DEBIAN_FRONTEND=noninteractive timeout 900 $SUDO apt-get install -y -qq \
		--no-install-recommends "${need_pkgs[@]}" >&2 ||
		die 4 "apt-get install ${need_pkgs[*]} failed"
fi

# --- 2. the source package of the installed SQLite ---------------------------
DEB_VERSION="$(dpkg-query -W -f='${Version}' libsqlite3-0 2>/dev/null || true)"
[ -n "$DEB_VERSION" ] || die 3 "libsqlite3-0 is not installed"
UPSTREAM="${DEB_VERSION%%-*}"
UPSTREAM="${UPSTREAM#*:}"
SRC="$CACHE/sqlite3-$DEB_VERSION"

have_src_line() {
	apt-cache showsrc sqlite3 2>/dev/null | grep -qx "Version: $DEB_VERSION"
}

enable_deb_src() {
	local f=/etc/apt/sources.list.d/verneuil-deb-src.sources
	[ "$INSTALL" -eq 1 ] || return 1
	if [ ! -e "$f" ]; then
		log "enabling deb-src lines in $f"
		if [ -r /etc/apt/sources.list.d/debian.sources ]; then
			# The same mirrors and suites as the binary packages.
			sed 's/^Types:.*/Types: deb-src/' \
				/etc/apt/sources.list.d/debian.sources |
				$SUDO tee "$f" >/dev/null
		else
			$SUDO tee "$f" >/dev/null <<-EOF
			Types: deb-src
			URIs: http://deb.debian.org/debian
			Suites: bookworm bookworm-updates
			Components: main
			Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

			Types: deb-src
			URIs: http://deb.debian.org/debian-security
			Suites: bookworm-security
			Components: main
			Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
			EOF
		fi
	fi
	APT_UPDATED=0
	apt_update
}

if [ ! -f "$SRC/.verneuil-extracted" ]; then
	if ! have_src_line; then
		enable_deb_src || true
	fi
	want="sqlite3=$DEB_VERSION"
	if ! have_src_line; then
		if apt-cache showsrc sqlite3 2>/dev/null | grep -q '^Version:'; then
			log "warning: source of $DEB_VERSION not available;" \
				"using the newest sqlite3 source package instead"
			want=sqlite3
		else
			die 3 "no sqlite3 source package reachable (deb-src lines?)"
		fi
	fi
	dl="$CACHE/download"
	rm -rf "$dl" "$SRC"
	mkdir -p "$dl"
	log "fetching source package $want into $CACHE"
	# (apt warns that it downloads unsandboxed into a root-owned dir: fine.)
	(cd "$dl" && timeout 900 apt-get source --download-only -qq "$want" >&2) ||
		die 3 "apt-get source $want failed"
	dsc="$(ls "$dl"/sqlite3_*.dsc | head -1)"
	(cd "$dl" && timeout 600 dpkg-source --no-check -x "$dsc" src >/dev/null) ||
		die 3 "dpkg-source -x $dsc failed"
	mv "$dl/src" "$SRC"
	rm -rf "$dl"
	basename "$dsc" >"$SRC/.verneuil-extracted"
fi
log "source: $SRC ($(cat "$SRC/.verneuil-extracted"))"
[ "$FETCH_ONLY" -eq 0 ] || { echo "$SRC"; exit 0; }

# --- 3. testfixture with the verneuil VFS -------------------------------------
# The VFS's C files (csrc/vfs_sources.txt, as its other builds read them) and the self-check.
mapfile -t VN_SOURCES < <(grep -v '^#' "$ROOT/csrc/vfs_sources.txt" | grep .)
VN_SOURCES+=(selfcheck.c)
for f in "${VN_SOURCES[@]}" verneuil_vfs.h; do
	[ -f "$ROOT/csrc/$f" ] || die 4 "csrc/$f does not exist yet"
done
VN_CFLAGS="-O2 -g -std=gnu11 -Wall -Wextra -fno-strict-aliasing"
# Bump when the build steps below change (the key names the cached build).
BUILD_RECIPE=2
KEY="$( (cat "$ROOT"/csrc/*.c "$ROOT"/csrc/*.h "$ROOT"/csrc/vfs_sources.txt "$HERE/testfixture_init.c"
	echo "$BUILD_RECIPE $VN_CFLAGS $DEB_VERSION") | sha256sum | cut -c1-16)"
BUILD="$CACHE/build-$DEB_VERSION-$KEY"
TESTFIXTURE="$BUILD/testfixture"

if [ ! -x "$TESTFIXTURE" ]; then
	log "building testfixture in $BUILD (about 2 minutes)"
	rm -rf "$BUILD"
	mkdir -p "$BUILD/verneuil"
	(
		cd "$BUILD"
		# The extensions Debian's libsqlite3 has (debian/rules), so that
		# their tests (FTS, R-tree, sessions: more writers) run too.
		timeout 300 "$SRC/configure" --with-tcl=/usr/lib/tcl8.6 \
			--disable-shared --enable-fts4 --enable-fts5 --enable-rtree \
			--enable-session >configure.log 2>&1 ||
			{ tail -20 configure.log >&2; exit 1; }
		timeout 600 make -j"$JOBS" sqlite3.c >make-amalgamation.log 2>&1 ||
			{ tail -20 make-amalgamation.log >&2; exit 1; }
		objs=()
		for f in "${VN_SOURCES[@]}" ; do
			o="verneuil/${f%.c}.o"
			# shellcheck disable=SC2086
			timeout 300 gcc $VN_CFLAGS -I"$BUILD" -I"$ROOT/csrc" \
				-c "$ROOT/csrc/$f" -o "$o" 2>>verneuil/build.log ||
				{ cat verneuil/build.log >&2; exit 1; }
			objs+=("$o")
		done
		# shellcheck disable=SC2086
		timeout 300 gcc $VN_CFLAGS -I"$BUILD" -I"$ROOT/csrc" \
			-c "$HERE/testfixture_init.c" -o verneuil/testfixture_init.o \
			2>>verneuil/build.log || { cat verneuil/build.log >&2; exit 1; }
		objs+=(verneuil/testfixture_init.o)
		ar rcs verneuil/libverneuil_testfixture.a "${objs[@]}"
		if grep -q "warning:" verneuil/build.log; then
			log "compiler warnings in csrc/ (see $BUILD/verneuil/build.log):"
			grep "warning:" verneuil/build.log | head -20 >&2
		fi
		timeout 900 make testfixture \
			OPTS="-DSQLITE_EXTRA_INIT=verneuil_testfixture_init" \
			LIBS="$BUILD/verneuil/libverneuil_testfixture.a -lpthread" \
			>make-testfixture.log 2>&1 ||
			{ tail -30 make-testfixture.log >&2; exit 1; }
	) || { rm -f "$TESTFIXTURE"; die 4 "testfixture build failed (logs in $BUILD)"; }
	# Keep the three newest builds.
	ls -1dt "$CACHE"/build-* 2>/dev/null | tail -n +4 | xargs -r rm -rf
fi
log "testfixture: $TESTFIXTURE"
[ "$BUILD_ONLY" -eq 0 ] || { echo "$TESTFIXTURE"; exit 0; }

# --- 4. run ----------------------------------------------------------------------
[ -n "$OUT" ] || OUT="$CACHE/results/$(date +%Y%m%d-%H%M%S)-$MODE${SUITE:+-$SUITE}-$VFS"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
args=(--testfixture "$TESTFIXTURE" --srcdir "$SRC" --exclusions "$HERE/exclusions.txt"
	--jobs "$JOBS" --timeout "$TIMEOUT" --budget "$BUDGET" --out "$OUT" --vfs "$VFS"
	--as-user "$AS_USER")
[ "$SELFCHECK" -eq 1 ] && args+=(--selfcheck)
[ -n "$BASELINE" ] || { [ "$MODE" = suite ] && BASELINE=1 || BASELINE=0; }
[ "$BASELINE" -eq 1 ] && args+=(--baseline)
case "$MODE" in
ci) args+=(--list "$HERE/ci-subset.txt" --within veryquick) ;;
suite) args+=(--suite "$SUITE") ;;
files) args+=(--files "${FILES[@]}") ;;
esac
# The lock only guards fetching and building; runs may overlap.
exec 9>&-
exec "$PY" "$HERE/run.py" "${args[@]}"
