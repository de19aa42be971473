/*
 * What the staged snapshot of a database in WAL mode stands for, kept in
 * the spool beside it (docs/SPOOL.md: staging/wal-position) so that the next
 * commit, in this process or another, can update it from the WAL's frames
 * instead of a full scan (docs/WRITER.md, "WAL databases").
 *
 * A record names the staged manifest it describes by its version_id (fresh
 * random bytes for every WAL snapshot): a record that does not name the
 * staged manifest describes nothing, so the manifest and the record need not
 * be published together.  It says either
 *   - POS: the staged snapshot is the committed state at a WAL position
 *     (generation, last frame, checksum chain); or
 *   - FILE: the staged snapshot is the database file itself, as it was when
 *     the record was written (its identity, size, times and header): true
 *     while the file has not changed, whatever the WAL holds since.
 *
 * The record is never in the store: the manifests stay Verneuil's format.
 * It is fixed-size, written in place with one pwrite and checked by a hash,
 * so a torn or foreign file is no record at all.
 */
#ifndef VN_WALREC_H
#define VN_WALREC_H

#include <stddef.h>
#include <stdint.h>

#include <sqlite3.h>

#include "manifest_pb.h"
#include "names.h"
#include "wal.h"

/* Bytes of an encoded record. */
#define VN_WALREC_BYTES 192

enum vn_walrec_kind {
	VN_WALREC_POS = 1,
	VN_WALREC_FILE = 2,
};

/* The database file as it was: what makes it the same file with the same
 * bytes (no write since changes size, mtime or ctime; a new file changes
 * the inode; the header fingerprint catches a writer restoring times). */
struct vn_file_proof {
	uint64_t dev, ino, size;
	int64_t mtime_sec, mtime_nsec, ctime_sec, ctime_nsec;
	uint64_t header[2];
};

struct vn_walrec {
	uint8_t version_id[VN_MAX_VERSION_ID]; /* of the staged manifest */
	size_t version_id_len;
	int kind;                    /* enum vn_walrec_kind */
	struct vn_wal_pos pos;       /* VN_WALREC_POS */
	struct vn_file_proof proof;  /* VN_WALREC_FILE */
};

void vn_walrec_encode(const struct vn_walrec *r, const struct vn_keys *keys,
    uint8_t out[VN_WALREC_BYTES]);

/* 0, or -1 if buf is not a record (wrong size, magic or hash). */
int vn_walrec_decode(const uint8_t *buf, size_t len,
    const struct vn_keys *keys, struct vn_walrec *r);

/* The proof of the file at `path`, open in SQLite as `db` (its header is
 * read through it): 0, or -1 (stat or read failed). */
int vn_file_prove(const char *path, sqlite3_file *db,
    const struct vn_keys *keys, struct vn_file_proof *p);

int vn_file_proof_equal(const struct vn_file_proof *a,
    const struct vn_file_proof *b);

#endif /* VN_WALREC_H */
