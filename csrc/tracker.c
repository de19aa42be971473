/*
 * Change tracking and snapshot building: see tracker.h.
 *
 * Cost of an incremental update: chunk 0 and the dirty chunks (read,
 * fingerprint, stage), as many randomly chosen clean chunks (re-hashed to
 * catch changes we did not see), and writing the manifest (16 bytes per
 * chunk + chunk 0, one writev).  The staged manifest stays decoded in memory
 * while it is the staged one, so it is not read back; the version id is the
 * UUID we wrote, so the xattr is not read back either.
 */
#define _GNU_SOURCE
#include "tracker.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

static_assert(VN_CHUNK_SIZE == 65536, "docs/FORMAT.md fixes chunks at 64 KiB");
static_assert(VN_CHUNK_SIZE >= 65536, "a chunk holds SQLite's largest page");
static_assert(VN_HEADER_BYTES <= 512, "the header lies in SQLite's smallest page");
static_assert(VN_UUID_BYTES + 16 <= VN_MAX_VERSION_ID,
    "version ids (UUID + header fingerprint) fit in a manifest's version_id");
static_assert(sizeof(sqlite3_int64) == 8, "file offsets are 64-bit");
static_assert(sizeof(size_t) >= 8, "chunk word counts of any file fit");
static_assert(VN_MANIFEST_IOV <= VN_SPOOL_IOV_MAX,
    "a manifest's pieces fit in one published file's writev");
static_assert((VN_MAX_DB_SIZE / VN_CHUNK_SIZE) * 16 +
    (VN_MANIFEST_MAX_EXTRA + 1) * (VN_CHUNK_SIZE + 16) + 4096 <=
    VN_MAX_MANIFEST_BYTES, "a database of VN_MAX_DB_SIZE has a manifest "
    "under the cap, whatever it bundles");
static_assert(VN_TOPS_MAX_CHUNKS <= VN_MANIFEST_MAX_EXTRA,
    "every chunk btree_tops may choose can be encoded");

/* The first 8 bytes of a hot rollback journal (docs/FORMAT.md; SQLite's
 * aJournalMagic). */
static const uint8_t journal_magic[8] = {
	0xd9, 0xd5, 0x05, 0xf9, 0x20, 0xa1, 0x63, 0xd7
};

/* ---- small helpers ------------------------------------------------------ */

static uint64_t next_random(struct vn_tracker *t)
{
	/* splitmix64: fine for choosing chunks and GC coin flips. */
	uint64_t z = (t->rng += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static int test_bit(const struct vn_tracker *t, uint64_t i)
{
	return i / 64 < t->dirty_words && (t->dirty[i / 64] >> (i % 64)) & 1;
}

static void mark_range(struct vn_tracker *t, uint64_t first, uint64_t last)
{
	size_t need = (size_t)(last / 64) + 1;

	if (need > t->dirty_words) {
		size_t want = t->dirty_words ? 2 * t->dirty_words : 16;
		uint64_t *grown;

		while (want < need)
			want *= 2;
		grown = realloc(t->dirty, want * sizeof(uint64_t));
		if (grown == NULL) {
			t->force_full = 1; /* we lost track: rebuild */
			return;
		}
		memset(grown + t->dirty_words, 0,
		    (want - t->dirty_words) * sizeof(uint64_t));
		t->dirty = grown;
		t->dirty_words = want;
	}
	for (uint64_t i = first; i <= last; i++)
		t->dirty[i / 64] |= (uint64_t)1 << (i % 64);
}

/* Reads up to 2*VN_MAX_VERSION_ID bytes of the xattr: its length, 0 if
 * absent, -1 if unusable. */
static ssize_t read_version_xattr(struct vn_tracker *t, uint8_t *out,
    size_t cap)
{
	ssize_t n;

	if (t->no_xattr)
		return 0;
	n = getxattr(t->path, VN_VERSION_XATTR, out, cap);
	if (n >= 0)
		return n;
	if (errno == ENODATA)
		return 0;
	if (errno == ENOTSUP)
		t->no_xattr = 1;
	return -1;
}

static int read_header(sqlite3_file *db, sqlite3_int64 size, uint8_t *hdr,
    size_t *n)
{
	*n = size < VN_HEADER_BYTES ? (size_t)size : VN_HEADER_BYTES;
	return db->pMethods->xRead(db, hdr, (int)*n, 0);
}

/* version id = xattr bytes, then header_fprint major and minor (LE). */
static size_t make_version_id(uint8_t *out, const uint8_t *xattr,
    size_t xattr_len, const struct vn_umash_fp *header)
{
	memcpy(out, xattr, xattr_len);
	memcpy(out + xattr_len, &header->hash[0], 8);
	memcpy(out + xattr_len + 8, &header->hash[1], 8);
	return xattr_len + 16;
}

/* ---- lifecycle ---------------------------------------------------------- */

int vn_tracker_init(struct vn_tracker *t, const struct vn_keys *keys,
    const char *canon_path, const char *db_name, const char *spool_root)
{
	int rc;

	memset(t, 0, sizeof(*t));
	vn_spool_session_init(&t->session);
	t->path = canon_path;
	t->keys = keys;
	vn_random_bytes(&t->rng, sizeof(t->rng));
	t->wal_ok = vn_wal_init(&t->wal, db_name) == 0;
	rc = vn_spool_init(&t->spool, keys, spool_root, canon_path);
	t->spool_ok = rc == 0;
	return rc;
}

void vn_tracker_fini(struct vn_tracker *t)
{
	if (t->spool_ok)
		vn_spool_fini(&t->spool);
	if (t->wal_ok)
		vn_wal_fini(&t->wal);
	vn_spool_close(&t->session);
	free(t->staged.chunks);
	free(t->dirty);
	free(t->buf);
	free(t->chunk0);
	for (size_t i = 0; i < VN_TOPS_MAX_CHUNKS; i++)
		free(t->tops_buf[i]);
	memset(t, 0, sizeof(*t));
}

static void clear_dirty(struct vn_tracker *t)
{
	if (t->dirty != NULL)
		memset(t->dirty, 0, t->dirty_words * sizeof(uint64_t));
}

void vn_tracker_reset(struct vn_tracker *t)
{
	clear_dirty(t);
	t->force_full = 0;
	t->version_written = 0;
	t->uuid_written = 0;
	t->base_valid = 0;
}

void vn_tracker_write_locked(struct vn_tracker *t, sqlite3_file *db)
{
	uint8_t xattr[VN_MAX_VERSION_ID - 16];
	uint8_t hdr[VN_HEADER_BYTES];
	sqlite3_int64 size;
	struct vn_umash_fp fp;
	ssize_t n;
	size_t hn;
	int rc;

	t->base_valid = 0;
	t->version_written = 0;
	t->uuid_written = 0;
	n = read_version_xattr(t, xattr, sizeof(xattr));
	if (n <= 0)
		return; /* no version: the next snapshot is a full rebuild */
	/* Read the whole header; only a file shorter than that (a short read)
	 * needs its size. */
	rc = db->pMethods->xRead(db, hdr, VN_HEADER_BYTES, 0);
	hn = VN_HEADER_BYTES;
	if (rc == SQLITE_IOERR_SHORT_READ &&
	    (db->pMethods->xFileSize(db, &size) != SQLITE_OK || size <= 0 ||
	    read_header(db, size, hdr, &hn) != SQLITE_OK))
		return;
	if (rc != SQLITE_OK && rc != SQLITE_IOERR_SHORT_READ)
		return;
	fp = vn_umash_fprint(&t->keys->header, 0, hdr, hn);
	t->base_version_len = make_version_id(t->base_version, xattr,
	    (size_t)n, &fp);
	t->base_valid = 1;
}

static void write_new_version(struct vn_tracker *t)
{
	uint8_t uuid[VN_UUID_BYTES];

	t->version_written = 1;
	if (t->no_xattr)
		return;
	vn_random_bytes(uuid, sizeof(uuid));
	uuid[6] = (uint8_t)((uuid[6] & 0x0f) | 0x40); /* version 4 */
	uuid[8] = (uint8_t)((uuid[8] & 0x3f) | 0x80); /* RFC 4122 variant */
	if (setxattr(t->path, VN_VERSION_XATTR, uuid, sizeof(uuid), 0) == 0) {
		memcpy(t->uuid, uuid, sizeof(uuid));
		t->uuid_written = 1;
	} else {
		if (errno == ENOTSUP) {
			t->no_xattr = 1;
			vn_log(SQLITE_NOTICE, "verneuil: %s: no user xattrs on "
			    "this file system; every snapshot is a full rebuild",
			    t->path);
		} else {
			vn_log(SQLITE_WARNING, "verneuil: %s: cannot set %s: %s",
			    t->path, VN_VERSION_XATTR, strerror(errno));
			/* The old version id may still match: do not trust it. */
			removexattr(t->path, VN_VERSION_XATTR);
			t->force_full = 1;
		}
	}
}

void vn_tracker_before_write(struct vn_tracker *t, uint64_t offset,
    uint64_t amount)
{
	if (!t->version_written)
		write_new_version(t);
	if (amount > 0)
		mark_range(t, offset / VN_CHUNK_SIZE,
		    (offset + amount - 1) / VN_CHUNK_SIZE);
}

void vn_tracker_before_truncate(struct vn_tracker *t, uint64_t size)
{
	if (!t->version_written)
		write_new_version(t);
	/* Chunks past the new end vanish; a partial last chunk changed. */
	if (size % VN_CHUNK_SIZE != 0)
		mark_range(t, size / VN_CHUNK_SIZE, size / VN_CHUNK_SIZE);
}

void vn_tracker_clear_version(struct vn_tracker *t)
{
	if (!t->no_xattr && removexattr(t->path, VN_VERSION_XATTR) != 0 &&
	    errno != ENODATA && errno != ENOTSUP)
		t->force_full = 1;
}

int vn_journal_is_hot(const char *db_path)
{
	size_t n = strlen(db_path);
	char *journal = malloc(n + sizeof("-journal"));
	uint8_t head[sizeof(journal_magic)];
	ssize_t got = 0;
	int fd;

	if (journal == NULL)
		return 1; /* when in doubt, do not snapshot */
	memcpy(journal, db_path, n);
	memcpy(journal + n, "-journal", sizeof("-journal"));
	fd = open(journal, O_RDONLY | O_CLOEXEC);
	free(journal);
	if (fd < 0)
		return errno != ENOENT;
	got = pread(fd, head, sizeof(head), 0);
	close(fd);
	return got == (ssize_t)sizeof(head) &&
	    memcmp(head, journal_magic, sizeof(head)) == 0;
}

/* ---- snapshots ---------------------------------------------------------- */

/*
 * A snapshot of a database in WAL mode is a rollback-journal database:
 * bytes 18 and 19 of its header (file format write and read versions) are
 * 1, not 2.  SQLite opens a file whose header says WAL only with its -wal
 * and -shm beside it, or where it can create them: a replica on a read-only
 * mount, or a restored file, would not open with `sqlite3 -readonly`.  Only
 * these two bytes differ from the committed state (docs/WRITER.md, "WAL
 * databases").
 */
static void patch_wal_header(uint8_t *chunk0)
{
	if (chunk0[VN_HEADER_WAL_WRITE] == 2)
		chunk0[VN_HEADER_WAL_WRITE] = 1;
	if (chunk0[VN_HEADER_WAL_READ] == 2)
		chunk0[VN_HEADER_WAL_READ] = 1;
}

/*
 * One snapshot as it goes through the steps of vn_tracker_snapshot(): what
 * the file is now, what the judge decided, what staging produced, what is
 * published, and what failed.
 */
struct build {
	struct vn_tracker *t;
	sqlite3_file *db;
	struct vn_spool_session *s; /* t->session */

	/* What is read: the file alone, or (wal != NULL) the committed state
	 * of a WAL database, with its frames when `overlay` (the index is at
	 * the commit); a header that says WAL is patched (patch_header). */
	struct vn_wal *wal;
	int overlay;
	int patch_header;
	int have_size;     /* size is the committed state's, given */
	uint64_t pending_byte; /* SQLite's lock bytes (vn_snapshot_config) */

	/* The file now (read_current). */
	sqlite3_int64 size;
	uint64_t n_chunks;
	size_t len0;       /* bytes of chunk 0 in t->chunk0 */
	ssize_t xattr_len; /* bytes of version xattr in now.version_id; 0: none */
	/* The manifest being built: header_fprint and version_id from
	 * read_current, the rest from describe_snapshot. */
	struct vn_manifest now;

	/* The judge's verdict (judge_staged). */
	int use_incremental; /* update the staged manifest's chunk list */
	uint64_t old_len;  /* the staged manifest's len, if incremental */

	/* Staging (stage_chunks). */
	uint64_t *words;   /* 2 per chunk: t->staged.chunks, updated in place */
	uint64_t old_chunks; /* words[0 .. 2 * old_chunks) held the old ones */
	int changed;       /* some fingerprint differs from the old one */
	size_t created;    /* chunk files written */
	struct vn_tops tops; /* bundled besides chunk 0 */

	/* Publication (describe_snapshot, publish_manifest, publish_ready). */
	int unchanged;     /* the staged manifest is current: not rewritten */
	struct vn_file_id id; /* identity of staging/meta/<name> */
	struct vn_manifest_parts parts; /* its encoding, copied to ready too */

	/* What failed (abandon). */
	const char *what;  /* failed operation, for the log */
	int err;           /* errno value, or 0 for SQLite errors */
	int sqlite_rc;
};

/* Records a failed operation and its errno value; returns -1. */
static int fail_with(struct build *b, const char *what, int err)
{
	b->what = what;
	b->err = err;
	return -1;
}

/* The same for a spool operation, which named itself in the session. */
static int spool_failed(struct build *b, int err)
{
	return fail_with(b, b->s->what, err);
}

/* Bytes [off, off + len) of what is snapshotted: the file, or the
 * committed state of a WAL database (past the file's end, zeros, as SQLite
 * reads them). */
static int read_bytes(struct build *b, uint8_t *buf, size_t len, uint64_t off)
{
	int rc, err;

	if (b->wal != NULL && b->overlay) {
		if (vn_wal_read(b->wal, b->db, buf, len, off, &rc, &err) == 0)
			return 0;
		if (err != 0)
			return fail_with(b, b->wal->what, err);
	} else {
		rc = b->db->pMethods->xRead(b->db, buf, (int)len,
		    (sqlite3_int64)off);
		if (rc == SQLITE_OK ||
		    (b->wal != NULL && rc == SQLITE_IOERR_SHORT_READ))
			return 0;
	}
	b->what = "read the database";
	b->sqlite_rc = rc;
	return -1;
}

static int read_chunk(struct build *b, uint64_t i, uint8_t *buf, size_t *len)
{
	sqlite3_int64 off = (sqlite3_int64)i * VN_CHUNK_SIZE;
	sqlite3_int64 left = b->size - off;

	*len = left < VN_CHUNK_SIZE ? (size_t)left : VN_CHUNK_SIZE;
	return read_bytes(b, buf, *len, (uint64_t)off);
}

/* Fingerprints chunk i's bytes, records the fingerprint in the chunk list
 * and (unless chunk 0 or all zero) stages the chunk. */
static int record_chunk(struct build *b, uint64_t i, const uint8_t *data,
    size_t len)
{
	struct vn_tracker *t = b->t;
	struct vn_umash_fp fp;
	int created, rc;

	fp = vn_umash_fprint(&t->keys->chunk, 0, data, len);
	if (i >= b->old_chunks || b->words[2 * i] != fp.hash[0] ||
	    b->words[2 * i + 1] != fp.hash[1])
		b->changed = 1;
	b->words[2 * i] = fp.hash[0];
	b->words[2 * i + 1] = fp.hash[1];
	if (i == 0)
		return 0;
	if (fp.hash[0] == t->keys->zero_chunk.hash[0] &&
	    fp.hash[1] == t->keys->zero_chunk.hash[1])
		return 0;
	rc = vn_spool_stage_chunk(b->s, fp.hash[0], fp.hash[1], data, len,
	    &created);
	if (rc != 0)
		return spool_failed(b, rc);
	b->created += (size_t)created;
	t->stats.staged += (uint64_t)created;
	return 0;
}

/* record_chunk() for chunk i: chunk 0 was read into t->chunk0 already, the
 * others are read here. */
static int process_chunk(struct build *b, uint64_t i)
{
	struct vn_tracker *t = b->t;
	size_t len;

	if (i == 0)
		return record_chunk(b, 0, t->chunk0, b->len0);
	if (read_chunk(b, i, t->buf, &len) != 0)
		return -1;
	return record_chunk(b, i, t->buf, len);
}

static int read_for_tops(void *ctx, uint8_t *buf, size_t len, uint64_t off)
{
	return read_bytes(ctx, buf, len, off);
}

/*
 * Chooses the chunks to bundle besides chunk 0 (btree_tops.h) into
 * b->tops: 0, or -1 on error.  Their bytes are read now, so each is
 * fingerprinted again; a chunk whose bytes differ from the list's
 * fingerprint changed behind our back (as the random re-hash in
 * incremental() looks for): returns 1, and the caller rebuilds from a full
 * scan, so that a manifest never bundles bytes its list does not name.
 */
static int choose_bundled(struct build *b, size_t budget)
{
	struct vn_tracker *t = b->t;
	struct vn_tops *tops = &b->tops;

	tops->n = 0;
	if (budget == 0)
		return 0;
	if (vn_btree_tops(t->chunk0, b->len0, (uint64_t)b->size, budget,
	    read_for_tops, b, t->tops_buf, t->buf, tops) != 0)
		return 0; /* a read failed: bundle nothing more this time */
	for (size_t k = 0; k < tops->n; k++) {
		uint64_t i = tops->index[k];
		struct vn_umash_fp fp = vn_umash_fprint(&t->keys->chunk, 0,
		    tops->data[k], tops->len[k]);

		if (fp.hash[0] != b->words[2 * i] ||
		    fp.hash[1] != b->words[2 * i + 1]) {
			vn_log(SQLITE_NOTICE, "verneuil: %s: bundled chunk %llu "
			    "changed behind our back; rebuilding the snapshot",
			    t->path, (unsigned long long)i);
			t->stats.verify_mismatch++;
			tops->n = 0;
			return 1;
		}
	}
	return 0;
}

static int full_scan(struct build *b)
{
	b->created = 0;
	b->old_chunks = 0;
	b->changed = 1;
	for (uint64_t i = 0; i < b->n_chunks; i++)
		if (process_chunk(b, i) != 0)
			return -1;
	return 0;
}

/* Whether clean chunk j still has the fingerprint in b->words. */
static int clean_chunk_matches(struct build *b, uint64_t j, int *matches)
{
	struct vn_tracker *t = b->t;
	size_t len;

	if (read_chunk(b, j, t->buf, &len) != 0)
		return -1;
	if (t->keys->primary_is_full) {
		/* 64 bits are plenty to notice a change, at half the cost. */
		*matches = vn_umash_full(&t->keys->chunk, 0, 0, t->buf, len) ==
		    b->words[2 * j];
	} else {
		struct vn_umash_fp fp =
		    vn_umash_fprint(&t->keys->chunk, 0, t->buf, len);

		*matches = fp.hash[0] == b->words[2 * j] &&
		    fp.hash[1] == b->words[2 * j + 1];
	}
	return 0;
}

/*
 * Updates b->words, which hold the staged manifest's fingerprints (old_len
 * bytes of database), from the dirty chunks.  Returns 0 on success, 1 if a
 * clean chunk turned out to have changed (the caller falls back to a full
 * scan), -1 on error.
 */
static int incremental(struct build *b, uint64_t old_len)
{
	struct vn_tracker *t = b->t;
	uint64_t common = old_len < (uint64_t)b->size ? old_len : (uint64_t)b->size;
	/* Chunks below `stable` have the same length before and after, so
	 * only writes can have changed them, and those are in the bitmap: the
	 * full chunks below the shorter length, and all of them if the length
	 * is the same (the last chunk, full or not, keeps its length). */
	uint64_t stable = old_len == (uint64_t)b->size ? b->n_chunks :
	    common / VN_CHUNK_SIZE;
	uint64_t n_dirty = 0;

	b->created = 0;
	b->changed = 0;
	b->old_chunks = (old_len + VN_CHUNK_SIZE - 1) / VN_CHUNK_SIZE;
	/* Chunk 0 always: its bytes are bundled in the manifest. */
	if (process_chunk(b, 0) != 0)
		return -1;
	if (test_bit(t, 0))
		n_dirty++;
	for (size_t w = 0; w < t->dirty_words && w * 64 < stable; w++) {
		uint64_t bits = t->dirty[w];

		while (bits != 0) {
			uint64_t i = w * 64 + (uint64_t)__builtin_ctzll(bits);

			bits &= bits - 1;
			if (i == 0 || i >= stable)
				continue;
			if (process_chunk(b, i) != 0)
				return -1;
			n_dirty++;
		}
	}
	for (uint64_t i = stable > 0 ? stable : 1; i < b->n_chunks; i++) {
		if (process_chunk(b, i) != 0)
			return -1;
		n_dirty++;
	}
	/* docs/FORMAT.md: for every dirty chunk, re-hash one random clean chunk.
	 * Clean chunks below `stable` still hold their old words. */
	for (uint64_t k = 0; k < n_dirty && stable > 1; k++) {
		uint64_t j = 1 + next_random(t) % (stable - 1);
		int matches;

		if (test_bit(t, j))
			continue;
		if (clean_chunk_matches(b, j, &matches) != 0)
			return -1;
		if (!matches) {
			vn_log(SQLITE_NOTICE, "verneuil: %s: chunk %llu changed "
			    "behind our back; rebuilding the snapshot", t->path,
			    (unsigned long long)j);
			t->stats.verify_mismatch++;
			return 1;
		}
	}
	return 0;
}

static int ensure_buffers(struct vn_tracker *t)
{
	if (t->buf == NULL)
		t->buf = malloc(VN_CHUNK_SIZE);
	if (t->chunk0 == NULL)
		t->chunk0 = malloc(VN_CHUNK_SIZE);
	return t->buf != NULL && t->chunk0 != NULL ? 0 : -1;
}

/* Room for n_chunks chunks' words in t->staged.chunks, keeping its
 * contents. */
static int reserve_words(struct vn_tracker *t, uint64_t n_chunks)
{
	size_t need = 2 * (size_t)n_chunks;
	size_t want = t->staged_cap ? t->staged_cap : 64;
	uint64_t *grown;

	if (need <= t->staged_cap)
		return 0;
	while (want < need)
		want *= 2;
	grown = realloc(t->staged.chunks, want * sizeof(uint64_t));
	if (grown == NULL)
		return -1;
	t->staged.chunks = grown;
	t->staged_cap = want;
	return 0;
}

/* Reads and decodes staging/meta/<name> into t->staged: 0, or -1 if there
 * is none or it is unreadable (then t->staged_valid is 0). */
static int load_staged(struct vn_tracker *t)
{
	struct vn_manifest m;
	struct vn_file_id id;
	uint8_t *buf = NULL;
	size_t len = 0;
	int rc;

	t->staged_valid = 0;
	if (vn_spool_read_manifest(&t->session, &t->spool, &buf, &len, &id) != 0)
		return -1;
	rc = vn_manifest_decode(buf, len, &m);
	free(buf);
	if (rc != 0)
		return -1;
	m.bundled0 = NULL; /* pointed into buf */
	m.bundled0_len = 0;
	m.has_bundled0 = 0;
	m.n_extra = 0;
	free(t->staged.chunks);
	t->staged = m;
	t->staged_cap = m.n_words;
	t->staged_id = id;
	t->staged_valid = 1;
	return 0;
}

/* GC: after a snapshot that staged chunks, with probability gc_weight *
 * (chunks staged) / (chunks in the file), deletes the staged chunks the new
 * chunk list does not name (vn_spool_gc). */
static void maybe_gc(struct build *b, double gc_weight)
{
	struct vn_tracker *t = b->t;
	double p;
	size_t removed = 0;
	int rc;

	if (b->created == 0 || gc_weight <= 0)
		return;
	p = gc_weight * (double)b->created / (double)b->n_chunks;
	if (p < 1.0 && (double)(next_random(t) >> 11) * 0x1.0p-53 >= p)
		return;
	rc = vn_spool_gc(b->s, b->words, b->n_chunks, &removed);
	if (rc != 0) {
		vn_log(SQLITE_WARNING, "verneuil: %s: GC failed: %s: %s",
		    t->path, b->s->what, strerror(rc));
		return;
	}
	t->stats.gc++;
	t->stats.gc_removed += removed;
}

/* Whether a message said at `*at` (CLOCK_MONOTONIC seconds, 0: never)
 * is less than `period` seconds old; if not, `*at` becomes now. */
static int said_recently(int64_t *at, int64_t period)
{
	struct timespec now;

	if (clock_gettime(CLOCK_MONOTONIC, &now) != 0)
		return 0;
	if (*at != 0 && now.tv_sec - *at < period)
		return 1;
	/* CLOCK_MONOTONIC may start near 0: keep 0 for "never". */
	*at = now.tv_sec > 0 ? now.tv_sec : 1;
	return 0;
}

/* Whether to leave out the log line of a failure for want of space: the
 * first one is logged, then one per VN_LOW_SPACE_LOG_SECONDS. */
static int low_space_quiet(struct vn_tracker *t)
{
	return said_recently(&t->low_space_logged_at, VN_LOW_SPACE_LOG_SECONDS);
}

/* ---- the steps of a snapshot --------------------------------------------- */

/*
 * The version id of the file now (docs/FORMAT.md): the version xattr, then
 * the header fingerprint, into b->now; the xattr's length in b->xattr_len
 * (0: the file has no version, so the staged manifest cannot be updated
 * incrementally).
 */
static void read_version_id(struct build *b)
{
	struct vn_tracker *t = b->t;
	uint8_t xattr[VN_MAX_VERSION_ID - 16];
	ssize_t xn = 0;

	if (!t->uuid_written && !t->no_xattr) {
		xn = read_version_xattr(t, xattr, sizeof(xattr));
		if (xn == 0 && !t->no_xattr) {
			/* No version yet (a file never written through us): tag
			 * the current contents so that the next transaction can
			 * update this snapshot incrementally.  Safe under SHARED:
			 * the contents cannot change, and a crash before the
			 * manifest is published only leaves a version that no
			 * manifest has. */
			write_new_version(t);
		}
	}
	if (t->uuid_written) {
		/* The UUID we wrote in this write period: under our SHARED
		 * lock nobody else changes the xattr (writers change it before
		 * their first write, which needs an EXCLUSIVE lock). */
		static_assert(sizeof(t->uuid) <= sizeof(xattr), "a UUID fits");
		memcpy(xattr, t->uuid, sizeof(t->uuid));
		xn = (ssize_t)sizeof(t->uuid);
	} else if (xn < 0) {
		xn = 0;
	}
	b->xattr_len = xn;
	b->now.version_id_len = make_version_id(b->now.version_id, xattr,
	    (size_t)xn, &b->now.header_fprint);
}

/*
 * The file as it is now: its size, chunk 0 (needed in every case, since it
 * is bundled in the manifest, and holding the header: read once), the
 * header's fingerprint and the version id.  VN_SNAPSHOT_DONE to go on;
 * VN_SNAPSHOT_EMPTY or VN_SNAPSHOT_WAL when there is nothing to snapshot;
 * VN_SNAPSHOT_FAILED with b->what set.
 */
static enum vn_snapshot_result read_current(struct build *b,
    uint64_t max_db_size)
{
	struct vn_tracker *t = b->t;
	size_t hn;

	if (!t->spool_ok) {
		fail_with(b, "locate the spool directory", ENOENT);
		return VN_SNAPSHOT_FAILED;
	}
	if (!b->have_size &&
	    b->db->pMethods->xFileSize(b->db, &b->size) != SQLITE_OK) {
		b->what = "get the file size";
		return VN_SNAPSHOT_FAILED;
	}
	if (b->size == 0)
		return VN_SNAPSHOT_EMPTY;
	if ((uint64_t)b->size > max_db_size)
		return VN_SNAPSHOT_TOO_LARGE;
	if (ensure_buffers(t) != 0) {
		fail_with(b, "allocate buffers", ENOMEM);
		return VN_SNAPSHOT_FAILED;
	}
	if (read_chunk(b, 0, t->chunk0, &b->len0) != 0)
		return VN_SNAPSHOT_FAILED;
	hn = b->len0 < VN_HEADER_BYTES ? b->len0 : VN_HEADER_BYTES;
	if (hn > VN_HEADER_WAL_READ &&
	    (t->chunk0[VN_HEADER_WAL_WRITE] == 2 ||
	    t->chunk0[VN_HEADER_WAL_READ] == 2)) {
		if (!b->patch_header)
			return VN_SNAPSHOT_WAL;
		patch_wal_header(t->chunk0);
	}
	b->n_chunks = ((uint64_t)b->size + VN_CHUNK_SIZE - 1) / VN_CHUNK_SIZE;
	b->now.header_fprint = vn_umash_fprint(&t->keys->header, 0, t->chunk0,
	    hn);
	b->now.has_header_fprint = 1;
	if (b->wal == NULL)
		read_version_id(b);
	return VN_SNAPSHOT_DONE;
}

/* Room for a chunk in the spool: 0, or -1 with b->what set. */
static int check_room(struct build *b)
{
	int rc = vn_spool_check_room(b->s, VN_CHUNK_SIZE);

	return rc == 0 ? 0 : spool_failed(b, rc);
}

/*
 * The spool's directories, reopened (and recreated) when someone removed
 * them, and room for a chunk: a spool already short of space gives up
 * before reading anything (a full rebuild would read the whole file only
 * to stop at its first new chunk).  0, or -1 with b->what set.
 */
static int open_session(struct build *b)
{
	struct vn_tracker *t = b->t;
	int rc;

	if (!vn_spool_session_valid(b->s)) {
		vn_spool_close(b->s);
		t->staged_valid = 0;
		rc = vn_spool_open(&t->spool, b->s);
		if (rc != 0)
			return spool_failed(b, rc);
	}
	return check_room(b);
}

/* Whether the decoded staged manifest can be updated in place: ours (one
 * fingerprint per chunk, no base chunk) and not empty. */
static int staged_is_ours(const struct vn_tracker *t)
{
	return !t->staged.has_base_chunks_fprint && t->staged.len > 0 &&
	    t->staged.n_words == 2 * ((t->staged.len + VN_CHUNK_SIZE - 1) /
	    VN_CHUNK_SIZE);
}

/*
 * Judge: whether the staged manifest's chunk list plus this write period's
 * dirty chunks describe the file (b->use_incremental, from b->old_len bytes).
 * That needs a version id at write lock (base_version) equal to the staged
 * manifest's, and a staged manifest of ours (one fingerprint per chunk, no
 * base chunks).  The decoded copy in t->staged serves if staging/meta/<name>
 * is still the file we decoded or wrote (published files never change in
 * place); otherwise the file is read.
 */
static void judge_staged(struct build *b)
{
	struct vn_tracker *t = b->t;
	struct vn_file_id id;

	b->use_incremental = 0;
	if (!t->force_full && t->base_valid && b->xattr_len > 0) {
		if (!t->staged_valid ||
		    vn_spool_manifest_id(b->s, &t->spool, &id) != 0 ||
		    !vn_file_id_equal(&id, &t->staged_id))
			load_staged(t);
		b->use_incremental = t->staged_valid && staged_is_ours(t) &&
		    t->staged.version_id_len == t->base_version_len &&
		    memcmp(t->staged.version_id, t->base_version,
		    t->staged.version_id_len) == 0;
	}
	b->old_len = b->use_incremental ? t->staged.len : 0;
}

/*
 * Stage: brings b->words (t->staged.chunks) to the file's fingerprints and
 * stages every chunk that may have changed, from the dirty chunks when the
 * judge allows it, else from a full scan; then chooses the chunks to bundle
 * besides chunk 0.  A chunk found to have changed behind our back (by the
 * random re-hash, or when bundled) means a full scan.  0, or -1 with
 * b->what set.
 */
static int stage_chunks(struct build *b, size_t bundle_chunks)
{
	struct vn_tracker *t = b->t;
	int rc;

	/* From here the words are rewritten in place: until the new manifest
	 * is published (or found unchanged), they describe no staged file. */
	t->staged_valid = 0;
	if (reserve_words(t, b->n_chunks) != 0)
		return fail_with(b, "allocate the chunk list", ENOMEM);
	b->words = t->staged.chunks;
	if (b->use_incremental) {
		rc = incremental(b, b->old_len);
		if (rc < 0)
			return -1;
		if (rc > 0)
			b->use_incremental = 0;
	}
	if (!b->use_incremental && full_scan(b) != 0)
		return -1;
	rc = choose_bundled(b, bundle_chunks);
	if (rc > 0) {
		b->use_incremental = 0;
		if (full_scan(b) != 0)
			return -1;
		/* Under our SHARED lock the file cannot change again: a second
		 * mismatch cannot happen, and would only drop the bundles. */
		rc = choose_bundled(b, bundle_chunks);
		if (rc > 0)
			b->tops.n = 0;
	}
	return rc < 0 ? -1 : 0;
}

/*
 * The version id of a WAL snapshot: 16 random bytes, then the header
 * fingerprint (the layout of docs/FORMAT.md).  No extended attribute: WAL
 * commits do not write the database file, and what changed is read from the
 * WAL since the position the record of the staged snapshot names (walrec.h),
 * which names the snapshot by this id.
 */
static void wal_version_id(struct build *b)
{
	uint8_t id[VN_UUID_BYTES];

	vn_random_bytes(id, sizeof(id));
	b->now.version_id_len = make_version_id(b->now.version_id, id,
	    sizeof(id), &b->now.header_fprint);
}

/*
 * The manifest's ctime: when the file last changed.  A WAL commit changes
 * the WAL, not the database file: for a committed state with frames, the
 * WAL's last modification (the commit's frames were its last write, under
 * the write lock); otherwise the file's status change.
 */
static void snapshot_time(struct build *b)
{
	struct stat st;
	int rc;

	if (b->wal != NULL && b->overlay && b->wal->fd >= 0 &&
	    fstat(b->wal->fd, &st) == 0) {
		b->now.ctime = (int64_t)st.st_mtim.tv_sec;
		b->now.ctime_ns = (int32_t)st.st_mtim.tv_nsec;
		return;
	}
	rc = stat(b->t->path, &st);
	if (rc == 0) {
		b->now.ctime = (int64_t)st.st_ctim.tv_sec;
		b->now.ctime_ns = (int32_t)st.st_ctim.tv_nsec;
	}
}

/*
 * The manifest to publish, into b->now: the staged one when nothing changed
 * since it was written (same fingerprints, length and version id:
 * b->unchanged), else a new one over b->words; either way with chunk 0 and
 * the chosen b-tree tops bundled.
 */
static void describe_snapshot(struct build *b)
{
	struct vn_tracker *t = b->t;
	struct vn_manifest *now = &b->now;

	/* A WAL snapshot's version id is fresh when the contents change. */
	b->unchanged = b->use_incremental && !b->changed &&
	    b->old_len == (uint64_t)b->size && (b->wal != NULL ||
	    (t->staged.version_id_len == now->version_id_len &&
	    memcmp(t->staged.version_id, now->version_id,
	    now->version_id_len) == 0));
	if (b->unchanged) {
		*now = t->staged;
		b->id = t->staged_id;
	} else {
		if (b->wal != NULL)
			wal_version_id(b);
		now->contents_fprint = vn_umash_fprint(&t->keys->directory, 0,
		    b->words, 16 * b->n_chunks);
		now->has_contents_fprint = 1;
		now->len = (uint64_t)b->size;
		snapshot_time(b);
		now->chunks = b->words;
		now->n_words = 2 * b->n_chunks;
	}
	now->bundled0 = t->chunk0;
	now->bundled0_len = b->len0;
	now->has_bundled0 = 1;
	now->n_extra = b->tops.n;
	for (size_t k = 0; k < b->tops.n; k++) {
		now->extra[k].index = b->tops.index[k];
		now->extra[k].data = b->tops.data[k];
		now->extra[k].len = b->tops.len[k];
	}
}

/*
 * Publish, in staging: encodes b->now into b->parts and swaps it into
 * staging/meta/<name>, unless b->unchanged (that file holds these bytes
 * already); then keeps it decoded in t->staged for the next snapshot.  0,
 * or -1 with b->what set.
 */
static int publish_manifest(struct build *b)
{
	struct vn_tracker *t = b->t;
	int rc;

	if (vn_manifest_encode_parts(&b->now, &b->parts) != 0)
		return fail_with(b, "encode the manifest", EFBIG);
	if (b->unchanged) {
		t->stats.unchanged++;
	} else {
		rc = vn_spool_publish_manifest(b->s, &t->spool, b->parts.iov,
		    b->parts.iovcnt, &b->id);
		if (rc != 0)
			return spool_failed(b, rc);
		if (b->use_incremental)
			t->stats.incremental++;
		else
			t->stats.full++;
	}
	/* The words describe the staged file again (b->parts keeps pointing
	 * at chunk 0 for the ready copy). */
	b->now.bundled0 = NULL;
	b->now.bundled0_len = 0;
	b->now.has_bundled0 = 0;
	b->now.n_extra = 0;
	t->stats.bundled = b->tops.n;
	t->staged = b->now;
	t->staged_id = b->id;
	t->staged_valid = 1;
	return 0;
}

/*
 * Publish, in `ready` if it is missing or empty (docs/SPOOL.md): 1 if it
 * was published, 0 if ready was left alone, -1 if that failed.  A failure
 * leaves the staged snapshot standing: it is logged, and ready is retried by
 * the next snapshot.
 */
static int publish_ready(struct build *b)
{
	struct vn_tracker *t = b->t;
	int published = 0;
	int rc;

	rc = vn_spool_publish_ready(b->s, &t->spool, b->parts.iov,
	    b->parts.iovcnt, b->words, b->n_chunks, &published);
	if (rc != 0) {
		if (rc != ENOSPC || !low_space_quiet(t))
			vn_log(SQLITE_WARNING,
			    "verneuil: %s: cannot publish ready: %s: %s",
			    t->path, b->s->what, strerror(rc));
		return -1;
	}
	if (published)
		t->stats.ready++;
	return published;
}

/* The log line of an abandoned snapshot: on stderr too for a spool short of
 * space and, once per VN_ABANDON_WARN_SECONDS, for other errno values. */
static void log_abandon(struct build *b)
{
	struct vn_tracker *t = b->t;

	if (b->err == ENOSPC ||
	    (b->err != 0 && !said_recently(&t->abandon_warned_at,
	    VN_ABANDON_WARN_SECONDS)))
		vn_warn("verneuil: %s: snapshot abandoned: %s: %s (the commit "
		    "stands; NOT replicated until the spool takes snapshots again)",
		    t->path, b->what, strerror(b->err));
	else if (b->err != 0)
		vn_log(SQLITE_WARNING, "verneuil: %s: snapshot abandoned: %s: %s",
		    t->path, b->what, strerror(b->err));
	else
		vn_log(b->sqlite_rc ? b->sqlite_rc : SQLITE_IOERR,
		    "verneuil: %s: snapshot abandoned: %s (SQLite error %d)",
		    t->path, b->what, b->sqlite_rc);
}

/*
 * Gives the snapshot up; the commit stands.  Counts it, logs it (a spool
 * short of space once per VN_LOW_SPACE_LOG_SECONDS), clears the version id
 * so that the next snapshot is a full rebuild, and closes the session
 * (reopened, and the spool recreated, next time).
 */
static enum vn_snapshot_result abandon(struct build *b)
{
	struct vn_tracker *t = b->t;

	t->stats.failed++;
	if (b->err == ENOSPC)
		t->stats.low_space++;
	if (b->err != ENOSPC || !low_space_quiet(t))
		log_abandon(b);
	vn_tracker_clear_version(t);
	vn_spool_close(b->s);
	t->staged_valid = 0;
	t->rec_valid = 0;
	return VN_SNAPSHOT_FAILED;
}

/* ---- WAL: the record, the commit's position, what changed --------------- */

/*
 * The staged manifest (decoded in t->staged, as judge_staged reads it) and
 * the record beside it, into t->rec: t->rec_valid when the record names
 * that manifest and the manifest can be updated in place.  The record is
 * read every time (one pread): another process may have moved it on.
 */
static void load_record(struct build *b)
{
	struct vn_tracker *t = b->t;
	uint8_t buf[VN_WALREC_BYTES + 1];
	struct vn_file_id id;
	size_t len = 0;

	t->rec_valid = 0;
	if (!t->staged_valid || vn_spool_manifest_id(b->s, &t->spool, &id) != 0 ||
	    !vn_file_id_equal(&id, &t->staged_id))
		load_staged(t);
	if (!t->staged_valid || !staged_is_ours(t))
		return;
	if (vn_spool_read_walrec(b->s, buf, sizeof(buf), &len) != 0 ||
	    vn_walrec_decode(buf, len, t->keys, &t->rec) != 0)
		return;
	t->rec_valid = t->rec.version_id_len == t->staged.version_id_len &&
	    memcmp(t->rec.version_id, t->staged.version_id,
	    t->rec.version_id_len) == 0;
}

/* Writes the record of the staged manifest (t->staged, just published or
 * found current): what it stands for is in *r but its version id.  A
 * position with no WAL header (salts all zero) names no generation: every
 * session's WAL starts there, so it is recorded as the file (which it is).
 * A failure only costs the next snapshot a full scan: it is logged. */
static void write_record(struct build *b, struct vn_walrec *r)
{
	struct vn_tracker *t = b->t;
	uint8_t buf[VN_WALREC_BYTES];
	int rc;

	if (r->kind == VN_WALREC_POS && vn_wal_salt_none(r->pos.salt)) {
		r->kind = VN_WALREC_FILE;
		if (vn_file_prove(t->path, b->db, t->keys, &r->proof) != 0 ||
		    r->proof.size != t->staged.len) {
			t->rec_valid = 0;
			return;
		}
	}

	memcpy(r->version_id, t->staged.version_id, t->staged.version_id_len);
	r->version_id_len = t->staged.version_id_len;
	vn_walrec_encode(r, t->keys, buf);
	rc = vn_spool_write_walrec(b->s, buf, sizeof(buf));
	t->rec = *r;
	t->rec_valid = rc == 0;
	if (rc != 0)
		vn_log(SQLITE_WARNING, "verneuil: %s: %s: %s (the next snapshot "
		    "is a full scan)", t->path, b->s->what, strerror(rc));
}

/* Records that the staged snapshot is the database file as it is now. */
static void record_file(struct build *b)
{
	struct vn_walrec r = { .kind = VN_WALREC_FILE };

	if (vn_file_prove(b->t->path, b->db, b->t->keys, &r.proof) == 0 &&
	    r.proof.size == b->t->staged.len)
		write_record(b, &r);
}

/* Whether the database file is still what the FILE record proved. */
static int file_unchanged(struct build *b)
{
	struct vn_file_proof now;

	return vn_file_prove(b->t->path, b->db, b->t->keys, &now) == 0 &&
	    vn_file_proof_equal(&now, &b->t->rec.proof) &&
	    now.size == b->t->staged.len;
}

/*
 * The commit's position: the wal-index header's (c->have_end), or found in
 * the WAL file as SQLite's recovery finds it (its last valid commit frame;
 * no WAL: the file alone), the index then at it.  0, or -1 with b->what
 * set.
 */
static int wal_end(struct build *b, const struct vn_wal_commit *c,
    struct vn_wal_pos *end)
{
	struct vn_wal *w = b->wal;
	uint32_t ck[2];
	int rc;

	if (c->have_end) {
		*end = c->end;
		return 0;
	}
	memset(end, 0, sizeof(*end));
	rc = vn_wal_read_header(w);
	if (rc == 0 && vn_wal_chain_at(w, w->n, ck) != 0) {
		vn_wal_forget(w);
		rc = vn_wal_read_header(w);
	}
	if (rc == ENOENT)
		return 0;
	if (rc == 0)
		rc = vn_wal_verify(w, 0, 0, end);
	return rc == 0 ? 0 : fail_with(b, w->what, rc);
}

/* Whether the staged snapshot is the state at `end` already. */
static int record_current(struct build *b, const struct vn_wal_pos *end)
{
	const struct vn_walrec *r = &b->t->rec;

	if (!b->t->rec_valid || b->t->force_full)
		return 0;
	if (r->kind == VN_WALREC_POS)
		return vn_wal_pos_equal(&r->pos, end);
	return end->mx == 0 && (end->npage == 0 ||
	    (uint64_t)end->npage * end->pgsz == r->proof.size) &&
	    file_unchanged(b);
}

/*
 * Brings the index to `end`, the frames up to `from` taken as the record
 * says (their pages read from their headers, the chain after `from` from
 * the record: they were verified when committed), those after it verified;
 * from < 0: every frame verified from the WAL's header.  0; 1 if the WAL
 * does not hold what the record says; -1 on an error (b->what set).
 */
static int index_to(struct build *b, const struct vn_wal_pos *end, int64_t from)
{
	struct vn_wal *w = b->wal;
	const struct vn_wal_pos *r = &b->t->rec.pos;
	struct vn_wal_pos got;
	uint32_t ck[2];
	int rc;

	b->overlay = 0;
	if (end->mx == 0)
		return 0; /* no frame: the file alone */
	rc = vn_wal_use_generation(w, end->salt);
	if (rc == 0 && (w->n > end->mx || (from <= 0 && w->anchor != 0) ||
	    (from > 0 && w->n > (uint32_t)from &&
	    vn_wal_chain_at(w, (uint32_t)from, ck) != 0))) {
		vn_wal_forget(w); /* start again from the header */
		rc = vn_wal_use_generation(w, end->salt);
	}
	if (rc == 0 && from > 0) {
		if (w->n < (uint32_t)from)
			rc = vn_wal_index_headers(w, (uint32_t)from);
		if (rc == 0 && vn_wal_chain_at(w, (uint32_t)from, ck) != 0)
			vn_wal_anchor(w, r->cksum); /* the index ends at `from` */
		else if (rc == 0 && (ck[0] != r->cksum[0] ||
		    ck[1] != r->cksum[1]))
			return 1;
	}
	if (rc == 0)
		rc = vn_wal_verify(w, end->mx, 1, &got);
	if (rc == 0 && (!vn_wal_pos_equal(&got, end) || got.npage != end->npage ||
	    got.pgsz != end->pgsz))
		rc = EPROTO;
	if (rc == EPROTO && from >= 0) {
		vn_wal_forget(w);
		return 1;
	}
	if (rc != 0) {
		vn_wal_forget(w);
		return fail_with(b, rc == ENOENT ? "find the committed frames' "
		    "WAL" : w->what, rc);
	}
	b->overlay = 1;
	return 0;
}

/* Marks the chunks of the pages in frames (from, end->mx] dirty. */
static void mark_frames(struct build *b, uint32_t from,
    const struct vn_wal_pos *end)
{
	const struct vn_wal *w = b->wal;

	for (uint32_t f = from + 1; f <= end->mx; f++) {
		uint64_t i = (uint64_t)(w->pgno[f - 1] - 1) * w->pgsz /
		    VN_CHUNK_SIZE;

		mark_range(b->t, i, i);
	}
	b->t->stats.wal_frames += end->mx - from;
}

/*
 * Judge, for a WAL commit: the staged snapshot plus the pages of the frames
 * after `from` make the committed state at `end` when the record says the
 * staged snapshot is
 *   - the state at a position of the same generation, up to `end`: the
 *     frames after it;
 *   - the state where this writer's write lock began, when the WAL was reset
 *     since (only the lock's holder can: it did, after a checkpoint that
 *     copied every frame into the file): every frame of the new generation;
 *   - the file, unchanged since the record: every frame of the WAL.
 * Otherwise (or if the WAL disagrees with the record) a full scan.  Brings
 * the index to `end` either way.  0, or -1 with b->what set.
 */
static int judge_wal(struct build *b, const struct vn_wal_commit *c,
    const struct vn_wal_pos *end)
{
	struct vn_tracker *t = b->t;
	const struct vn_walrec *r = &t->rec;
	int64_t from = -1;
	int rc;

	if (!t->force_full && t->rec_valid) {
		if (r->kind == VN_WALREC_POS &&
		    memcmp(r->pos.salt, end->salt, sizeof(end->salt)) == 0 &&
		    r->pos.mx <= end->mx)
			from = r->pos.mx;
		else if (r->kind == VN_WALREC_POS && c->have_start &&
		    memcmp(c->start.salt, end->salt, sizeof(end->salt)) != 0 &&
		    vn_wal_pos_equal(&r->pos, &c->start))
			from = 0;
		else if (r->kind == VN_WALREC_FILE && file_unchanged(b))
			from = 0;
	}
	rc = index_to(b, end, from);
	if (rc > 0) {
		vn_log(SQLITE_NOTICE, "verneuil: %s: the WAL does not hold what "
		    "the staged snapshot's record says; rebuilding the snapshot",
		    t->path);
		from = -1;
		rc = index_to(b, end, from);
	}
	if (rc != 0)
		return -1;
	b->use_incremental = from >= 0;
	b->old_len = from >= 0 ? t->staged.len : 0;
	clear_dirty(t);
	if (from >= 0 && b->overlay)
		mark_frames(b, (uint32_t)from, end);
	return 0;
}


/* Most freelist trunk pages file_is_whole() reads: a freelist of a million
 * pages of 4 KiB has 1,000 trunks; a longer walk proves nothing more. */
#define VN_FREELIST_MAX_TRUNKS 4096

static uint32_t get_be32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 |
	    (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* Removes from missing[0..*n) the pages on the committed state's freelist
 * (its trunks are read through b): 0, or -1 on a read error. */
static int drop_free_pages(struct build *b, const struct vn_wal_pos *end,
    uint32_t *missing, size_t *n)
{
	uint8_t *page;
	uint32_t trunk;

	if (ensure_buffers(b->t) != 0)
		return -1;
	page = b->t->buf; /* VN_CHUNK_SIZE bytes: any page fits */
	if (read_bytes(b, page, VN_HEADER_BYTES, 0) != 0)
		return -1;
	trunk = get_be32(page + 32);
	for (int hops = 0; trunk != 0 && trunk <= end->npage && *n > 0 &&
	    hops < VN_FREELIST_MAX_TRUNKS; hops++) {
		uint32_t leaves;

		if (read_bytes(b, page, end->pgsz,
		    (uint64_t)(trunk - 1) * end->pgsz) != 0)
			return -1;
		leaves = get_be32(page + 4);
		if (leaves > end->pgsz / 4 - 2)
			leaves = end->pgsz / 4 - 2;
		for (uint32_t l = 0; l < leaves; l++) {
			uint32_t leaf = get_be32(page + 8 + 4 * l);

			for (size_t k = 0; k < *n; k++) {
				if (missing[k] == leaf) {
					missing[k] = missing[--*n];
					break;
				}
			}
		}
		trunk = get_be32(page);
	}
	return 0;
}

/*
 * A file past max_db_size: no snapshot (the staged one, and the store's
 * copy, stay at the last state under the bound).  Said once per file and
 * growth past the bound, on stderr too: the database stops replicating.
 */
static enum vn_snapshot_result too_large(struct build *b, uint64_t max_db_size)
{
	struct vn_tracker *t = b->t;

	t->stats.too_large++;
	if (!t->too_large_said) {
		t->too_large_said = 1;
		vn_warn("verneuil: %s: %lld bytes, past max_db_size (%llu bytes): "
		    "NOT replicated from now on (the commit stands; the store "
		    "keeps the last copy under the bound)", t->path,
		    (long long)b->size, (unsigned long long)max_db_size);
	}
	return VN_SNAPSHOT_TOO_LARGE;
}

/* read_current, with a failure abandoned and a file too large said:
 * VN_SNAPSHOT_DONE to go on, else the result to return. */
static enum vn_snapshot_result current_state(struct build *b,
    const struct vn_snapshot_config *config)
{
	enum vn_snapshot_result res = read_current(b, config->max_db_size);

	if (res == VN_SNAPSHOT_FAILED)
		return abandon(b);
	if (res == VN_SNAPSHOT_TOO_LARGE)
		return too_large(b, config->max_db_size);
	if (res == VN_SNAPSHOT_DONE)
		b->t->too_large_said = 0;
	return res;
}

/*
 * Whether the file holds the database.  SQLite writes every page it adds
 * as a frame, so a page of the committed state past the file's end has one,
 * but for the page of its lock bytes and freelist leaves (their bytes are
 * never used, and without SQLITE_SECURE_DELETE never written): those SQLite
 * reads as zeros, and so does a snapshot.  Any other page with no frame means the
 * file is a piece of a database that a VFS layered above us spreads over
 * several files (SQLite's multiplexor does), whose state this file and the
 * WAL alone do not make.
 */
static int file_is_whole(struct build *b, const struct vn_wal_pos *end)
{
	uint32_t missing[64];
	sqlite3_int64 fsize;
	uint64_t first, lock_page;
	size_t n = 0;

	if (end->npage == 0 || end->pgsz == 0 ||
	    b->db->pMethods->xFileSize(b->db, &fsize) != SQLITE_OK)
		return 1; /* the file itself; or reads will fail anyway */
	first = ((uint64_t)fsize + end->pgsz - 1) / end->pgsz + 1;
	/* The page of SQLite's lock bytes, which it never writes. */
	lock_page = b->pending_byte / end->pgsz + 1;
	for (uint64_t p = first; p <= end->npage; p++) {
		if ((b->overlay && vn_wal_frame_of(b->wal, (uint32_t)p) != 0) ||
		    p == lock_page)
			continue;
		if (n == sizeof(missing) / sizeof(missing[0]))
			return 0; /* more than a few: not freelist leaves */
		missing[n++] = (uint32_t)p;
	}
	if (n == 0)
		return 1;
	if (!b->overlay || drop_free_pages(b, end, missing, &n) != 0)
		return 0;
	return n == 0;
}

/* The committed state's size: its pages, or the file's when the WAL does
 * not say (no commit frame since the WAL was created). */
static void wal_size(struct build *b, const struct vn_wal_pos *end)
{
	if (end->npage != 0 && end->pgsz != 0) {
		b->size = (sqlite3_int64)end->npage * end->pgsz;
		b->have_size = 1;
	}
}

enum vn_snapshot_result vn_tracker_snapshot_wal(struct vn_tracker *t,
    sqlite3_file *db, const struct vn_wal_commit *c,
    const struct vn_snapshot_config *config, struct vn_wal_pos *done)
{
	struct build b = { .t = t, .db = db, .s = &t->session, .wal = &t->wal,
	    .patch_header = 1, .pending_byte = config->pending_byte };
	struct vn_walrec r = { .kind = VN_WALREC_POS };
	enum vn_snapshot_result res;

	if (!t->wal_ok) {
		fail_with(&b, "allocate the WAL's index", ENOMEM);
		return abandon(&b);
	}
	if (!t->spool_ok) {
		fail_with(&b, "locate the spool directory", ENOENT);
		return abandon(&b);
	}
	if (open_session(&b) != 0 || wal_end(&b, c, &r.pos) != 0)
		return abandon(&b);
	load_record(&b);
	if (record_current(&b, &r.pos)) {
		if (done != NULL)
			*done = r.pos;
		return VN_SNAPSHOT_DONE;
	}
	if (check_room(&b) != 0 || judge_wal(&b, c, &r.pos) != 0)
		return abandon(&b);
	if (!file_is_whole(&b, &r.pos))
		return VN_SNAPSHOT_SPLIT;
	wal_size(&b, &r.pos);
	res = current_state(&b, config);
	if (res != VN_SNAPSHOT_DONE)
		return res;
	if (stage_chunks(&b, config->bundle_chunks) != 0)
		return abandon(&b);
	describe_snapshot(&b);
	if (publish_manifest(&b) != 0)
		return abandon(&b);
	write_record(&b, &r);
	t->stats.wal++;
	t->force_full = 0;
	if (publish_ready(&b) == 0)
		maybe_gc(&b, config->gc_weight);
	if (done != NULL)
		*done = r.pos;
	return VN_SNAPSHOT_DONE;
}

int vn_tracker_wal_lock(struct vn_tracker *t)
{
	int rc;

	if (!t->spool_ok)
		return -1;
	if (!vn_spool_session_valid(&t->session)) {
		vn_spool_close(&t->session);
		t->staged_valid = 0;
		if (vn_spool_open(&t->spool, &t->session) != 0)
			return -1;
	}
	rc = vn_spool_lock_wal(&t->session);
	if (rc != 0) {
		vn_log(SQLITE_NOTICE, "verneuil: %s: %s: %s", t->path,
		    t->session.what, strerror(rc));
		return -1;
	}
	return 0;
}

void vn_tracker_wal_unlock(struct vn_tracker *t)
{
	vn_spool_unlock_wal(&t->session);
}

int vn_tracker_wal_intact(struct vn_tracker *t, const struct vn_wal_pos *end)
{
	struct vn_wal *w = &t->wal;
	struct vn_wal_pos got;

	if (!t->wal_ok)
		return 0;
	if (end->mx == 0)
		return 1; /* nothing to copy, nothing copied */
	vn_wal_forget(w);
	return vn_wal_use_generation(w, end->salt) == 0 &&
	    vn_wal_verify(w, end->mx, 1, &got) == 0 &&
	    vn_wal_pos_equal(&got, end);
}

/*
 * A snapshot in the steps of Verneuil's: read the file's chunk 0 and
 * version id; judge whether the staged manifest can be updated from the
 * dirty chunks; stage the chunks that may have changed; publish the
 * manifest in staging (unless it is current already), then in `ready` if
 * that is empty, else maybe collect garbage.  Replication never fails
 * SQLite: a failed step abandons the snapshot (logged; the commit stands).
 */
enum vn_snapshot_result vn_tracker_snapshot(struct vn_tracker *t,
    sqlite3_file *db, const struct vn_snapshot_config *config, int into_wal)
{
	struct build b = { .t = t, .db = db, .s = &t->session,
	    .patch_header = into_wal };
	enum vn_snapshot_result res;

	res = current_state(&b, config);
	if (res != VN_SNAPSHOT_DONE)
		return res; /* empty, WAL, too large or failed */
	if (open_session(&b) != 0)
		return abandon(&b);
	judge_staged(&b);
	if (stage_chunks(&b, config->bundle_chunks) != 0)
		return abandon(&b);
	describe_snapshot(&b);
	if (publish_manifest(&b) != 0)
		return abandon(&b);
	if (into_wal)
		record_file(&b);
	/* GC only beside a ready left alone: publishing ready empties
	 * staging/chunks. */
	if (publish_ready(&b) == 0)
		maybe_gc(&b, config->gc_weight);
	return VN_SNAPSHOT_DONE;
}
