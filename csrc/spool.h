/*
 * The spool (docs/SPOOL.md): boot root, per-database directory, staging and
 * ready snapshots, publish by rename, garbage collection.  Its files are
 * named with the store's object names (names.h).
 *
 * Everything here is a wait-free sequence of POSIX file operations: files are
 * fully written and made read-only in `staging/scratch` before rename(2)
 * publishes them, so a crash at any point leaves only unreferenced scratch.
 * Nothing is fsynced: the boot root changes after a reboot, so state from a
 * previous boot is never trusted.
 *
 * Callers (tracker.c) hold SQLite's SHARED lock on the database while they
 * use a session, and for a WAL database vn_spool_lock_wal() too: that is the
 * only synchronisation between writers.
 *
 * Functions return 0 on success or an errno value, and record in
 * session->what which operation failed, for the log.
 */
#ifndef VN_SPOOL_H
#define VN_SPOOL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

#include "names.h"

/* Where one database's snapshots live. */
struct vn_spool {
	char *db_dir;  /* <spool>/<boot_id>.<boot_time>/<dbdir> */
	char *source;  /* canonical path of the database */
	char manifest_name[VN_MANIFEST_NAME_MAX];
};

/*
 * Computes the paths for the database at canonical path `canon` (which must
 * exist: its st_dev and st_ino name the directory).  Creates nothing.
 */
int vn_spool_init(struct vn_spool *spool, const struct vn_keys *keys,
    const char *spool_root, const char *canon);
void vn_spool_fini(struct vn_spool *spool);

/* Fills `buf` with random bytes (getrandom(2); never fails silently: falls
 * back to /dev/urandom, then to clock and pid mixing). */
void vn_random_bytes(void *buf, size_t n);

/* Identity of a published file's contents: published files are never
 * modified, so the same inode with the same size and mtime has the same
 * bytes (ctime is left out: a rename changes it). */
struct vn_file_id {
	uint64_t dev, ino, size;
	int64_t mtime_sec, mtime_nsec;
};

int vn_file_id_equal(const struct vn_file_id *a, const struct vn_file_id *b);

/* Most pieces a published file is written from (one writev): a manifest
 * with 17 bundled chunks takes 36 (manifest_pb.h). */
#define VN_SPOOL_IOV_MAX 40

/*
 * The spool never takes the last of its file system, which it often shares
 * with the database it replicates: a write that would leave less than
 * VN_SPOOL_FREE_PERCENT % of it free (at most VN_SPOOL_FREE_MAX bytes) is not
 * made, and the snapshot is abandoned like on any other spool error (the
 * commit stands; the next one rebuilds once there is room, which copiers make
 * as they ship and delete staged chunks).  So replication alone never fills a
 * disk to the point where SQLite's own writes fail.  5 % is what ext4 keeps
 * back for root by default, without relying on it (the writer may be root);
 * 1 GiB is room enough for SQLite to go on on a large disk.
 */
#define VN_SPOOL_FREE_PERCENT 5
#define VN_SPOOL_FREE_MAX ((uint64_t)1 << 30)

/* How a chunk file gets its name (learnt on first use, per session). */
enum vn_link_mode {
	VN_LINK_UNKNOWN = 0,
	VN_LINK_EMPTY_PATH, /* O_TMPFILE + linkat(fd, "", AT_EMPTY_PATH) */
	VN_LINK_PROC,       /* O_TMPFILE + linkat("/proc/self/fd/N") */
	VN_LINK_NONE,       /* scratch file + rename */
};

/* Open directories of one database's spool (kept across snapshots). */
struct vn_spool_session {
	int db_fd;      /* <dbdir> */
	int chunks_fd;  /* staging/chunks */
	int meta_fd;    /* staging/meta */
	int scratch_fd; /* staging/scratch */
	int walrec_fd;  /* staging/wal-position, opened when first used */
	enum vn_link_mode link_mode;
	const char *what; /* the operation that failed, for the log */
};

/* 0 if `bytes` more can be written to the spool's file system with its
 * reserve still free (or if statvfs cannot tell: the write itself will);
 * else ENOSPC, with s->what set. */
int vn_spool_check_room(struct vn_spool_session *s, uint64_t bytes);

/* Opens (creating as needed) the directories and the `source` file. */
int vn_spool_open(const struct vn_spool *spool, struct vn_spool_session *s);
void vn_spool_close(struct vn_spool_session *s);

/* Marks a session closed without closing anything (initialisation). */
void vn_spool_session_init(struct vn_spool_session *s);

/* Whether a session's directories are open and still linked (someone may
 * have deleted the spool since). */
int vn_spool_session_valid(const struct vn_spool_session *s);

/* Identity of staging/meta/<name> now: 0, or an errno value. */
int vn_spool_manifest_id(struct vn_spool_session *s,
    const struct vn_spool *spool, struct vn_file_id *id);

/* Stages a chunk unless a file of that name is already staged; *created
 * tells whether a file was written.  The file is created read-only with
 * O_TMPFILE and linked in once complete (where the file system allows it;
 * otherwise written in scratch and renamed). */
int vn_spool_stage_chunk(struct vn_spool_session *s, uint64_t major,
    uint64_t minor, const void *data, size_t n, int *created);

/* Reads staging/meta/<name>: 0 and a malloc'ed buffer, or an errno value
 * (ENOENT when there is no staged manifest). */
int vn_spool_read_manifest(struct vn_spool_session *s,
    const struct vn_spool *spool, uint8_t **buf, size_t *len,
    struct vn_file_id *id);

/* Writes the manifest (iov[0..cnt), at most VN_SPOOL_IOV_MAX pieces, one
 * writev) in scratch, then swaps it with staging/meta/<name> and unlinks the
 * old one; *id receives the identity of what was written. */
int vn_spool_publish_manifest(struct vn_spool_session *s,
    const struct vn_spool *spool, const struct iovec *iov, int cnt,
    struct vn_file_id *id);

/*
 * If `ready` is missing or empty, publishes ready/<uuid>/{chunks,meta}
 * with hard links to every staged chunk of `words` (n_chunks fingerprints)
 * and a copy of the manifest (manifest[0..cnt), as for
 * vn_spool_publish_manifest); *published tells whether it did.  After a
 * publication every file in staging/chunks is deleted (they now live in
 * ready, or are useless).
 */
int vn_spool_publish_ready(struct vn_spool_session *s,
    const struct vn_spool *spool, const struct iovec *manifest, int cnt,
    const uint64_t *words, size_t n_chunks, int *published);

/*
 * staging/wal-position: a WAL database's record of what its staged manifest
 * stands for (walrec.h), private to writers (copiers never read it).  It is
 * one small fixed-size record, rewritten in place with one pwrite (a torn
 * one fails its hash), by writers holding vn_spool_lock_wal() (and SQLite's
 * WAL write lock, a WAL read mark or an exclusive lock on the database), so
 * never two at once.  Read: 0 and the
 * bytes (*len 0: none yet), or an errno value.
 */
int vn_spool_read_walrec(struct vn_spool_session *s, uint8_t *buf, size_t cap,
    size_t *len);

/*
 * Serialises a WAL database's snapshots between its writers (connections
 * and processes): an exclusive flock(2) on staging/wal-position through this
 * session's own descriptor, held for one snapshot.  A writer's stager thread
 * (stager.h) takes it before pinning the state it snapshots, and the commit
 * path under the WAL write lock takes it too, so snapshots are published in
 * commit order.  0 or an errno value.
 */
int vn_spool_lock_wal(struct vn_spool_session *s);
void vn_spool_unlock_wal(struct vn_spool_session *s);
int vn_spool_write_walrec(struct vn_spool_session *s, const uint8_t *buf,
    size_t len);

/*
 * Deletes staged chunks that `words` (n_chunks fingerprints) does not name,
 * and scratch entries older than VN_SCRATCH_STALE_SECONDS; *removed counts
 * the deleted chunk files.
 */
int vn_spool_gc(struct vn_spool_session *s, const uint64_t *words,
    size_t n_chunks, size_t *removed);

/* Computes "<spool_root>/<boot root>/<dbdir>" for `db_path` (made canonical
 * here) into out; for tools and tests. */
int vn_spool_db_dir(const struct vn_keys *keys, const char *spool_root,
    const char *db_path, char *out, size_t cap);

#endif /* VN_SPOOL_H */
