/*
 * The `verneuil` VFS: a thin shim over the default VFS, in the shape of
 * SQLite's ext/misc/cksumvfs.c.  Only main database files are wrapped
 * (SQLITE_OPEN_MAIN_DB, opened read-write, with a spool configured);
 * journals, WAL files, temp files and everything else pass straight through.
 *
 * Commit detection, rollback journal: a write transaction ends with xUnlock
 * from >= RESERVED to <= SHARED.  We then check for a hot journal (while
 * still holding the write lock, so no other writer can be writing the
 * journal), downgrade to SHARED with the underlying xUnlock, bring the
 * spool's `staging` snapshot up to date while holding that read lock
 * (tracker.c, spool.c), and only then finish unlocking.
 *
 * Commit detection, WAL (docs/WRITER.md, "WAL databases"): writers take
 * the WAL write lock (xShmLock, slot 0, exclusive) on the main file; its
 * release ends every write transaction, checkpoint or recovery that held it.
 * Before forwarding that release we read the wal-index header, and if it
 * names another state than the one last handed over, hand it to the
 * connection's stager thread (stager.h), which pins a committed state with
 * a WAL read mark of its own and snapshots it off the commit path.  Where
 * pinning is not possible (no thread-safe SQLite, the side file does not
 * open, no read mark obtained) the commit is snapshotted right there, before
 * the release (nobody can append to the WAL or reset it meanwhile).  Before
 * the connection's thread uses the tracker again (closing, leaving WAL,
 * pragmas) it drains the stager; before a WAL reset may follow (the
 * wal-index says every frame is in the file) or a checkpoint that waits for
 * readers, it has the stager stage the newest state now, so that the reset
 * keeps the next snapshot incremental and the checkpoint never meets our
 * pin.  With locking_mode=EXCLUSIVE
 * SQLite takes no shm lock: the commit is SQLITE_FCNTL_COMMIT_PHASETWO,
 * which SQLite sends after each commit, under the exclusive lock on the file.
 * When the last connection closes the WAL (a complete checkpoint under the
 * exclusive lock, then the WAL deleted), the file is the committed state:
 * the staged snapshot is recorded as the file (or made from it, if it was
 * not that state), so the next session's first commit is incremental too.
 *
 * Any replication error is logged; SQLite never sees it.
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
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "stager.h"
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
	int wal_async;         /* WAL commits staged by a stager thread; read
				* without the mutex (__atomic) */
};

static struct vn_config vn_config = {
	.mutex = PTHREAD_MUTEX_INITIALIZER,
	.gc_weight = VN_GC_WEIGHT_DEFAULT,
	.bundle_chunks = VN_BUNDLE_CHUNKS_DEFAULT,
	.max_db_size = VN_MAX_DB_SIZE,
	.wal_async = 1,
};

/* State of one wrapped main database file. */
struct vn_db {
	int lock;          /* our view of the lock level held */
	int wal;           /* the db is in WAL mode: writes to the file are
			    * checkpoints, not tracked */
	int shm_above;     /* WAL with shared memory out of our sight (a VFS
			    * layered above us implements it): not replicated */
	int split;         /* WAL with pages the file does not hold (a VFS
			    * above us spreads the database over several
			    * files): not replicated */
	char *canon;       /* realpath of the database */
	const char *name;  /* SQLite's name for it (valid until xClose): the
			    * journal is name + "-journal", the WAL name + "-wal" */
	/* WAL, shared memory: the wal-index's first region as mapped through
	 * us, whether this connection holds the WAL write lock, and the
	 * wal-index header when it took it (hold_start_ok: a valid one). */
	const volatile void *shm0;
	int wal_hold;
	int hold_start_ok;
	struct vn_wal_pos hold_start;
	/* The state this connection last snapshotted (or found current). */
	int last_ok;
	struct vn_wal_pos last;
	/* WAL, locking_mode=EXCLUSIVE: `last` is the state before the next
	 * transaction, since the exclusive lock was held since (excl_trusted). */
	int excl_trusted;
	/*
	 * WAL, shared memory: the stager thread (NULL: none yet, or async_off:
	 * commits are snapshotted on the commit path), the position last
	 * handed to it (handed_ok), whether this connection holds the
	 * checkpoint lock, and the commits snapshotted on the commit path.
	 * While the stager may run, it alone uses the tracker, `last`,
	 * `last_ok` and `split`.
	 */
	struct vn_stager *stager;
	int async_off;
	int handed_ok;
	struct vn_wal_pos handed;
	int ckpt_hold;
	uint64_t wal_sync;
	struct vn_tracker tracker;
};

struct vn_file {
	sqlite3_file base;
	sqlite3_file *real; /* the underlying file, allocated right after us */
	struct vn_db *db;   /* NULL: pass everything through */
};

#define REAL(f) (((struct vn_file *)(f))->real)
#define DB(f) (((struct vn_file *)(f))->db)

static void wal_commit(sqlite3_file *f, struct vn_db *db,
    const struct vn_wal_commit *c);

/* The stager is idle: the tracker is the connection thread's again.  No
 * bound: the wait is for one snapshot, which the commit path would have
 * taken (vn_stager_drain logs a long one). */
static void drain(struct vn_db *db)
{
	if (db != NULL && db->stager != NULL)
		vn_stager_drain(db->stager, -1);
}

/* No stager any more (its last handed commit staged): the WAL is being
 * closed or left, or the file is. */
static void stop_stager(struct vn_db *db)
{
	if (db != NULL && db->stager != NULL) {
		vn_stager_stop(db->stager);
		db->stager = NULL;
	}
	if (db != NULL)
		db->handed_ok = 0;
}

/* ---- io methods --------------------------------------------------------- */

/*
 * A WAL database closed by its last connection, the exclusive lock still
 * held, with no shared memory in our sight (locking_mode=EXCLUSIVE, or a
 * VFS above us that emulates it): SQLite copied every frame into the file
 * and deleted the WAL, so the file is the committed state.  Snapshotted
 * from the file (recorded as the file, for the next session's first
 * commit); usually the staged snapshot is that state already, which costs a
 * look at the record.  `start`: the state before the WAL went (NULL:
 * unknown).
 */
static void wal_closed(sqlite3_file *f, struct vn_db *db,
    const struct vn_wal_pos *start)
{
	struct vn_wal_commit c = { .have_start = start != NULL };
	char *wal;
	int gone;

	if (start != NULL)
		c.start = *start;
	wal = sqlite3_mprintf("%s-wal", db->name);
	gone = wal != NULL && access(wal, F_OK) != 0 && errno == ENOENT;
	sqlite3_free(wal);
	if (gone)
		wal_commit(REAL(f), db, &c);
}

static int vn_close(sqlite3_file *f)
{
	struct vn_db *db = DB(f);
	int rc;

	stop_stager(db);
	/* locking_mode=EXCLUSIVE: no unlock before the close. */
	if (db != NULL && db->wal && db->lock >= SQLITE_LOCK_EXCLUSIVE)
		wal_closed(f, db, db->excl_trusted && db->last_ok ?
		    &db->last : NULL);
	rc = REAL(f)->pMethods->xClose(REAL(f));

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
	int rc;

	/* Past SHARED in WAL mode: closing the WAL, leaving it, or
	 * locking_mode=EXCLUSIVE; the stager then holds no lock of its own
	 * that would refuse ours, and the tracker is ours again. */
	if (level > SQLITE_LOCK_SHARED)
		drain(db);
	rc = REAL(f)->pMethods->xLock(REAL(f), level);

	if (rc != SQLITE_OK || db == NULL || level <= db->lock)
		return rc;
	if (db->lock < SQLITE_LOCK_RESERVED && level >= SQLITE_LOCK_RESERVED &&
	    !db->wal)
		vn_tracker_write_locked(&db->tracker, REAL(f));
	db->lock = level;
	return rc;
}

/* Creates the database's spool directory and its `source`, so that
 * `verneuilctl lag` lists it even with no snapshot yet. */
static void announce_db(struct vn_db *db)
{
	struct vn_spool_session s;

	vn_spool_session_init(&s);
	if (db->tracker.spool_ok && vn_spool_open(&db->tracker.spool, &s) == 0)
		vn_spool_close(&s);
}

/* SQLite's lock bytes start here unless a program moved them (SQLite's
 * test suite does, with SQLITE_TESTCTRL_PENDING_BYTE). */
#define VN_PENDING_BYTE 0x40000000

/* The configuration a snapshot uses. */
static void snapshot_config(struct vn_snapshot_config *sc)
{
	struct vn_config *cfg = &vn_config;
	/* Asked with 0, SQLite tells where they are and changes nothing. */
	int pending = sqlite3_test_control(SQLITE_TESTCTRL_PENDING_BYTE, 0);

	pthread_mutex_lock(&cfg->mutex);
	sc->gc_weight = cfg->gc_weight;
	sc->bundle_chunks = cfg->bundle_chunks;
	sc->max_db_size = cfg->max_db_size;
	pthread_mutex_unlock(&cfg->mutex);
	sc->pending_byte = pending > 0 ? (uint64_t)pending : VN_PENDING_BYTE;
}

static_assert(VN_HEADER_WAL_READ == VN_HEADER_WAL_WRITE + 1,
    "the header's format versions are adjacent");

/* Whether the file's header still declares WAL (or cannot be read: then
 * keep assuming WAL, which the WAL path handles, never wrongly). */
static int header_says_wal(sqlite3_file *f)
{
	unsigned char v[2];

	if (REAL(f)->pMethods->xRead(REAL(f), v, sizeof(v),
		VN_HEADER_WAL_WRITE) != SQLITE_OK)
		return 1;
	return v[0] == 2 || v[1] == 2;
}

/* A write transaction ended: snapshot under SHARED, then finish unlocking. */
static int unlock_after_write(sqlite3_file *f, struct vn_db *db, int level)
{
	struct vn_snapshot_config sc;
	int hot, rc;

	if (db->shm_above && header_says_wal(f)) {
		/* The WAL's last connection closed it (its shared memory out
		 * of our sight), still holding the exclusive lock. */
		wal_closed(f, db, NULL);
	}
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
		snapshot_config(&sc);
		/* A header that says WAL: the WAL path takes its commits. */
		if (vn_tracker_snapshot(&db->tracker, REAL(f), &sc, 0) ==
		    VN_SNAPSHOT_WAL)
			db->wal = 1;
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

	if (db != NULL && level < SQLITE_LOCK_EXCLUSIVE)
		db->excl_trusted = 0; /* others may write the WAL from now on */

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

/* Longest PRAGMA verneuil_wait_staged may ask to wait: a minute, far more
 * than a snapshot takes, short enough to notice a stuck file system. */
#define VN_WAIT_STAGED_MAX_MS 60000

/* PRAGMA verneuil_wait_staged[=ms]: waits (default and most:
 * VN_WAIT_STAGED_MAX_MS) until every commit of this connection is staged. */
static char *wait_staged(struct vn_db *db, const char *arg)
{
	long long ms = arg != NULL ? strtoll(arg, NULL, 10) : VN_WAIT_STAGED_MAX_MS;

	if (ms < 0 || ms > VN_WAIT_STAGED_MAX_MS)
		ms = VN_WAIT_STAGED_MAX_MS;
	if (db == NULL)
		return sqlite3_mprintf("not replicated");
	if (db->stager != NULL && vn_stager_drain(db->stager, ms) != 0)
		return sqlite3_mprintf("timeout");
	return sqlite3_mprintf("ok");
}

static char *stats_line(struct vn_db *db)
{
	const struct vn_tracker_stats *s = &db->tracker.stats;
	struct vn_stager_stats a;

	vn_stager_stats(db->stager, &a);
	return sqlite3_mprintf("full=%llu incremental=%llu "
	    "unchanged=%llu failed=%llu hot_journal=%llu "
	    "verify_mismatch=%llu ready=%llu gc=%llu gc_removed=%llu "
	    "staged=%llu bundled=%llu low_space=%llu too_large=%llu "
	    "wal=%d wal_snapshots=%llu wal_frames=%llu wal_unreplicated=%d "
	    "no_xattr=%d wal_async=%llu wal_coalesced=%llu wal_sync=%llu",
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
	    (unsigned long long)s->wal,
	    (unsigned long long)s->wal_frames, db->shm_above || db->split,
	    db->tracker.no_xattr, (unsigned long long)a.async,
	    (unsigned long long)a.coalesced,
	    (unsigned long long)db->wal_sync);
}

static int pragma(sqlite3_file *f, char **args)
{
	struct vn_db *db = DB(f);
	const char *name = args[1];

	if (strcasecmp(name, "verneuil_wait_staged") == 0) {
		args[0] = wait_staged(db, args[2]);
		return SQLITE_OK;
	}
	if (strncasecmp(name, "verneuil_", 9) == 0)
		drain(db); /* ours: the tracker is this thread's again */
	if (strcasecmp(name, "verneuil_full_snapshot") == 0) {
		if (db != NULL) {
			db->tracker.force_full = 1;
			db->handed_ok = 0;
		}
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
		args[0] = db == NULL ? sqlite3_mprintf("not replicated") :
		    stats_line(db);
		return SQLITE_OK;
	}
	if (strcasecmp(name, "verneuil_spool_dir") == 0) {
		args[0] = sqlite3_mprintf("%s", db != NULL && db->tracker.spool_ok ?
		    db->tracker.spool.db_dir : "");
		return SQLITE_OK;
	}
	return REAL(f)->pMethods->xFileControl(REAL(f), SQLITE_FCNTL_PRAGMA, args);
}

/* ---- WAL commits -------------------------------------------------------- */

/* This connection cannot replicate the database's WAL commits (why: said
 * once, on stderr and in the log): its replicas stay where they are. */
static void not_replicated(struct vn_db *db, const char *why)
{
	if (!db->wal)
		db->wal = 1;
	announce_db(db);
	vn_warn("verneuil: %s: %s: it is NOT replicated", db->canon, why);
}

/* A WAL commit, seen under the WAL write lock (c->have_end), the exclusive
 * lock on the file, or pinned by the stager: the snapshot, read through
 * `file`, remembered as `last`.  The caller holds the spool's lock on the
 * database's snapshots (vn_tracker_wal_lock), or could not have it. */
static void wal_commit_locked(sqlite3_file *file, struct vn_db *db,
    const struct vn_wal_commit *c)
{
	struct vn_snapshot_config sc;

	enum vn_snapshot_result res;

	if (db->split)
		return;
	snapshot_config(&sc);
	res = vn_tracker_snapshot_wal(&db->tracker, file, c, &sc, &db->last);
	db->last_ok = res == VN_SNAPSHOT_DONE;
	if (res == VN_SNAPSHOT_SPLIT) {
		db->split = 1;
		not_replicated(db, "its WAL holds pages the file does not: the "
		    "database is spread over several files by another VFS "
		    "layered above verneuil (SQLite's multiplexor does)");
	}
}

/* The same on the connection's thread, under SQLite's locks: the spool's
 * lock too (a stager of another connection may be staging), or without it
 * when it cannot be had (SQLite's lock orders these snapshots). */
static void wal_commit(sqlite3_file *file, struct vn_db *db,
    const struct vn_wal_commit *c)
{
	int locked = vn_tracker_wal_lock(&db->tracker) == 0;

	wal_commit_locked(file, db, c);
	if (locked)
		vn_tracker_wal_unlock(&db->tracker);
}

/* The stager's work: a pinned committed state, the database read through
 * the side file, under the spool's lock on the database's snapshots. */
static int stage_lock(void *arg)
{
	return vn_tracker_wal_lock(&((struct vn_db *)arg)->tracker);
}

static void stage_pinned(void *arg, sqlite3_file *side,
    const struct vn_wal_commit *c, struct vn_stage_result *out)
{
	struct vn_db *db = arg;

	wal_commit_locked(side, db, c);
	out->ok = db->last_ok;
	out->done = db->last;
}

static void stage_unlock(void *arg)
{
	vn_tracker_wal_unlock(&((struct vn_db *)arg)->tracker);
}

static const struct vn_stage_ops stage_ops = {
	.lock = stage_lock,
	.stage = stage_pinned,
	.unlock = stage_unlock,
};

/* Value of (uintptr_t)sqlite3_mutex_alloc() when SQLite runs without
 * mutexes (SQLITE_CONFIG_SINGLETHREAD: its no-op mutexes), as src/mutex_noop.c
 * returns it.  The unix VFS then guards no shared-memory call, and a second
 * thread of ours must not make any. */
#define VN_NOOP_MUTEX ((uintptr_t)8)

static int sqlite_has_mutexes(void)
{
	sqlite3_mutex *m;
	int on;

	if (!sqlite3_threadsafe())
		return 0;
	m = sqlite3_mutex_alloc(SQLITE_MUTEX_FAST);
	if (m == NULL)
		return 0;
	on = (uintptr_t)m != VN_NOOP_MUTEX;
	if (on)
		sqlite3_mutex_free(m);
	return on;
}

/*
 * Hands the commit c->end to the stager (started at the first commit): 0,
 * or -1 when the commit path must snapshot it (no stager possible, or it
 * failed).  A position already handed over is not handed again.
 */
static int hand_over(struct vn_db *db, const struct vn_wal_commit *c)
{
	const struct vn_wal_pos *reset = NULL;

	if (db->async_off ||
	    !__atomic_load_n(&vn_config.wal_async, __ATOMIC_RELAXED))
		return -1;
	if (db->stager == NULL) {
		if (sqlite_has_mutexes())
			db->stager = vn_stager_start(vn_config.base, db->name,
			    db->canon, &stage_ops, db);
		if (db->stager == NULL) {
			db->async_off = 1;
			vn_log(SQLITE_NOTICE, "verneuil: %s: no stager thread; "
			    "WAL commits are snapshotted on the commit path",
			    db->canon);
			return -1;
		}
	}
	if (db->handed_ok && !vn_wal_salt_none(c->end.salt) &&
	    vn_wal_pos_equal(&c->end, &db->handed))
		return 0;
	/* This writer reset the WAL under its write lock: the file was the
	 * state where the lock began (judge_wal in tracker.c). */
	if (c->have_start && memcmp(c->start.salt, c->end.salt,
	    sizeof(c->end.salt)) != 0)
		reset = &c->start;
	if (vn_stager_hand(db->stager, &c->end, reset) != 0) {
		db->async_off = 1;
		return -1;
	}
	db->handed = c->end;
	db->handed_ok = 1;
	return 0;
}

/* The WAL write lock is about to be released (shared memory). */
static void wal_unlocking(sqlite3_file *f, struct vn_db *db)
{
	struct vn_wal_commit c = { .have_end = 1,
	    .have_start = db->hold_start_ok, .start = db->hold_start };

	db->wal_hold = 0;
	if (vn_walindex_read(db->shm0, &c.end) != 0)
		return; /* no valid header: nothing committed to read */
	if (hand_over(db, &c) == 0)
		return;
	drain(db); /* a stager turned off or failed: the tracker is ours */
	/* A rolled-back transaction, a checkpoint or a recovery that changed
	 * nothing: the state this connection snapshotted last.  Not so with
	 * no WAL generation: the state is then the file, which may change
	 * under the same position (another session, a file put in place). */
	if (db->last_ok && !db->tracker.force_full &&
	    !vn_wal_salt_none(c.end.salt) &&
	    vn_wal_pos_equal(&c.end, &db->last))
		return;
	db->wal_sync++;
	wal_commit(REAL(f), db, &c);
}

/* The switch to WAL just committed (a rollback-journal transaction rewrote
 * the header): snapshot the file now, before SQLite opens the WAL. */
static void into_wal(sqlite3_file *f, struct vn_db *db)
{
	struct vn_snapshot_config sc;

	db->wal = 1;
	if (vn_journal_is_hot(db->name)) {
		vn_tracker_clear_version(&db->tracker);
	} else {
		snapshot_config(&sc);
		vn_tracker_snapshot(&db->tracker, REAL(f), &sc, 1);
	}
	vn_tracker_reset(&db->tracker);
}

/* A WAL commit with no shared-memory lock under a shared lock on the file:
 * a VFS above us implements the WAL's shared memory, and hides its write
 * lock, without which a commit's state cannot be read safely. */
static void shm_out_of_sight(struct vn_db *db)
{
	db->shm_above = 1;
	not_replicated(db, "its WAL's shared memory is handled by another VFS "
	    "layered above verneuil, which hides the WAL's write lock (open it "
	    "with vfs=verneuil directly, or with locking_mode=EXCLUSIVE)");
}

/*
 * SQLITE_FCNTL_COMMIT_PHASETWO: SQLite committed a transaction.  A rollback
 * transaction (it wrote the file) is snapshotted at its unlock, unless it
 * switched the file to WAL.  A WAL commit under the exclusive lock
 * (locking_mode=EXCLUSIVE: no shm locks) is snapshotted here, the WAL read
 * to its last commit frame; one under the WAL write lock was at its release.
 */
static void commit_phase_two(sqlite3_file *f, struct vn_db *db)
{
	struct vn_wal_commit c = { .have_start = 0 };

	if (db->tracker.version_written) {
		if (!db->wal && header_says_wal(f))
			into_wal(f, db);
		return;
	}
	if (db->lock < SQLITE_LOCK_EXCLUSIVE) {
		if (db->shm0 == NULL && !db->shm_above && header_says_wal(f))
			shm_out_of_sight(db);
		return;
	}
	if (!header_says_wal(f)) {
		if (db->wal) { /* it left WAL: its writes were not tracked */
			db->wal = 0;
			db->tracker.force_full = 1;
		}
		return;
	}
	db->wal = 1;
	c.have_start = db->excl_trusted && db->last_ok;
	c.start = db->last;
	wal_commit(REAL(f), db, &c);
	db->excl_trusted = db->last_ok;
}

static int vn_file_control(sqlite3_file *f, int op, void *arg)
{
	struct vn_db *db = DB(f);

	if (op == SQLITE_FCNTL_PRAGMA)
		return pragma(f, (char **)arg);
	if (op == VERNEUIL_FCNTL_WAL_UNREPLICATED) {
		drain(db);
		*(int *)arg = db != NULL && (db->shm_above || db->split);
		return SQLITE_OK;
	}
	if (op == SQLITE_FCNTL_COMMIT_PHASETWO && db != NULL)
		commit_phase_two(f, db);
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
	int rc = REAL(f)->pMethods->xShmMap(REAL(f), pg, pgsz, extend, pp);

	if (db != NULL) {
		db->wal = 1;
		if (rc == SQLITE_OK && pg == 0 && *pp != NULL)
			db->shm0 = *pp;
	}
	return rc;
}

/* Whether a shm lock range holds slot 0, SQLite's WAL write lock, or slot
 * 1, the checkpointer's. */
#define HOLDS_WRITE_LOCK(offset, n) ((offset) <= 0 && (offset) + (n) > 0)
#define HOLDS_CKPT_LOCK(offset, n) ((offset) <= 1 && (offset) + (n) > 1)

/*
 * The WAL write lock was just taken.  If a WAL reset may follow (every frame
 * is in the file) or this is a checkpoint that waits for readers (FULL,
 * RESTART, TRUNCATE: the checkpoint lock, then the write lock), the stager
 * stages the newest state now: no commit can come meanwhile, the reset
 * then finds the staged snapshot at the state it starts from (the next
 * snapshot is incremental), and neither meets our pin.
 */
static void write_locked(struct vn_db *db)
{
	db->hold_start_ok = vn_walindex_read(db->shm0, &db->hold_start) == 0;
	if (db->stager != NULL && db->hold_start_ok && (db->ckpt_hold ||
	    vn_walindex_backfilled(db->shm0, &db->hold_start)))
		vn_stager_stage_now(db->stager, &db->hold_start);
}

static int vn_shm_lock(sqlite3_file *f, int offset, int n, int flags)
{
	struct vn_db *db = DB(f);
	int rc;

	if (db != NULL && db->wal_hold && HOLDS_WRITE_LOCK(offset, n) &&
	    flags == (SQLITE_SHM_UNLOCK | SQLITE_SHM_EXCLUSIVE))
		wal_unlocking(f, db);
	/* A checkpoint starts (autocheckpoints included): this process's
	 * stagers of the database finish first, so that it copies every frame
	 * as if they were not there (one staging's wait, once per checkpoint;
	 * an autocheckpoint then completes and the WAL is reset, whatever the
	 * commit rate). */
	if (db != NULL && db->shm0 != NULL && HOLDS_CKPT_LOCK(offset, n) &&
	    flags == (SQLITE_SHM_LOCK | SQLITE_SHM_EXCLUSIVE))
		vn_stagers_drain_file(db->canon);
	rc = REAL(f)->pMethods->xShmLock(REAL(f), offset, n, flags);
	if (db == NULL || rc != SQLITE_OK ||
	    (flags & SQLITE_SHM_EXCLUSIVE) == 0)
		return rc;
	if (HOLDS_CKPT_LOCK(offset, n))
		db->ckpt_hold = (flags & SQLITE_SHM_LOCK) != 0;
	if (HOLDS_WRITE_LOCK(offset, n) && (flags & SQLITE_SHM_LOCK) != 0) {
		db->wal_hold = 1;
		db->excl_trusted = 0;
		write_locked(db);
	}
	return rc;
}

static void vn_shm_barrier(sqlite3_file *f)
{
	REAL(f)->pMethods->xShmBarrier(REAL(f));
}

/*
 * The WAL's last connection copied every frame into the file (a complete
 * checkpoint under the exclusive lock) and is about to delete the WAL: the
 * file is now the database, whole (SQLite may have left it longer than the
 * last commit's pages: SQLITE_FCNTL_CHUNK_SIZE).  Snapshotted as the file
 * with no WAL (recorded as the file, so the next session's first commit is
 * incremental): from the staged snapshot when that is the state the
 * wal-index names and the WAL still holds those frames (what another
 * program wrote into them since went into the file too), else from a full
 * scan.
 */
static void wal_checkpointed(sqlite3_file *f, struct vn_db *db)
{
	struct vn_wal_commit c = { .have_end = 1 }; /* no WAL: the file */

	if (db->split || vn_walindex_read(db->shm0, &c.start) != 0)
		return;
	c.have_start = vn_tracker_wal_intact(&db->tracker, &c.start);
	wal_commit(REAL(f), db, &c);
}

static int vn_shm_unmap(sqlite3_file *f, int delete_flag)
{
	struct vn_db *db = DB(f);

	if (db != NULL) {
		stop_stager(db);
		/* SQLite unmaps to delete the WAL after a complete checkpoint
		 * (under an exclusive lock on the file), or to close. */
		if (delete_flag)
			wal_checkpointed(f, db);
		/* Maybe back to a rollback journal, whose first commit then
		 * rebuilds the snapshot (its writes were not tracked). */
		db->wal = 0;
		db->shm0 = NULL;
		db->wal_hold = 0;
		db->last_ok = 0;
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
	rc = vn_tracker_init(&db->tracker, &cfg->keys, db->canon, name, spool);
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

int verneuil_vfs_set_wal_async(int on)
{
	return __atomic_exchange_n(&vn_config.wal_async, on != 0,
	    __ATOMIC_RELAXED);
}

int verneuil_vfs_wait_staged(int timeout_ms)
{
	return vn_stagers_drain_all(timeout_ms < 0 ? 0 : timeout_ms) == 0 ?
	    0 : -1;
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
