/*
 * Change tracking for one open main database file, and building a snapshot
 * in the spool after each commit.
 *
 * Rollback journal: dirty 64 KiB chunks and version ids (docs/FORMAT.md,
 * "Change detection on the writer").  The VFS (vfs.c) calls, in this order
 * for each write transaction:
 *   vn_tracker_write_locked()  when the lock goes from < RESERVED to >= RESERVED
 *   vn_tracker_before_write()  before every xWrite/xTruncate (writes the new
 *                              version xattr before the first one)
 *   vn_tracker_snapshot()      after downgrading to SHARED
 *   vn_tracker_reset()
 *
 * WAL (docs/WRITER.md, "WAL databases"): the committed state is the file
 * with the WAL's committed frames applied (wal.h); what changed since the
 * staged snapshot is the frames after the position its record names
 * (walrec.h).  The VFS calls vn_tracker_snapshot_wal() at each commit, and
 * when the WAL's last connection closes it, while no other writer can append
 * to the WAL or reset it.
 *
 * All of it runs on the connection's thread, under SQLite's locks, or on
 * the connection's stager thread (stager.h) while the connection's thread
 * leaves the tracker alone.
 */
#ifndef VN_TRACKER_H
#define VN_TRACKER_H

#include <stddef.h>
#include <stdint.h>

#include <sqlite3.h>

#include "btree_tops.h"
#include "log.h"
#include "manifest_pb.h"
#include "names.h"
#include "spool.h"
#include "wal.h"
#include "walrec.h"

/* The xattr holding the version UUID (docs/FORMAT.md). */
#define VN_VERSION_XATTR "user.verneuil.version_id"

/* Raw UUIDv4 bytes in the xattr. */
#define VN_UUID_BYTES 16

/* SQLite's file header: bytes [0, 100) are covered by header_fprint. */
#define VN_HEADER_BYTES 100
/* Its bytes 18 and 19: file format write and read versions, 1 for a
 * rollback journal, 2 for WAL. */
#define VN_HEADER_WAL_WRITE 18
#define VN_HEADER_WAL_READ 19

struct vn_tracker_stats {
	uint64_t full;        /* snapshots rebuilt from a full scan */
	uint64_t incremental; /* snapshots updated from the staged manifest */
	uint64_t unchanged;   /* nothing to publish: the staged one is current */
	uint64_t failed;      /* abandoned on an error (logged) */
	uint64_t hot_journal; /* skipped: hot journal at unlock */
	uint64_t verify_mismatch; /* random clean chunk re-hash forced a rebuild */
	uint64_t ready;       /* ready snapshots published */
	uint64_t gc;          /* GC passes */
	uint64_t gc_removed;  /* chunk files removed by GC */
	uint64_t staged;      /* chunk files written */
	uint64_t bundled;     /* chunks besides chunk 0 in the last manifest */
	uint64_t low_space;   /* of `failed`: the spool's file system was
	                       * short of space (VN_SPOOL_FREE_PERCENT) */
	uint64_t wal;         /* snapshots of WAL commits (of full, incremental
	                       * and unchanged) */
	uint64_t wal_frames;  /* WAL frames read as changes */
	uint64_t too_large;   /* refused: the file is past max_db_size */
};

/*
 * The largest database the writer replicates (max_db_size's default and
 * ceiling): whose manifest fits Verneuil's cap on a manifest
 * (VN_MAX_MANIFEST_BYTES) with room for the bundled chunks (2 MiB) and the
 * other fields (64 KiB), at 16 bytes per chunk: about 1.5 TiB.  The copier
 * and `verneuilctl lag` use the same bound (verneuil_fuse.format,
 * MAX_REPLICATED_DB_SIZE).
 */
#define VN_MAX_DB_SIZE \
	((uint64_t)((VN_MAX_MANIFEST_BYTES - (2u << 20) - (64u << 10)) / 16) * \
	    VN_CHUNK_SIZE)

/* A spool short of space stays so for a while (until copiers ship what it
 * holds): its abandoned snapshots are logged once a minute per database, not
 * once per commit. */
#define VN_LOW_SPACE_LOG_SECONDS 60
/* Any other abandoned snapshot is logged every time, and said on stderr at
 * most once a minute per database (a broken spool fails every commit). */
#define VN_ABANDON_WARN_SECONDS 60

struct vn_tracker {
	const char *path;          /* canonical db path (for xattrs); not owned */
	const struct vn_keys *keys;
	struct vn_spool spool;
	int spool_ok;              /* spool paths computed */

	uint64_t *dirty;           /* bitmap of dirty chunk indices */
	size_t dirty_words;
	int force_full;            /* next snapshot must be a full rebuild */
	int version_written;       /* new UUID written in this write period */
	int no_xattr;              /* the file system refused user xattrs */

	int base_valid;            /* version id seen at write lock */
	uint8_t base_version[VN_MAX_VERSION_ID];
	size_t base_version_len;
	/* The UUID this write period wrote to the xattr (valid if
	 * uuid_written): the snapshot's version id, without reading it back. */
	uint8_t uuid[VN_UUID_BYTES];
	int uuid_written;

	struct vn_spool_session session; /* kept open across snapshots */

	/*
	 * The staged manifest, decoded, as we last published or read it; valid
	 * while staging/meta/<name> is still that file (same vn_file_id), so
	 * that an incremental update neither reads nor decodes it.  Its chunk
	 * words (staged.chunks, capacity staged_cap words) are also the next
	 * snapshot's: updated in place, then written from where they are.
	 * staged.bundled0 is not kept (chunk 0 is re-read every time).
	 */
	struct vn_manifest staged;
	int staged_valid;
	size_t staged_cap;
	struct vn_file_id staged_id;

	uint8_t *buf;              /* VN_CHUNK_SIZE scratch for chunk reads */
	uint8_t *chunk0;           /* VN_CHUNK_SIZE: chunk 0 as of the snapshot */
	/* VN_CHUNK_SIZE each, allocated when first needed: the chunks bundled
	 * besides chunk 0 (btree_tops.h). */
	uint8_t *tops_buf[VN_TOPS_MAX_CHUNKS];
	uint64_t rng;              /* splitmix64 state for GC and verification */

	/* WAL mode: the WAL's index (wal_ok: vn_wal_init succeeded) and the
	 * record read with the staged manifest (rec_valid: it names it). */
	struct vn_wal wal;
	int wal_ok;
	struct vn_walrec rec;
	int rec_valid;

	struct vn_tracker_stats stats;
	int64_t low_space_logged_at; /* CLOCK_MONOTONIC seconds; 0: never */
	int64_t abandon_warned_at;   /* the same, for other abandons on stderr */
	int too_large_said;        /* the file past max_db_size was said */
};

/* gc_weight: GC runs with probability gc_weight * (chunks staged now) /
 * (chunks in the db): about every 1/gc_weight db-sizes of new chunks.
 * bundle_chunks: most chunks besides chunk 0 bundled in each manifest, those
 * holding the upper levels of the b-trees (at most VN_TOPS_MAX_CHUNKS).
 * pending_byte: see below. */
struct vn_snapshot_config {
	double gc_weight;
	size_t bundle_chunks;
	/* The byte whose page holds SQLite's lock bytes, a page SQLite never
	 * writes: 2^30 (SQLITE_TESTCTRL_PENDING_BYTE may move it). */
	uint64_t pending_byte;
	uint64_t max_db_size; /* a larger file is not replicated (at most
	                       * VN_MAX_DB_SIZE) */
};

/* canon_path: the file's canonical path (the spool's key and the xattrs');
 * db_name: SQLite's name for it (the WAL is db_name + "-wal"). */
int vn_tracker_init(struct vn_tracker *t, const struct vn_keys *keys,
    const char *canon_path, const char *db_name, const char *spool_root);
void vn_tracker_fini(struct vn_tracker *t);

void vn_tracker_write_locked(struct vn_tracker *t, sqlite3_file *db);
void vn_tracker_before_write(struct vn_tracker *t, uint64_t offset,
    uint64_t amount);
void vn_tracker_before_truncate(struct vn_tracker *t, uint64_t size);
void vn_tracker_reset(struct vn_tracker *t);

/* The hot journal check of docs/FORMAT.md: <db>-journal starts with the magic. */
int vn_journal_is_hot(const char *db_path);

/* Clears the version xattr, so the next snapshot is a full rebuild. */
void vn_tracker_clear_version(struct vn_tracker *t);

enum vn_snapshot_result {
	VN_SNAPSHOT_DONE = 0,
	VN_SNAPSHOT_EMPTY,   /* empty file: nothing to snapshot */
	VN_SNAPSHOT_WAL,     /* the header says WAL: the WAL path's to take */
	VN_SNAPSHOT_FAILED,  /* logged through vn_log; version id cleared */
	VN_SNAPSHOT_SPLIT,   /* WAL: the state has pages neither the file nor
			      * the WAL holds: the file is a piece of a
			      * database that a VFS above us splits */
	VN_SNAPSHOT_TOO_LARGE, /* past max_db_size: not replicated (said once) */
};

/* Brings staging up to date with `db` after a rollback-journal commit
 * (SHARED lock held by the caller).  A file whose header says WAL is left
 * to the WAL path (VN_SNAPSHOT_WAL), unless `into_wal`: the transaction
 * that just committed switched the file to WAL (before SQLite opens the
 * WAL); it is then snapshotted with its header as a rollback file's, and
 * recorded as the file (walrec.h) for the WAL commits that follow. */
enum vn_snapshot_result vn_tracker_snapshot(struct vn_tracker *t,
    sqlite3_file *db, const struct vn_snapshot_config *config, int into_wal);

/* One WAL commit as the VFS saw it. */
struct vn_wal_commit {
	int have_end;             /* end: the wal-index header at the commit;
				   * else the WAL file is read to its last
				   * commit frame (no shared memory) */
	struct vn_wal_pos end;
	int have_start;           /* start: the position when this writer's
				   * write lock (or transaction) began */
	struct vn_wal_pos start;
};

/*
 * Brings staging up to date with the committed state of a WAL database
 * after a commit, while no other writer can append to the WAL or reset it
 * (SQLite's WAL write lock, or an exclusive lock on the database).  The
 * position snapshotted (or found current) goes to *done (if not NULL) on
 * VN_SNAPSHOT_DONE.
 */
enum vn_snapshot_result vn_tracker_snapshot_wal(struct vn_tracker *t,
    sqlite3_file *db, const struct vn_wal_commit *c,
    const struct vn_snapshot_config *config, struct vn_wal_pos *done);

/*
 * Takes the spool's lock on the database's WAL snapshots (vn_spool_lock_wal:
 * one snapshot at a time among all its writers, in commit order), opening
 * the spool session if needed: 0, or -1 (logged) when the spool or the lock
 * cannot be had.  The lock goes with the session: held until
 * vn_tracker_wal_unlock().
 */
int vn_tracker_wal_lock(struct vn_tracker *t);
void vn_tracker_wal_unlock(struct vn_tracker *t);

/* Whether the WAL still holds, as committed, every frame up to `end`, each
 * verified again from its header (the index is read anew). */
int vn_tracker_wal_intact(struct vn_tracker *t, const struct vn_wal_pos *end);

#endif /* VN_TRACKER_H */
