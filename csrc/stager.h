/*
 * WAL commits staged off the commit path (docs/WRITER.md, "WAL databases",
 * "The stager").  One stager thread per connection that commits to a WAL
 * database with shared memory: the commit path hands it the position the
 * wal-index names (vn_stager_hand: a mutex, a flag, a signal) and returns;
 * the thread takes the spool's lock on the database's snapshots, PINS the
 * newest committed state the way a SQLite reader does (a read mark of the
 * wal-index, through a side file of the database opened with the
 * underlying VFS), stages it, unpins and unlocks.
 *
 * While the pin is held no checkpoint copies frames past the pinned frame
 * into the file and no writer resets the WAL, so the file plus frames
 * 1..mx is exactly that committed state, whatever the writers do meanwhile.
 * Commits handed over while the thread is busy are coalesced: it always
 * pins the newest committed state, so the staged snapshot is the source at
 * some committed state and converges to the newest (a newer snapshot
 * replaces an older one, as the spool already does).
 *
 * The stage functions own everything they touch (the tracker): the
 * connection's thread uses it only after vn_stager_drain() said the thread
 * is idle.  Nothing here calls SQLite's API, only the methods of the
 * underlying VFS and its files (it is built into the loadable extension).
 */
#ifndef VN_STAGER_H
#define VN_STAGER_H

#include <stdint.h>

#include <sqlite3.h>

#include "tracker.h"
#include "wal.h"

/* What one staging did, for the stager's counters and the commit path. */
struct vn_stage_result {
	int ok;                 /* `done` is the staged state */
	struct vn_wal_pos done;
};

/*
 * What the thread calls, with the `arg` given to vn_stager_start:
 *   lock:   before pinning, the lock that orders the database's snapshots
 *           among its writers (vn_tracker_wal_lock): 0, or -1 (nothing is
 *           staged this time);
 *   stage:  stages the committed state `c` names (c->have_end: the pinned
 *           position), reading the database through `side`;
 *   unlock: after unpinning.
 * Taking the lock before the pin makes every staging pin a state at least
 * as new as the one staged before it: snapshots are published in commit
 * order, whichever writer stages them.
 */
struct vn_stage_ops {
	int (*lock)(void *arg);
	void (*stage)(void *arg, sqlite3_file *side,
	    const struct vn_wal_commit *c, struct vn_stage_result *out);
	void (*unlock)(void *arg);
};

struct vn_stager;

struct vn_stager_stats {
	uint64_t async;      /* stagings done by the stager thread */
	uint64_t coalesced;  /* commits handed over and covered by a later
			      * staging */
	uint64_t pin_failed; /* no read mark obtained in VN_PIN_TRIES tries */
};

/*
 * Opens the side file (base's xOpen on db_name, SQLite's name of the
 * database, valid while the connection is open), maps the wal-index's
 * region 0 through it and starts the thread.  `canon` (the database's
 * canonical path, valid until vn_stager_stop) names it for
 * vn_stagers_drain_file().  NULL when any of it fails (the caller stages
 * synchronously).
 */
struct vn_stager *vn_stager_start(sqlite3_vfs *base, const char *db_name,
    const char *canon, const struct vn_stage_ops *ops, void *arg);

/*
 * The commit path: `end` was committed (the wal-index header at the release
 * of the WAL write lock); `reset_from` (NULL: none) is the position when
 * the write lock was taken if this writer reset the WAL under it.  Returns
 * 0, or -1 if the stager cannot stage (it failed, or this is a forked
 * child): stage synchronously.
 */
int vn_stager_hand(struct vn_stager *s, const struct vn_wal_pos *end,
    const struct vn_wal_pos *reset_from);

/*
 * Waits until everything handed over is staged and the thread is idle (a
 * gap before the next pin is cut short).  0, or -1 after timeout_ms
 * milliseconds (< 0: until done, logging every VN_DRAIN_WARN_SECONDS).
 */
int vn_stager_drain(struct vn_stager *s, int64_t timeout_ms);

/*
 * Under the WAL write lock, at `now` (the newest committed state): has the
 * thread stage `now` unless it is what it staged last, and waits for it.
 * 0 when `now` is staged; -1 if it could not be.
 */
int vn_stager_stage_now(struct vn_stager *s, const struct vn_wal_pos *now);

/* Drains, stops and joins the thread, closes the side file, frees s. */
void vn_stager_stop(struct vn_stager *s);

/* The counters (read after a drain, or racing the thread's updates). */
void vn_stager_stats(struct vn_stager *s, struct vn_stager_stats *out);

/*
 * Whether the wal-index says every frame up to the header's last is in the
 * file (nBackfill == mxFrame > 0): the next write transaction may reset the
 * WAL.  region0: the wal-index's first region.
 */
int vn_walindex_backfilled(const volatile void *region0,
    const struct vn_wal_pos *pos);

/* Waits (at most timeout_ms) for every stager of the process to be idle: 0,
 * or -1 on timeout. */
int vn_stagers_drain_all(int64_t timeout_ms);

/* Drains every stager of the process on the database at `canon` (a
 * checkpoint is about to start: it then meets no pin of this process). */
void vn_stagers_drain_file(const char *canon);

#endif /* VN_STAGER_H */
