/*
 * Linked into SQLite's `testfixture` by scripts/sqlite-testsuite.sh, with
 * -DSQLITE_EXTRA_INIT=verneuil_testfixture_init: SQLite calls
 * verneuil_testfixture_init() at the end of every sqlite3_initialize() that
 * (re)initialised the library, i.e. at start-up and after each
 * sqlite3_shutdown() of the test suite.  sqlite3_os_init() has just made
 * "unix" the default VFS again, so we register `verneuil` (csrc/) as the
 * default VFS every time.
 *
 * Environment (set by scripts/sqlite_testsuite/run.py for each test file):
 *   VERNEUIL_TESTFIXTURE_VFS     "verneuil" (default) or "unix" (register
 *                                nothing: the plain unix VFS, to prove the
 *                                harness)
 *   VERNEUIL_TESTFIXTURE_SPOOL   the spool root; default: a new directory
 *                                $TMPDIR/verneuil-testfixture-XXXXXX
 *   VERNEUIL_TESTFIXTURE_GC_WEIGHT  passed to verneuil_vfs_set_gc_weight
 *   VERNEUIL_TESTFIXTURE_LOG_STDERR=1  copy the VFS's log to stderr (else
 *                                its warnings stay off stderr, which Tcl's
 *                                exec of child test processes reads)
 *   VERNEUIL_SELFCHECK=1         check EVERY write transaction: a thin VFS
 *                                "verneuil_selfcheck" over `verneuil` (made
 *                                the default) runs verneuil_selfcheck()
 *                                (csrc/selfcheck.c) after each write
 *                                transaction's snapshot, while still
 *                                holding SHARED, then finishes unlocking.
 *                                In WAL mode: after every release of the
 *                                WAL write lock (verneuil snapshots before
 *                                it), it takes the lock again and checks
 *                                under it (if another connection got it
 *                                first, that one checks: "busy"); with
 *                                locking_mode=EXCLUSIVE, after each
 *                                SQLITE_FCNTL_COMMIT_PHASETWO.
 *   VERNEUIL_SELFCHECK_LOG       file to which mismatches, and a summary
 *                                line at exit, are appended
 *   VERNEUIL_SELFCHECK_ABORT=1   abort() on the first mismatch
 *
 * The check is skipped (and counted) when there is nothing to compare: an
 * empty file, a hot journal (no snapshot is taken then), a
 * file renamed or deleted since it was opened, a file verneuil does not
 * replicate (PRAGMA verneuil_spool_dir is empty), and while the test suite
 * injects I/O faults into the unix VFS (SimulateIOError, test_syscall.c).
 *
 * The checking layer allocates with malloc, never sqlite3_malloc (but for
 * one pragma per open, see is_replicated), so the test suite's memory
 * accounting and malloc fault injection see next to no difference.
 */
#define _GNU_SOURCE
#include <sqlite3.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "verneuil_vfs.h"

/* csrc/selfcheck.c */
enum {
	VERNEUIL_SELFCHECK_OK = 0,
	VERNEUIL_SELFCHECK_EMPTY = 1,
	VERNEUIL_SELFCHECK_UNREADABLE = 2,
	VERNEUIL_SELFCHECK_HOT = 3,
	VERNEUIL_SELFCHECK_MISMATCH = 4,
	VERNEUIL_SELFCHECK_ERROR = 5,
};
int verneuil_selfcheck_wal(sqlite3_file *db, const volatile void *shm0,
    const char *spool_root, const char *db_path, char *msg, size_t cap);

/* SQLite's wal-index regions (the first holds its header) and the header's
 * file format versions (2: WAL). */
#define CK_SHM_REGION 32768
#define CK_HEADER_FORMAT_OFFSET 18

int verneuil_testfixture_init(const char *unused);

/*
 * SQLite's I/O fault injection (SQLITE_TEST builds, src/os.c): the test
 * suite arms these to make the unix VFS fail on purpose.  While a fault is
 * armed or has fired, a snapshot may rightly have been abandoned, and our
 * own reads would consume the countdown: the check is skipped ("faults").
 */
extern int sqlite3_io_error_hit;
extern int sqlite3_io_error_pending;
extern int sqlite3_diskfull_pending;
extern int sqlite3_diskfull;

/* The unix VFS's system calls as they were at start-up: test_syscall.c
 * (syscall.test, sysfault.test, ...) replaces them to inject faults. */
#define MAX_SYSCALLS 64
static struct {
	sqlite3_vfs *vfs;
	int n;
	const char *name[MAX_SYSCALLS];
	sqlite3_syscall_ptr ptr[MAX_SYSCALLS];
} syscalls;

#define CK_VFS_NAME "verneuil_selfcheck"

static struct {
	int configured;
	int use_verneuil;
	int selfcheck;
	int abort_on_mismatch;
	char spool[PATH_MAX];
	char log[PATH_MAX];
	sqlite3_vfs vfs;
	sqlite3_vfs *inner;
	pthread_mutex_t mutex;
	/* counters (under mutex) */
	unsigned long long checked, ok, empty, wal, busy, unreadable, hot,
	    replaced, faults, unreplicated, mismatch, error;
} ck = { .mutex = PTHREAD_MUTEX_INITIALIZER };

/* ---- reporting ----------------------------------------------------------- */

static void append_log(const char *line)
{
	int fd;

	if (ck.log[0] == 0)
		return;
	fd = open(ck.log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
	if (fd < 0)
		return;
	if (write(fd, line, strlen(line)) < 0) {
		/* nothing to do: stderr has the mismatch too */
	}
	close(fd);
}

static void summary_at_exit(void)
{
	char line[512];

	pthread_mutex_lock(&ck.mutex);
	snprintf(line, sizeof(line), "VERNEUIL-SELFCHECK SUMMARY pid=%ld "
	    "checked=%llu ok=%llu empty=%llu wal=%llu busy=%llu "
	    "unreadable=%llu hot=%llu replaced=%llu faults=%llu "
	    "unreplicated=%llu mismatch=%llu error=%llu\n",
	    (long)getpid(), ck.checked, ck.ok, ck.empty, ck.wal, ck.busy,
	    ck.unreadable, ck.hot, ck.replaced, ck.faults, ck.unreplicated,
	    ck.mismatch, ck.error);
	pthread_mutex_unlock(&ck.mutex);
	append_log(line);
}

/* ---- the checking VFS ------------------------------------------------------ */

struct ck_file {
	sqlite3_file base;
	sqlite3_file *real;  /* the verneuil file, right after us */
	int lock;
	int wal_hold;        /* holds the WAL write lock */
	int shm_seen;        /* mapped the WAL's shared memory through us */
	char *path;          /* malloc'ed; NULL: not checked */
	dev_t dev;
	ino_t ino;
	int replicated;      /* verneuil said it replicates this file */
};

/*
 * Whether verneuil replicates this file: PRAGMA verneuil_spool_dir is ""
 * when it does not (an allocation failure injected by the test suite while
 * opening, an unusable path, ...); then there is nothing to check.  This
 * one sqlite3_mprintf per open is the checker's only SQLite allocation.
 */
static int is_replicated(sqlite3_file *real)
{
	char *args[3] = { NULL, (char *)"verneuil_spool_dir", NULL };
	int rc = real->pMethods->xFileControl(real, SQLITE_FCNTL_PRAGMA, args);

	if (rc == SQLITE_NOTFOUND)
		return 1; /* an older VFS without the pragma: check anyway */
	if (args[0] == NULL)
		return 0; /* out of memory (injected): cannot tell, skip */
	rc = args[0][0] != 0;
	sqlite3_free(args[0]);
	return rc;
}

#define REAL(f) (((struct ck_file *)(f))->real)

static int header_says_wal(struct ck_file *p)
{
	unsigned char v[2];

	return p->real->pMethods->xRead(p->real, v, sizeof(v),
	    CK_HEADER_FORMAT_OFFSET) == SQLITE_OK && (v[0] == 2 || v[1] == 2);
}

static void record_syscalls(void)
{
	const char *name = NULL;

	syscalls.vfs = sqlite3_vfs_find("unix");
	if (syscalls.vfs == NULL || syscalls.vfs->iVersion < 3)
		return;
	while ((name = syscalls.vfs->xNextSystemCall(syscalls.vfs, name)) !=
	    NULL && syscalls.n < MAX_SYSCALLS) {
		syscalls.name[syscalls.n] = name;
		syscalls.ptr[syscalls.n] =
		    syscalls.vfs->xGetSystemCall(syscalls.vfs, name);
		syscalls.n++;
	}
}

static int faults_injected(void)
{
	if (sqlite3_io_error_pending > 0 || sqlite3_io_error_hit > 0 ||
	    sqlite3_diskfull_pending > 0 || sqlite3_diskfull)
		return 1;
	for (int i = 0; i < syscalls.n; i++)
		if (syscalls.vfs->xGetSystemCall(syscalls.vfs,
		    syscalls.name[i]) != syscalls.ptr[i])
			return 1;
	return 0;
}

/* shm0: the wal-index's first region when the WAL write lock is held (the
 * committed state is the one its header names); NULL otherwise. */
static void run_check(struct ck_file *p, const volatile void *shm0,
    const char *where)
{
	char msg[PATH_MAX + 512], line[2 * PATH_MAX + 600];
	struct stat st;
	int r, wal;

	if (!p->replicated) {
		pthread_mutex_lock(&ck.mutex);
		ck.unreplicated++;
		pthread_mutex_unlock(&ck.mutex);
		return;
	}
	if (faults_injected()) {
		pthread_mutex_lock(&ck.mutex);
		ck.faults++;
		pthread_mutex_unlock(&ck.mutex);
		return;
	}

	/* A file renamed over, or deleted, since it was opened: its spool
	 * directory is no longer the one its path leads to. */
	if (stat(p->path, &st) != 0 || st.st_dev != p->dev ||
	    st.st_ino != p->ino) {
		pthread_mutex_lock(&ck.mutex);
		ck.replaced++;
		pthread_mutex_unlock(&ck.mutex);
		return;
	}
	wal = shm0 != NULL || header_says_wal(p);
	r = verneuil_selfcheck_wal(p->real, shm0, ck.spool, p->path, msg,
	    sizeof(msg));
	pthread_mutex_lock(&ck.mutex);
	ck.checked++;
	ck.wal += (unsigned long long)wal;
	switch (r) {
	case VERNEUIL_SELFCHECK_OK: ck.ok++; break;
	case VERNEUIL_SELFCHECK_EMPTY: ck.empty++; break;
	case VERNEUIL_SELFCHECK_UNREADABLE: ck.unreadable++; break;
	case VERNEUIL_SELFCHECK_HOT: ck.hot++; break;
	case VERNEUIL_SELFCHECK_MISMATCH: ck.mismatch++; break;
	default: ck.error++; break;
	}
	pthread_mutex_unlock(&ck.mutex);
	if (r == VERNEUIL_SELFCHECK_MISMATCH || r == VERNEUIL_SELFCHECK_ERROR) {
		snprintf(line, sizeof(line), "VERNEUIL-SELFCHECK %s pid=%ld %s "
		    "(%s): %s\n", r == VERNEUIL_SELFCHECK_MISMATCH ? "MISMATCH" :
		    "ERROR", (long)getpid(), p->path, where, msg);
		fputs(line, stderr);
		append_log(line);
		if (r == VERNEUIL_SELFCHECK_MISMATCH && ck.abort_on_mismatch)
			abort();
	}
}

static int ck_close(sqlite3_file *f)
{
	struct ck_file *p = (struct ck_file *)f;
	int rc = p->real->pMethods->xClose(p->real);

	free(p->path);
	p->path = NULL;
	return rc;
}

static int ck_read(sqlite3_file *f, void *buf, int amt, sqlite3_int64 off)
{
	return REAL(f)->pMethods->xRead(REAL(f), buf, amt, off);
}

static int ck_write(sqlite3_file *f, const void *buf, int amt,
    sqlite3_int64 off)
{
	return REAL(f)->pMethods->xWrite(REAL(f), buf, amt, off);
}

static int ck_truncate(sqlite3_file *f, sqlite3_int64 size)
{
	return REAL(f)->pMethods->xTruncate(REAL(f), size);
}

static int ck_sync(sqlite3_file *f, int flags)
{
	return REAL(f)->pMethods->xSync(REAL(f), flags);
}

static int ck_file_size(sqlite3_file *f, sqlite3_int64 *size)
{
	return REAL(f)->pMethods->xFileSize(REAL(f), size);
}

static int ck_lock(sqlite3_file *f, int level)
{
	struct ck_file *p = (struct ck_file *)f;
	int rc = p->real->pMethods->xLock(p->real, level);

	if (rc == SQLITE_OK && level > p->lock)
		p->lock = level;
	return rc;
}

/* Whether verneuil says it does not replicate this file's WAL commits (a
 * VFS above it hides the WAL's shared memory or spreads the database over
 * several files): counted as unreplicated. */
static int wal_unreplicated(struct ck_file *p)
{
	int on = 0;

	if (p->real->pMethods->xFileControl(p->real,
	    VERNEUIL_FCNTL_WAL_UNREPLICATED, &on) != SQLITE_OK || !on)
		return 0;
	pthread_mutex_lock(&ck.mutex);
	ck.unreplicated++;
	pthread_mutex_unlock(&ck.mutex);
	return 1;
}

/* Whether the database's WAL file is gone (deleted at its last close). */
static int wal_gone(struct ck_file *p)
{
	char wal[PATH_MAX + 8];
	struct stat st;

	snprintf(wal, sizeof(wal), "%s-wal", p->path);
	return stat(wal, &st) != 0 && errno == ENOENT;
}

/* A WAL database whose shared memory a VFS above us emulates (the test
 * suite's testvfs): verneuil cannot see its WAL write lock and says it is
 * not replicated.  Counted as unreplicated. */
static int shm_above(struct ck_file *p)
{
	if (p->shm_seen)
		return 0;
	pthread_mutex_lock(&ck.mutex);
	ck.unreplicated++;
	pthread_mutex_unlock(&ck.mutex);
	return 1;
}

static int ck_unlock(sqlite3_file *f, int level)
{
	struct ck_file *p = (struct ck_file *)f;
	int rc;

	if (p->path != NULL && p->lock >= SQLITE_LOCK_RESERVED &&
	    level <= SQLITE_LOCK_SHARED && header_says_wal(p)) {
		/* A WAL database closed (SQLite checkpointed it under the
		 * exclusive lock and deleted the WAL): the staged snapshot must
		 * be the file (verneuil snapshots it in this call if it was
		 * not).  Checked before the lock goes: under SHARED, other
		 * connections may already write a new WAL. */
		if (p->lock >= SQLITE_LOCK_EXCLUSIVE && p->shm_seen &&
		    wal_gone(p) && !wal_unreplicated(p))
			run_check(p, NULL, "WAL closed");
	} else if (p->path != NULL && p->lock >= SQLITE_LOCK_RESERVED &&
	    level <= SQLITE_LOCK_SHARED) {
		/* verneuil stages its snapshot in this call... */
		rc = p->real->pMethods->xUnlock(p->real, SQLITE_LOCK_SHARED);
		if (rc != SQLITE_OK)
			return rc;
		p->lock = SQLITE_LOCK_SHARED;
		/* ...and we check it while still holding SHARED. */
		run_check(p, NULL, "unlock");
		if (level == SQLITE_LOCK_SHARED)
			return SQLITE_OK;
	}
	rc = p->real->pMethods->xUnlock(p->real, level);
	if (rc == SQLITE_OK && level < p->lock)
		p->lock = level;
	return rc;
}

static int ck_check_reserved_lock(sqlite3_file *f, int *out)
{
	return REAL(f)->pMethods->xCheckReservedLock(REAL(f), out);
}

static int ck_file_control(sqlite3_file *f, int op, void *arg)
{
	struct ck_file *p = (struct ck_file *)f;
	int rc = REAL(f)->pMethods->xFileControl(REAL(f), op, arg);

	/* A WAL commit under locking_mode=EXCLUSIVE (verneuil snapshots it in
	 * this call), or the switch to WAL: checked under the exclusive lock.
	 * A rollback commit is checked at its unlock. */
	if (op == SQLITE_FCNTL_COMMIT_PHASETWO && p->path != NULL &&
	    header_says_wal(p)) {
		if (p->lock >= SQLITE_LOCK_EXCLUSIVE && !wal_unreplicated(p))
			run_check(p, NULL, "commit, exclusive lock");
		else
			shm_above(p); /* else checked under the WAL write lock */
	}
	return rc;
}

static int ck_sector_size(sqlite3_file *f)
{
	return REAL(f)->pMethods->xSectorSize(REAL(f));
}

static int ck_device_characteristics(sqlite3_file *f)
{
	return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f));
}

static int ck_shm_map(sqlite3_file *f, int pg, int pgsz, int extend,
    void volatile **pp)
{
	((struct ck_file *)f)->shm_seen = 1;
	return REAL(f)->pMethods->xShmMap(REAL(f), pg, pgsz, extend, pp);
}

/* verneuil snapshotted before releasing the WAL write lock: take it
 * again, so that nobody changes the WAL, and check under it. */
static void check_after_wal_unlock(struct ck_file *p)
{
	sqlite3_file *real = p->real;
	void volatile *shm0 = NULL;

	if (real->pMethods->xShmLock(real, 0, 1,
	    SQLITE_SHM_LOCK | SQLITE_SHM_EXCLUSIVE) != SQLITE_OK) {
		pthread_mutex_lock(&ck.mutex);
		ck.busy++;
		pthread_mutex_unlock(&ck.mutex);
		return;
	}
	if (real->pMethods->xShmMap(real, 0, CK_SHM_REGION, 0, &shm0) ==
	    SQLITE_OK && shm0 != NULL && !wal_unreplicated(p))
		run_check(p, shm0, "WAL write lock");
	real->pMethods->xShmLock(real, 0, 1,
	    SQLITE_SHM_UNLOCK | SQLITE_SHM_EXCLUSIVE);
}

static int ck_shm_lock(sqlite3_file *f, int offset, int n, int flags)
{
	struct ck_file *p = (struct ck_file *)f;
	int rc = REAL(f)->pMethods->xShmLock(REAL(f), offset, n, flags);
	int write_lock = offset <= 0 && offset + n > 0;

	if (rc == SQLITE_OK && write_lock &&
	    flags == (SQLITE_SHM_LOCK | SQLITE_SHM_EXCLUSIVE))
		p->wal_hold = 1;
	if (write_lock && p->wal_hold &&
	    flags == (SQLITE_SHM_UNLOCK | SQLITE_SHM_EXCLUSIVE)) {
		p->wal_hold = 0;
		if (rc == SQLITE_OK && p->path != NULL)
			check_after_wal_unlock(p);
	}
	return rc;
}

static void ck_shm_barrier(sqlite3_file *f)
{
	REAL(f)->pMethods->xShmBarrier(REAL(f));
}

static int ck_shm_unmap(sqlite3_file *f, int delete_flag)
{
	return REAL(f)->pMethods->xShmUnmap(REAL(f), delete_flag);
}

static int ck_fetch(sqlite3_file *f, sqlite3_int64 off, int amt, void **pp)
{
	return REAL(f)->pMethods->xFetch(REAL(f), off, amt, pp);
}

static int ck_unfetch(sqlite3_file *f, sqlite3_int64 off, void *p)
{
	return REAL(f)->pMethods->xUnfetch(REAL(f), off, p);
}

static const sqlite3_io_methods ck_io_methods = {
	3,
	ck_close, ck_read, ck_write, ck_truncate, ck_sync, ck_file_size,
	ck_lock, ck_unlock, ck_check_reserved_lock, ck_file_control,
	ck_sector_size, ck_device_characteristics, ck_shm_map, ck_shm_lock,
	ck_shm_barrier, ck_shm_unmap, ck_fetch, ck_unfetch,
};

static int ck_open(sqlite3_vfs *vfs, const char *name, sqlite3_file *f,
    int flags, int *out_flags)
{
	sqlite3_vfs *inner = vfs->pAppData;
	struct ck_file *p = (struct ck_file *)f;
	struct stat st;
	int rc, got = 0;

	/* Only what verneuil replicates: main db files opened read-write. */
	if ((flags & SQLITE_OPEN_MAIN_DB) == 0 || name == NULL ||
	    (flags & SQLITE_OPEN_READONLY) != 0)
		return inner->xOpen(inner, name, f, flags, out_flags);
	memset(p, 0, sizeof(*p));
	p->real = (sqlite3_file *)&p[1];
	rc = inner->xOpen(inner, name, p->real, flags, &got);
	if (out_flags != NULL)
		*out_flags = got;
	if (rc != SQLITE_OK) {
		f->pMethods = NULL;
		return rc;
	}
	if ((got & SQLITE_OPEN_READONLY) == 0 && stat(name, &st) == 0) {
		p->path = strdup(name);
		p->dev = st.st_dev;
		p->ino = st.st_ino;
		p->replicated = is_replicated(p->real);
	}
	f->pMethods = &ck_io_methods;
	return SQLITE_OK;
}

#define INNER(v) ((sqlite3_vfs *)(v)->pAppData)

static int ck_delete(sqlite3_vfs *v, const char *n, int s)
{ return INNER(v)->xDelete(INNER(v), n, s); }
static int ck_access(sqlite3_vfs *v, const char *n, int fl, int *o)
{ return INNER(v)->xAccess(INNER(v), n, fl, o); }
static int ck_full_pathname(sqlite3_vfs *v, const char *n, int c, char *o)
{ return INNER(v)->xFullPathname(INNER(v), n, c, o); }
static void *ck_dl_open(sqlite3_vfs *v, const char *p)
{ return INNER(v)->xDlOpen(INNER(v), p); }
static void ck_dl_error(sqlite3_vfs *v, int n, char *m)
{ INNER(v)->xDlError(INNER(v), n, m); }
static void (*ck_dl_sym(sqlite3_vfs *v, void *h, const char *s))(void)
{ return INNER(v)->xDlSym(INNER(v), h, s); }
static void ck_dl_close(sqlite3_vfs *v, void *h)
{ INNER(v)->xDlClose(INNER(v), h); }
static int ck_randomness(sqlite3_vfs *v, int n, char *o)
{ return INNER(v)->xRandomness(INNER(v), n, o); }
static int ck_sleep(sqlite3_vfs *v, int us)
{ return INNER(v)->xSleep(INNER(v), us); }
static int ck_current_time(sqlite3_vfs *v, double *o)
{ return INNER(v)->xCurrentTime(INNER(v), o); }
static int ck_get_last_error(sqlite3_vfs *v, int n, char *o)
{ return INNER(v)->xGetLastError(INNER(v), n, o); }
static int ck_current_time_int64(sqlite3_vfs *v, sqlite3_int64 *o)
{ return INNER(v)->xCurrentTimeInt64(INNER(v), o); }
static int ck_set_system_call(sqlite3_vfs *v, const char *n,
    sqlite3_syscall_ptr p)
{ return INNER(v)->xSetSystemCall(INNER(v), n, p); }
static sqlite3_syscall_ptr ck_get_system_call(sqlite3_vfs *v, const char *n)
{ return INNER(v)->xGetSystemCall(INNER(v), n); }
static const char *ck_next_system_call(sqlite3_vfs *v, const char *n)
{ return INNER(v)->xNextSystemCall(INNER(v), n); }

/* ---- configuration --------------------------------------------------------- */

static int env_on(const char *name)
{
	const char *v = getenv(name);

	return v != NULL && v[0] != 0 && strcmp(v, "0") != 0;
}

static int configure(void)
{
	const char *v;

	v = getenv("VERNEUIL_TESTFIXTURE_VFS");
	ck.use_verneuil = v == NULL || v[0] == 0 || strcmp(v, "verneuil") == 0;
	if (v != NULL && v[0] != 0 && strcmp(v, "verneuil") != 0 &&
	    strcmp(v, "unix") != 0) {
		fprintf(stderr, "verneuil_testfixture_init: "
		    "VERNEUIL_TESTFIXTURE_VFS must be verneuil or unix, not "
		    "%s\n", v);
		return SQLITE_ERROR;
	}
	if (!ck.use_verneuil)
		return SQLITE_OK;
	v = getenv("VERNEUIL_TESTFIXTURE_SPOOL");
	if (v != NULL && v[0] != 0) {
		if (strlen(v) >= sizeof(ck.spool))
			return SQLITE_ERROR;
		strcpy(ck.spool, v);
	} else {
		const char *tmp = getenv("TMPDIR");

		snprintf(ck.spool, sizeof(ck.spool),
		    "%s/verneuil-testfixture-XXXXXX",
		    tmp != NULL && tmp[0] != 0 ? tmp : "/tmp");
		if (mkdtemp(ck.spool) == NULL) {
			perror("verneuil_testfixture_init: mkdtemp");
			return SQLITE_ERROR;
		}
	}
	if (mkdir(ck.spool, 0755) != 0 && errno != EEXIST) {
		perror("verneuil_testfixture_init: spool dir");
		return SQLITE_ERROR;
	}
	v = getenv("VERNEUIL_TESTFIXTURE_GC_WEIGHT");
	if (v != NULL && v[0] != 0)
		verneuil_vfs_set_gc_weight(strtod(v, NULL));
	if (env_on("VERNEUIL_TESTFIXTURE_LOG_STDERR"))
		verneuil_vfs_set_log_stderr(1);
	else
		/* Tests that run child processes read their stderr (Tcl's
		 * exec fails on any output there): verneuil's warnings go to
		 * sqlite3_log only; the self-check reports what matters. */
		verneuil_vfs_set_warn_stderr(0);
	ck.selfcheck = env_on("VERNEUIL_SELFCHECK");
	ck.abort_on_mismatch = env_on("VERNEUIL_SELFCHECK_ABORT");
	v = getenv("VERNEUIL_SELFCHECK_LOG");
	if (v != NULL && strlen(v) < sizeof(ck.log))
		strcpy(ck.log, v);
	if (ck.selfcheck) {
		record_syscalls();
		atexit(summary_at_exit);
	}
	return SQLITE_OK;
}

int verneuil_testfixture_init(const char *unused)
{
	int rc;

	(void)unused;
	if (!ck.configured) {
		rc = configure();
		if (rc != SQLITE_OK)
			return rc;
		ck.configured = 1;
	}
	if (!ck.use_verneuil)
		return SQLITE_OK;
	rc = verneuil_vfs_register(ck.spool, 1);
	if (rc != SQLITE_OK) {
		fprintf(stderr, "verneuil_testfixture_init: "
		    "verneuil_vfs_register: SQLite error %d\n", rc);
		return rc;
	}
	if (!ck.selfcheck)
		return SQLITE_OK;
	/* The self-check compares the staged snapshot with the state under the
	 * WAL write lock right after each commit, of any process: true when
	 * commits are snapshotted on the commit path.  Off the commit path (the
	 * stager, docs/WRITER.md) a snapshot may lag its commit, which this
	 * check cannot tell from a wrong one; --no-selfcheck runs the suite
	 * with the stager. */
	verneuil_vfs_set_wal_async(0);
	if (ck.inner == NULL) {
		ck.inner = sqlite3_vfs_find(VERNEUIL_VFS_NAME);
		if (ck.inner == NULL)
			return SQLITE_ERROR;
		ck.vfs = (sqlite3_vfs){
			.iVersion = 3,
			.szOsFile = (int)sizeof(struct ck_file) +
			    ck.inner->szOsFile,
			.mxPathname = ck.inner->mxPathname,
			.zName = CK_VFS_NAME,
			.pAppData = ck.inner,
			.xOpen = ck_open,
			.xDelete = ck_delete,
			.xAccess = ck_access,
			.xFullPathname = ck_full_pathname,
			.xDlOpen = ck_dl_open,
			.xDlError = ck_dl_error,
			.xDlSym = ck_dl_sym,
			.xDlClose = ck_dl_close,
			.xRandomness = ck_randomness,
			.xSleep = ck_sleep,
			.xCurrentTime = ck_current_time,
			.xGetLastError = ck_get_last_error,
			.xCurrentTimeInt64 = ck_current_time_int64,
			.xSetSystemCall = ck_set_system_call,
			.xGetSystemCall = ck_get_system_call,
			.xNextSystemCall = ck_next_system_call,
		};
	}
	return sqlite3_vfs_register(&ck.vfs, 1);
}
