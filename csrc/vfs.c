/*
 * The `verneuil` VFS: a thin shim over the default VFS, in the shape of
 * SQLite's ext/misc/cksumvfs.c.  Only main database files are wrapped
 * (SQLITE_OPEN_MAIN_DB, opened read-write, with a spool configured);
 * journals, temp files and everything else pass straight through.
 *
 * Commit detection: a write transaction ends with xUnlock from >= RESERVED
 * to <= SHARED.  We then check for a hot journal (while still holding the
 * write lock, so no other writer can be writing the journal), downgrade to
 * SHARED with the underlying xUnlock, bring the spool's `staging` snapshot up
 * to date while holding that read lock (tracker.c, spool.c), and only then
 * finish unlocking.  Any replication error is logged; SQLite never sees it.
 *
 * Built twice from this source: linked with -lsqlite3 (the cffi module
 * writer_vfs._vfs), and as a loadable extension (VN_LOADABLE_EXTENSION).
 *
 * The only global state is the registered VFS and its configuration
 * (struct vn_config below).
 */
#define _GNU_SOURCE
#ifdef VN_LOADABLE_EXTENSION
#include <sqlite3ext.h>
SQLITE_EXTENSION_INIT1
#else
#include <sqlite3.h>
#endif

#include <assert.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "config.h"
#include "log.h"
#include "tracker.h"
#include "verneuil_vfs.h"

/* Default GC weight (see verneuil_vfs_set_gc_weight): GC then runs about
 * once per quarter of the database's size in newly staged chunks, so garbage
 * in staging averages a quarter of the db and exceeds twice its size with
 * probability about e^-8; each pass costs one listing of staging/chunks. */
#define VN_GC_WEIGHT_DEFAULT 4.0

/* Default budget of chunks bundled in each manifest besides chunk 0, those
 * that hold the b-trees' upper levels (btree_tops.h, docs/WRITER.md): a
 * cold reader's lookup then skips one GET per level bundled.  4 chunks
 * (256 KiB more per manifest at most, about the size of the chunk list of a
 * 1 GiB database) cover the level below the root of a table and three
 * indexes, which is what large databases need (the level below is hundreds
 * of chunks); small databases' trees sit in chunk 0 and bundle nothing. */
#define VN_BUNDLE_CHUNKS_DEFAULT 4


static_assert(SQLITE_LOCK_SHARED < SQLITE_LOCK_RESERVED &&
    SQLITE_LOCK_RESERVED < SQLITE_LOCK_PENDING &&
    SQLITE_LOCK_PENDING < SQLITE_LOCK_EXCLUSIVE,
    "lock levels are ordered");

struct vn_config {
	sqlite3_vfs vfs;       /* the registered "verneuil" VFS */
	sqlite3_vfs *base;     /* the default VFS we wrap */
	pthread_mutex_t mutex; /* guards everything below */
	int initialised;
	char *spool_dir;       /* NULL: replication disabled */
	double gc_weight;
	size_t bundle_chunks;
	uint64_t max_db_size;  /* files past it are not replicated */
	struct vn_keys keys;   /* immutable once initialised */
};

static struct vn_config vn_config = {
	.mutex = PTHREAD_MUTEX_INITIALIZER,
	.gc_weight = VN_GC_WEIGHT_DEFAULT,
	.bundle_chunks = VN_BUNDLE_CHUNKS_DEFAULT,
	.max_db_size = VN_MAX_DB_SIZE,
};

/* State of one wrapped main database file. */
struct vn_db {
	int lock;          /* our view of the lock level held */
	int wal;           /* the db uses WAL: nothing is tracked */
	int wal_logged;
	char *canon;       /* realpath of the database */
	const char *name;  /* SQLite's name for it (valid until xClose): the
			    * journal is name + "-journal" */
	struct vn_tracker tracker;
};

struct vn_file {
	sqlite3_file base;
	sqlite3_file *real; /* the underlying file, allocated right after us */
	struct vn_db *db;   /* NULL: pass everything through */
};

#define REAL(f) (((struct vn_file *)(f))->real)
#define DB(f) (((struct vn_file *)(f))->db)

/* ---- io methods --------------------------------------------------------- */

static int vn_close(sqlite3_file *f)
{
	struct vn_db *db = DB(f);
	int rc = REAL(f)->pMethods->xClose(REAL(f));

	if (db != NULL) {
		vn_tracker_fini(&db->tracker);
		free(db->canon);
		sqlite3_free(db);
		DB(f) = NULL;
	}
	return rc;
}

static int vn_read(sqlite3_file *f, void *buf, int amt, sqlite3_int64 off)
{
	return REAL(f)->pMethods->xRead(REAL(f), buf, amt, off);
}

static int vn_write(sqlite3_file *f, const void *buf, int amt,
    sqlite3_int64 off)
{
	struct vn_db *db = DB(f);

	if (db != NULL && !db->wal) {
		if (db->lock < SQLITE_LOCK_RESERVED)
			db->tracker.force_full = 1; /* unexpected: rebuild */
		vn_tracker_before_write(&db->tracker, (uint64_t)off,
		    (uint64_t)amt);
	}
	return REAL(f)->pMethods->xWrite(REAL(f), buf, amt, off);
}

static int vn_truncate(sqlite3_file *f, sqlite3_int64 size)
{
	struct vn_db *db = DB(f);

	if (db != NULL && !db->wal) {
		if (db->lock < SQLITE_LOCK_RESERVED)
			db->tracker.force_full = 1;
		vn_tracker_before_truncate(&db->tracker, (uint64_t)size);
	}
	return REAL(f)->pMethods->xTruncate(REAL(f), size);
}

static int vn_sync(sqlite3_file *f, int flags)
{
	return REAL(f)->pMethods->xSync(REAL(f), flags);
}

static int vn_file_size(sqlite3_file *f, sqlite3_int64 *size)
{
	return REAL(f)->pMethods->xFileSize(REAL(f), size);
}

static int vn_lock(sqlite3_file *f, int level)
{
	struct vn_db *db = DB(f);
	int rc = REAL(f)->pMethods->xLock(REAL(f), level);

	if (rc != SQLITE_OK || db == NULL || level <= db->lock)
		return rc;
	if (db->lock < SQLITE_LOCK_RESERVED && level >= SQLITE_LOCK_RESERVED &&
	    !db->wal)
		vn_tracker_write_locked(&db->tracker, REAL(f));
	db->lock = level;
	return rc;
}

static void log_wal_once(struct vn_db *db)
{
	struct vn_spool_session s;

	if (db->wal_logged)
		return;
	db->wal_logged = 1;
	/* The database's spool directory and its source file, so that
	 * `verneuilctl lag` lists it as a WAL database even when it never had
	 * a snapshot (a database created in WAL mode). */
	vn_spool_session_init(&s);
	if (vn_spool_open(&db->tracker.spool, &s) == 0)
		vn_spool_close(&s);
	vn_warn("verneuil: %s uses journal_mode=WAL: it is NOT replicated "
	    "(WAL databases are not; use a rollback journal mode, e.g. "
	    "PRAGMA journal_mode=DELETE)", db->canon);
}

/* Offsets 18 and 19 of the SQLite header: file format write / read
 * versions, 2 for WAL and 1 for a rollback journal. */
#define SQLITE_HEADER_FORMAT_OFFSET 18

/* Whether the file's header still declares WAL (or cannot be read: then
 * keep assuming WAL, which only costs replication, never correctness). */
static int header_says_wal(sqlite3_file *f)
{
	unsigned char v[2];

	if (REAL(f)->pMethods->xRead(REAL(f), v, sizeof(v),
		SQLITE_HEADER_FORMAT_OFFSET) != SQLITE_OK)
		return 1;
	return v[0] == 2 || v[1] == 2;
}

/* A write transaction ended: snapshot under SHARED, then finish unlocking. */
static int unlock_after_write(sqlite3_file *f, struct vn_db *db, int level)
{
	struct vn_config *cfg = &vn_config;
	struct vn_snapshot_config sc;
	int hot, rc;

	if (db->wal && !header_says_wal(f)) {
		/*
		 * The database left WAL mode (xShmUnmap is not always called,
		 * e.g. with locking_mode=EXCLUSIVE): replicate it again, from
		 * a full scan since WAL-mode writes were not tracked.
		 */
		db->wal = 0;
		db->tracker.force_full = 1;
	}
	hot = !db->wal && vn_journal_is_hot(db->name);
	rc = REAL(f)->pMethods->xUnlock(REAL(f), SQLITE_LOCK_SHARED);
	if (rc != SQLITE_OK) {
		vn_tracker_reset(&db->tracker);
		return rc;
	}
	db->lock = SQLITE_LOCK_SHARED;
	if (hot) {
		db->tracker.stats.hot_journal++;
		vn_log(SQLITE_NOTICE, "verneuil: %s: hot journal at unlock; "
		    "no snapshot", db->canon);
		vn_tracker_clear_version(&db->tracker);
	} else if (!db->wal) {
		pthread_mutex_lock(&cfg->mutex);
		sc.gc_weight = cfg->gc_weight;
		sc.bundle_chunks = cfg->bundle_chunks;
		sc.max_db_size = cfg->max_db_size;
		pthread_mutex_unlock(&cfg->mutex);
		if (vn_tracker_snapshot(&db->tracker, REAL(f), &sc) ==
		    VN_SNAPSHOT_WAL) {
			db->wal = 1;
			log_wal_once(db);
		}
	}
	vn_tracker_reset(&db->tracker);
	if (level < SQLITE_LOCK_SHARED) {
		rc = REAL(f)->pMethods->xUnlock(REAL(f), level);
		if (rc == SQLITE_OK)
			db->lock = level;
	}
	return rc;
}

static int vn_unlock(sqlite3_file *f, int level)
{
	struct vn_db *db = DB(f);
	int rc;

	if (db != NULL && db->lock >= SQLITE_LOCK_RESERVED &&
	    level <= SQLITE_LOCK_SHARED)
		return unlock_after_write(f, db, level);
	rc = REAL(f)->pMethods->xUnlock(REAL(f), level);
	if (rc == SQLITE_OK && db != NULL && level < db->lock)
		db->lock = level;
	return rc;
}

static int vn_check_reserved_lock(sqlite3_file *f, int *out)
{
	return REAL(f)->pMethods->xCheckReservedLock(REAL(f), out);
}

static int pragma(sqlite3_file *f, char **args)
{
	struct vn_db *db = DB(f);
	const char *name = args[1];

	if (strcasecmp(name, "verneuil_full_snapshot") == 0) {
		if (db != NULL)
			db->tracker.force_full = 1;
		args[0] = sqlite3_mprintf("%s", db != NULL ? "ok" : "not replicated");
		return SQLITE_OK;
	}
	if (strcasecmp(name, "verneuil_no_xattr") == 0) {
		/* Test hook: behave as on a file system without user xattrs. */
		if (db != NULL)
			db->tracker.no_xattr = 1;
		args[0] = sqlite3_mprintf("%s", db != NULL ? "ok" : "not replicated");
		return SQLITE_OK;
	}
	if (strcasecmp(name, "verneuil_stats") == 0) {
		const struct vn_tracker_stats *s;

		if (db == NULL) {
			args[0] = sqlite3_mprintf("not replicated");
			return SQLITE_OK;
		}
		s = &db->tracker.stats;
		args[0] = sqlite3_mprintf("full=%llu incremental=%llu "
		    "unchanged=%llu failed=%llu hot_journal=%llu "
		    "verify_mismatch=%llu ready=%llu gc=%llu gc_removed=%llu "
		    "staged=%llu bundled=%llu low_space=%llu too_large=%llu "
		    "wal=%d no_xattr=%d",
		    (unsigned long long)s->full,
		    (unsigned long long)s->incremental,
		    (unsigned long long)s->unchanged,
		    (unsigned long long)s->failed,
		    (unsigned long long)s->hot_journal,
		    (unsigned long long)s->verify_mismatch,
		    (unsigned long long)s->ready, (unsigned long long)s->gc,
		    (unsigned long long)s->gc_removed,
		    (unsigned long long)s->staged,
		    (unsigned long long)s->bundled,
		    (unsigned long long)s->low_space,
		    (unsigned long long)s->too_large, db->wal,
		    db->tracker.no_xattr);
		return SQLITE_OK;
	}
	if (strcasecmp(name, "verneuil_spool_dir") == 0) {
		args[0] = sqlite3_mprintf("%s", db != NULL && db->tracker.spool_ok ?
		    db->tracker.spool.db_dir : "");
		return SQLITE_OK;
	}
	return REAL(f)->pMethods->xFileControl(REAL(f), SQLITE_FCNTL_PRAGMA, args);
}

static int vn_file_control(sqlite3_file *f, int op, void *arg)
{
	if (op == SQLITE_FCNTL_PRAGMA)
		return pragma(f, (char **)arg);
	return REAL(f)->pMethods->xFileControl(REAL(f), op, arg);
}

static int vn_sector_size(sqlite3_file *f)
{
	return REAL(f)->pMethods->xSectorSize(REAL(f));
}

static int vn_device_characteristics(sqlite3_file *f)
{
	return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f));
}

static int vn_shm_map(sqlite3_file *f, int pg, int pgsz, int extend,
    void volatile **pp)
{
	struct vn_db *db = DB(f);

	if (db != NULL && !db->wal) {
		db->wal = 1;
		log_wal_once(db);
	}
	return REAL(f)->pMethods->xShmMap(REAL(f), pg, pgsz, extend, pp);
}

static int vn_shm_lock(sqlite3_file *f, int offset, int n, int flags)
{
	return REAL(f)->pMethods->xShmLock(REAL(f), offset, n, flags);
}

static void vn_shm_barrier(sqlite3_file *f)
{
	REAL(f)->pMethods->xShmBarrier(REAL(f));
}

static int vn_shm_unmap(sqlite3_file *f, int delete_flag)
{
	struct vn_db *db = DB(f);

	if (db != NULL && db->wal) {
		/* Back to a rollback journal: checkpoints were not tracked. */
		db->wal = 0;
		db->tracker.force_full = 1;
	}
	return REAL(f)->pMethods->xShmUnmap(REAL(f), delete_flag);
}

static int vn_fetch(sqlite3_file *f, sqlite3_int64 off, int amt, void **pp)
{
	return REAL(f)->pMethods->xFetch(REAL(f), off, amt, pp);
}

static int vn_unfetch(sqlite3_file *f, sqlite3_int64 off, void *p)
{
	return REAL(f)->pMethods->xUnfetch(REAL(f), off, p);
}

static const sqlite3_io_methods vn_io_methods = {
	3, /* iVersion: shm (so WAL keeps working) and mmap */
	vn_close,
	vn_read,
	vn_write,
	vn_truncate,
	vn_sync,
	vn_file_size,
	vn_lock,
	vn_unlock,
	vn_check_reserved_lock,
	vn_file_control,
	vn_sector_size,
	vn_device_characteristics,
	vn_shm_map,
	vn_shm_lock,
	vn_shm_barrier,
	vn_shm_unmap,
	vn_fetch,
	vn_unfetch,
};

/* ---- vfs methods -------------------------------------------------------- */

#define BASE(vfs) (((struct vn_config *)(vfs)->pAppData)->base)

static struct vn_db *new_db(struct vn_config *cfg, const char *name,
    const char *spool)
{
	struct vn_db *db = sqlite3_malloc(sizeof(*db));
	int rc;

	if (db == NULL)
		return NULL;
	memset(db, 0, sizeof(*db));
	db->name = name;
	db->canon = realpath(name, NULL);
	if (db->canon == NULL) {
		vn_warn("verneuil: %s: realpath: %s; NOT replicated", name,
		    strerror(errno));
		sqlite3_free(db);
		return NULL;
	}
	rc = vn_tracker_init(&db->tracker, &cfg->keys, db->canon, spool);
	if (rc != 0) {
		vn_warn("verneuil: %s: cannot locate the spool directory under "
		    "%s: %s; NOT replicated", db->canon, spool, strerror(rc));
		vn_tracker_fini(&db->tracker);
		free(db->canon);
		sqlite3_free(db);
		return NULL;
	}
	return db;
}

static int vn_open(sqlite3_vfs *vfs, const char *name, sqlite3_file *f,
    int flags, int *out_flags)
{
	struct vn_config *cfg = vfs->pAppData;
	sqlite3_vfs *base = cfg->base;
	struct vn_file *p = (struct vn_file *)f;
	char *spool = NULL;
	int rc, got_flags = 0;

	if ((flags & SQLITE_OPEN_MAIN_DB) == 0 || name == NULL ||
	    (flags & SQLITE_OPEN_READONLY) != 0)
		return base->xOpen(base, name, f, flags, out_flags);
	pthread_mutex_lock(&cfg->mutex);
	if (cfg->spool_dir != NULL)
		spool = strdup(cfg->spool_dir);
	pthread_mutex_unlock(&cfg->mutex);
	if (spool == NULL)
		return base->xOpen(base, name, f, flags, out_flags);

	memset(p, 0, sizeof(*p));
	p->real = (sqlite3_file *)&p[1];
	rc = base->xOpen(base, name, p->real, flags, &got_flags);
	if (out_flags != NULL)
		*out_flags = got_flags;
	if (rc != SQLITE_OK) {
		free(spool);
		f->pMethods = NULL;
		return rc;
	}
	if ((got_flags & SQLITE_OPEN_READONLY) == 0)
		p->db = new_db(cfg, name, spool);
	free(spool);
	f->pMethods = &vn_io_methods;
	return SQLITE_OK;
}

static int vn_delete(sqlite3_vfs *vfs, const char *name, int sync_dir)
{
	return BASE(vfs)->xDelete(BASE(vfs), name, sync_dir);
}

static int vn_access(sqlite3_vfs *vfs, const char *name, int flags, int *out)
{
	return BASE(vfs)->xAccess(BASE(vfs), name, flags, out);
}

static int vn_full_pathname(sqlite3_vfs *vfs, const char *name, int n,
    char *out)
{
	return BASE(vfs)->xFullPathname(BASE(vfs), name, n, out);
}

static void *vn_dl_open(sqlite3_vfs *vfs, const char *path)
{
	return BASE(vfs)->xDlOpen(BASE(vfs), path);
}

static void vn_dl_error(sqlite3_vfs *vfs, int n, char *msg)
{
	BASE(vfs)->xDlError(BASE(vfs), n, msg);
}

static void (*vn_dl_sym(sqlite3_vfs *vfs, void *h, const char *sym))(void)
{
	return BASE(vfs)->xDlSym(BASE(vfs), h, sym);
}

static void vn_dl_close(sqlite3_vfs *vfs, void *h)
{
	BASE(vfs)->xDlClose(BASE(vfs), h);
}

static int vn_randomness(sqlite3_vfs *vfs, int n, char *out)
{
	return BASE(vfs)->xRandomness(BASE(vfs), n, out);
}

static int vn_sleep(sqlite3_vfs *vfs, int us)
{
	return BASE(vfs)->xSleep(BASE(vfs), us);
}

static int vn_current_time(sqlite3_vfs *vfs, double *out)
{
	return BASE(vfs)->xCurrentTime(BASE(vfs), out);
}

static int vn_get_last_error(sqlite3_vfs *vfs, int n, char *out)
{
	return BASE(vfs)->xGetLastError(BASE(vfs), n, out);
}

static int vn_current_time_int64(sqlite3_vfs *vfs, sqlite3_int64 *out)
{
	return BASE(vfs)->xCurrentTimeInt64(BASE(vfs), out);
}

static int vn_set_system_call(sqlite3_vfs *vfs, const char *name,
    sqlite3_syscall_ptr p)
{
	return BASE(vfs)->xSetSystemCall(BASE(vfs), name, p);
}

static sqlite3_syscall_ptr vn_get_system_call(sqlite3_vfs *vfs,
    const char *name)
{
	return BASE(vfs)->xGetSystemCall(BASE(vfs), name);
}

static const char *vn_next_system_call(sqlite3_vfs *vfs, const char *name)
{
	return BASE(vfs)->xNextSystemCall(BASE(vfs), name);
}

/* ---- registration ------------------------------------------------------- */

/* Called with the mutex held. */
static int initialise(struct vn_config *cfg)
{
	sqlite3_vfs *base;

	if (cfg->initialised)
		return SQLITE_OK;
	base = sqlite3_vfs_find(NULL);
	if (base == NULL || base == &cfg->vfs)
		return SQLITE_ERROR;
	if (base->iVersion < 3)
		return SQLITE_ERROR; /* we forward the version-3 methods */
	vn_keys_derive(&cfg->keys);
	cfg->base = base;
	cfg->vfs = (sqlite3_vfs){
		.iVersion = 3,
		.szOsFile = (int)sizeof(struct vn_file) + base->szOsFile,
		.mxPathname = base->mxPathname,
		.zName = VERNEUIL_VFS_NAME,
		.pAppData = cfg,
		.xOpen = vn_open,
		.xDelete = vn_delete,
		.xAccess = vn_access,
		.xFullPathname = vn_full_pathname,
		.xDlOpen = vn_dl_open,
		.xDlError = vn_dl_error,
		.xDlSym = vn_dl_sym,
		.xDlClose = vn_dl_close,
		.xRandomness = vn_randomness,
		.xSleep = vn_sleep,
		.xCurrentTime = vn_current_time,
		.xGetLastError = vn_get_last_error,
		.xCurrentTimeInt64 = vn_current_time_int64,
		.xSetSystemCall = vn_set_system_call,
		.xGetSystemCall = vn_get_system_call,
		.xNextSystemCall = vn_next_system_call,
	};
	cfg->initialised = 1;
	return SQLITE_OK;
}

int verneuil_vfs_register(const char *spool_dir, int make_default)
{
	struct vn_config *cfg = &vn_config;
	char *copy = NULL;
	int rc;

	if (spool_dir != NULL && spool_dir[0] != 0) {
		copy = strdup(spool_dir);
		if (copy == NULL)
			return SQLITE_NOMEM;
	}
	/* sqlite3_log through this unit's API table in a loadable extension. */
	vn_log_set_sink(sqlite3_log);
	pthread_mutex_lock(&cfg->mutex);
	rc = initialise(cfg);
	if (rc == SQLITE_OK) {
		free(cfg->spool_dir);
		cfg->spool_dir = copy;
		copy = NULL;
		rc = sqlite3_vfs_register(&cfg->vfs, make_default);
	}
	pthread_mutex_unlock(&cfg->mutex);
	free(copy);
	if (rc == SQLITE_OK && spool_dir == NULL)
		vn_log(SQLITE_NOTICE, "verneuil: no replication_spooling_dir "
		    "configured; the verneuil VFS does not replicate");
	return rc;
}

void verneuil_vfs_set_gc_weight(double weight)
{
	pthread_mutex_lock(&vn_config.mutex);
	vn_config.gc_weight = weight;
	pthread_mutex_unlock(&vn_config.mutex);
}

int verneuil_vfs_set_bundle_chunks(int n)
{
	int old;

	if (n < 0 || n > VN_TOPS_MAX_CHUNKS)
		return -1;
	pthread_mutex_lock(&vn_config.mutex);
	old = (int)vn_config.bundle_chunks;
	vn_config.bundle_chunks = (size_t)n;
	pthread_mutex_unlock(&vn_config.mutex);
	return old;
}

unsigned long long verneuil_vfs_set_max_db_size(unsigned long long n)
{
	unsigned long long old;

	if (n == 0 || n > VN_MAX_DB_SIZE)
		return 0;
	pthread_mutex_lock(&vn_config.mutex);
	old = vn_config.max_db_size;
	vn_config.max_db_size = n;
	pthread_mutex_unlock(&vn_config.mutex);
	return old;
}

unsigned long long verneuil_vfs_max_db_size_limit(void)
{
	return VN_MAX_DB_SIZE;
}

void verneuil_vfs_set_log_stderr(int on)
{
	vn_log_set_stderr(on);
}

void verneuil_vfs_set_warn_stderr(int on)
{
	vn_log_set_warn_stderr(on);
}

int verneuil_vfs_db_spool_dir(const char *spool_dir, const char *db_path,
    char *out, size_t cap)
{
	struct vn_keys *keys = malloc(sizeof(*keys));
	int rc;

	if (keys == NULL)
		return ENOMEM;
	vn_keys_derive(keys);
	rc = vn_spool_db_dir(keys, spool_dir, db_path, out, cap);
	free(keys);
	return rc;
}

int verneuil_vfs_register_from_env(void)
{
	struct vn_env_config cfg;
	char why[VN_CONFIG_WHY_MAX];
	int rc;

	/* The sink before the first message (verneuil_vfs_register sets it
	 * too). */
	vn_log_set_sink(sqlite3_log);
	if (vn_config_from_env(&cfg, why, sizeof(why)) != 0)
		vn_log(SQLITE_WARNING, "verneuil: %s", why);
	if (cfg.warn_stderr >= 0)
		verneuil_vfs_set_warn_stderr(cfg.warn_stderr);
	if (cfg.max_db_size != 0 &&
	    verneuil_vfs_set_max_db_size(cfg.max_db_size) == 0)
		vn_log(SQLITE_WARNING, "verneuil: " VN_CONFIG_ENV ": max_db_size "
		    "%llu is out of range (1 to %llu bytes): ignored",
		    cfg.max_db_size, (unsigned long long)VN_MAX_DB_SIZE);
	rc = verneuil_vfs_register(cfg.spool, cfg.make_default);
	vn_config_free(&cfg);
	return rc;
}

int verneuil_vfs_config_from_env(char *spool, size_t spool_cap,
    size_t *spool_len, int *make_default, int *warn_stderr,
    unsigned long long *max_db_size, char *why, size_t why_cap)
{
	struct vn_env_config cfg;
	int rc;

	if (why_cap > 0)
		why[0] = 0;
	rc = vn_config_from_env(&cfg, why, why_cap);
	*spool_len = cfg.spool != NULL ? strlen(cfg.spool) : 0;
	if (spool_cap > 0)
		snprintf(spool, spool_cap, "%s", cfg.spool != NULL ? cfg.spool : "");
	*make_default = cfg.make_default;
	*warn_stderr = cfg.warn_stderr;
	*max_db_size = cfg.max_db_size;
	vn_config_free(&cfg);
	return rc;
}

/* ---- loadable extension entry points ------------------------------------ */

#ifdef VN_LOADABLE_EXTENSION
static int extension_init(char **errmsg)
{
	int rc = verneuil_vfs_register_from_env();

	if (rc != SQLITE_OK) {
		if (errmsg != NULL)
			*errmsg = sqlite3_mprintf("verneuil: cannot register "
			    "the VFS (SQLite error %d)", rc);
		return rc;
	}
	/* The VFS outlives the connection that loaded us. */
	return SQLITE_OK_LOAD_PERMANENTLY;
}

/* The name SQLite derives from libverneuil_vfs.so. */
__attribute__((visibility("default")))
int sqlite3_verneuilvfs_init(sqlite3 *db, char **errmsg,
    const sqlite3_api_routines *api)
{
	(void)db;
	SQLITE_EXTENSION_INIT2(api);
	return extension_init(errmsg);
}

/* The default entry point SQLite tries first. */
__attribute__((visibility("default")))
int sqlite3_extension_init(sqlite3 *db, char **errmsg,
    const sqlite3_api_routines *api)
{
	(void)db;
	SQLITE_EXTENSION_INIT2(api);
	return extension_init(errmsg);
}
#endif
