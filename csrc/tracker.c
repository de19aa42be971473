/*
 * Change tracking and snapshot building: see tracker.h.
 *
 * Cost of an incremental update: the dirty chunks (read, fingerprint, stage),
 * as many randomly chosen clean chunks (re-hashed to catch changes we did
 * not see), and reading/writing the manifest (16 bytes per chunk + chunk 0).
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
#include <unistd.h>

static_assert(VN_CHUNK_SIZE == 65536, "FORMAT.md fixes chunks at 64 KiB");
static_assert(VN_CHUNK_SIZE >= 65536, "a chunk holds SQLite's largest page");
static_assert(VN_HEADER_BYTES <= 512, "the header lies in SQLite's smallest page");
static_assert(VN_UUID_BYTES + 16 <= VN_MAX_VERSION_ID,
    "version ids (UUID + header fingerprint) fit in a manifest's version_id");
static_assert(sizeof(sqlite3_int64) == 8, "file offsets are 64-bit");

/* The first 8 bytes of a hot rollback journal (FORMAT.md; SQLite's
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
    const char *canon_path, const char *spool_root)
{
	int rc;

	memset(t, 0, sizeof(*t));
	vn_spool_session_init(&t->session);
	t->path = canon_path;
	t->keys = keys;
	vn_random_bytes(&t->rng, sizeof(t->rng));
	rc = vn_spool_init(&t->spool, keys, spool_root, canon_path);
	t->spool_ok = rc == 0;
	return rc;
}

void vn_tracker_fini(struct vn_tracker *t)
{
	if (t->spool_ok)
		vn_spool_fini(&t->spool);
	vn_spool_close(&t->session);
	free(t->cached);
	free(t->dirty);
	free(t->buf);
	free(t->chunk0);
	memset(t, 0, sizeof(*t));
}

void vn_tracker_reset(struct vn_tracker *t)
{
	if (t->dirty != NULL)
		memset(t->dirty, 0, t->dirty_words * sizeof(uint64_t));
	t->force_full = 0;
	t->version_written = 0;
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

	t->base_valid = 0;
	t->version_written = 0;
	n = read_version_xattr(t, xattr, sizeof(xattr));
	if (n <= 0)
		return; /* no version: the next snapshot is a full rebuild */
	if (db->pMethods->xFileSize(db, &size) != SQLITE_OK || size <= 0 ||
	    read_header(db, size, hdr, &hn) != SQLITE_OK)
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
	if (setxattr(t->path, VN_VERSION_XATTR, uuid, sizeof(uuid), 0) != 0) {
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

struct build {
	struct vn_tracker *t;
	sqlite3_file *db;
	struct vn_spool_session *s; /* t->session */
	sqlite3_int64 size;
	uint64_t n_chunks;
	uint64_t *words;   /* 2 per chunk */
	size_t created;    /* chunk files written */
	const char *what;  /* failed operation, for the log */
	int err;           /* errno value, or 0 for SQLite errors */
	int sqlite_rc;
};

static int read_chunk(struct build *b, uint64_t i, uint8_t *buf, size_t *len)
{
	sqlite3_int64 off = (sqlite3_int64)i * VN_CHUNK_SIZE;
	sqlite3_int64 left = b->size - off;
	int rc;

	*len = left < VN_CHUNK_SIZE ? (size_t)left : VN_CHUNK_SIZE;
	rc = b->db->pMethods->xRead(b->db, buf, (int)*len, off);
	if (rc != SQLITE_OK) {
		b->what = "read the database";
		b->sqlite_rc = rc;
		return -1;
	}
	return 0;
}

/* Reads, fingerprints and (unless chunk 0 or all zero) stages chunk i. */
static int process_chunk(struct build *b, uint64_t i)
{
	struct vn_tracker *t = b->t;
	struct vn_umash_fp fp;
	size_t len;
	int created, rc;

	if (read_chunk(b, i, t->buf, &len) != 0)
		return -1;
	fp = vn_umash_fprint(&t->keys->chunk, 0, t->buf, len);
	b->words[2 * i] = fp.hash[0];
	b->words[2 * i + 1] = fp.hash[1];
	if (i == 0) {
		memcpy(t->chunk0, t->buf, len);
		return 0;
	}
	if (fp.hash[0] == t->keys->zero_chunk.hash[0] &&
	    fp.hash[1] == t->keys->zero_chunk.hash[1])
		return 0;
	rc = vn_spool_stage_chunk(b->s, fp.hash[0], fp.hash[1], t->buf, len,
	    &created);
	if (rc != 0) {
		b->what = b->s->what;
		b->err = rc;
		return -1;
	}
	b->created += (size_t)created;
	t->stats.staged += (uint64_t)created;
	return 0;
}

static int full_scan(struct build *b)
{
	b->created = 0;
	for (uint64_t i = 0; i < b->n_chunks; i++)
		if (process_chunk(b, i) != 0)
			return -1;
	return 0;
}

/*
 * Updates b->words from the staged manifest `old` and the dirty chunks.
 * Returns 0 on success, 1 if a clean chunk turned out to have changed (the
 * caller falls back to a full scan), -1 on error.
 */
static int incremental(struct build *b, const struct vn_manifest *old)
{
	struct vn_tracker *t = b->t;
	uint64_t common = old->len < (uint64_t)b->size ? old->len : (uint64_t)b->size;
	/* Chunks below `stable` have the same (full) length before and after. */
	uint64_t stable = common / VN_CHUNK_SIZE;
	uint64_t n_dirty = 0;

	if (stable > b->n_chunks)
		stable = b->n_chunks;
	memcpy(b->words, old->chunks, 16 * stable);
	if (process_chunk(b, 0) != 0)
		return -1;
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
	/* FORMAT.md: for every dirty chunk, re-hash one random clean chunk. */
	for (uint64_t k = 0; k < n_dirty && stable > 1; k++) {
		uint64_t j = 1 + next_random(t) % (stable - 1);
		struct vn_umash_fp fp;
		size_t len;

		if (test_bit(t, j))
			continue;
		if (read_chunk(b, j, t->buf, &len) != 0)
			return -1;
		fp = vn_umash_fprint(&t->keys->chunk, 0, t->buf, len);
		if (fp.hash[0] != old->chunks[2 * j] ||
		    fp.hash[1] != old->chunks[2 * j + 1]) {
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

enum vn_snapshot_result vn_tracker_snapshot(struct vn_tracker *t,
    sqlite3_file *db, const struct vn_snapshot_config *config)
{
	struct build b = { .t = t, .db = db, .s = &t->session };
	struct vn_manifest old, now;
	uint8_t hdr[VN_HEADER_BYTES];
	uint8_t xattr[VN_MAX_VERSION_ID - 16];
	uint8_t *old_buf = NULL, *encoded = NULL;
	size_t old_len = 0, encoded_len = 0, hn;
	ssize_t xn;
	int have_old = 0, use_incremental = 0, published = 0, rc;
	enum vn_snapshot_result result = VN_SNAPSHOT_FAILED;
	struct stat st;
	struct vn_file_id id, new_id;
	int have_new_id = 0;

	memset(&old, 0, sizeof(old));
	memset(&now, 0, sizeof(now));
	if (!t->spool_ok) {
		b.what = "locate the spool directory";
		b.err = ENOENT;
		goto fail;
	}
	if (db->pMethods->xFileSize(db, &b.size) != SQLITE_OK) {
		b.what = "get the file size";
		goto fail;
	}
	if (b.size == 0)
		return VN_SNAPSHOT_EMPTY;
	if (ensure_buffers(t) != 0) {
		b.what = "allocate buffers";
		b.err = ENOMEM;
		goto fail;
	}
	rc = read_header(db, b.size, hdr, &hn);
	if (rc != SQLITE_OK) {
		b.what = "read the header";
		b.sqlite_rc = rc;
		goto fail;
	}
	/* Bytes 18 and 19: file format write/read versions; 2 means WAL. */
	if (hn >= 20 && (hdr[18] == 2 || hdr[19] == 2))
		return VN_SNAPSHOT_WAL;
	now.header_fprint = vn_umash_fprint(&t->keys->header, 0, hdr, hn);
	now.has_header_fprint = 1;
	xn = read_version_xattr(t, xattr, sizeof(xattr));
	if (xn == 0 && !t->no_xattr) {
		/* No version yet (a file never written through us): tag the
		 * current contents so that the next transaction can update this
		 * snapshot incrementally.  Safe under SHARED: the contents cannot
		 * change, and a crash before the manifest is published only leaves
		 * a version that no manifest has. */
		write_new_version(t);
		xn = read_version_xattr(t, xattr, sizeof(xattr));
	}
	if (xn < 0)
		xn = 0;
	now.version_id_len = make_version_id(now.version_id, xattr,
	    (size_t)xn, &now.header_fprint);

	if (!vn_spool_session_valid(b.s)) {
		vn_spool_close(b.s);
		free(t->cached);
		t->cached = NULL;
		rc = vn_spool_open(&t->spool, b.s);
		if (rc != 0) {
			b.what = b.s->what;
			b.err = rc;
			goto fail;
		}
	}
	b.n_chunks = ((uint64_t)b.size + VN_CHUNK_SIZE - 1) / VN_CHUNK_SIZE;
	b.words = malloc(16 * b.n_chunks);
	if (b.words == NULL) {
		b.what = "allocate the chunk list";
		b.err = ENOMEM;
		goto fail;
	}

	if (!t->force_full && t->base_valid && xn > 0) {
		if (t->cached != NULL &&
		    vn_spool_manifest_id(b.s, &t->spool, &id) == 0 &&
		    vn_file_id_equal(&id, &t->cached_id)) {
			old_buf = t->cached; /* still the staged manifest */
			old_len = t->cached_len;
			t->cached = NULL;
		} else if (vn_spool_read_manifest(b.s, &t->spool, &old_buf,
		    &old_len, &id) != 0) {
			old_buf = NULL;
		}
		have_old = old_buf != NULL &&
		    vn_manifest_decode(old_buf, old_len, &old) == 0;
		use_incremental = have_old && !old.has_base_chunks_fprint &&
		    old.len > 0 &&
		    old.n_words == 2 * ((old.len + VN_CHUNK_SIZE - 1) / VN_CHUNK_SIZE) &&
		    old.version_id_len == t->base_version_len &&
		    memcmp(old.version_id, t->base_version, old.version_id_len) == 0;
	}
	if (use_incremental) {
		rc = incremental(&b, &old);
		if (rc < 0)
			goto fail;
		if (rc > 0)
			use_incremental = 0;
	}
	if (!use_incremental && full_scan(&b) != 0)
		goto fail;

	if (use_incremental && old.len == (uint64_t)b.size &&
	    old.version_id_len == now.version_id_len &&
	    memcmp(old.version_id, now.version_id, now.version_id_len) == 0 &&
	    memcmp(old.chunks, b.words, 16 * b.n_chunks) == 0) {
		/* Nothing changed: the staged manifest is current. */
		t->stats.unchanged++;
		encoded = old_buf;
		encoded_len = old_len;
		old_buf = NULL;
		new_id = id;
		have_new_id = 1;
	} else {
		now.contents_fprint = vn_umash_fprint(&t->keys->directory, 0,
		    b.words, 16 * b.n_chunks);
		now.has_contents_fprint = 1;
		now.len = (uint64_t)b.size;
		if (stat(t->path, &st) == 0) {
			now.ctime = (int64_t)st.st_ctim.tv_sec;
			now.ctime_ns = (int32_t)st.st_ctim.tv_nsec;
		}
		now.chunks = b.words;
		now.n_words = 2 * b.n_chunks;
		now.bundled0 = t->chunk0;
		now.bundled0_len = b.size < VN_CHUNK_SIZE ? (size_t)b.size : VN_CHUNK_SIZE;
		now.has_bundled0 = 1;
		if (vn_manifest_encode(&now, &encoded, &encoded_len) != 0) {
			b.what = "encode the manifest";
			b.err = ENOMEM;
			goto fail;
		}
		rc = vn_spool_publish_manifest(b.s, &t->spool, encoded,
		    encoded_len, &new_id);
		if (rc != 0) {
			b.what = b.s->what;
			b.err = rc;
			goto fail;
		}
		have_new_id = 1;
		if (use_incremental)
			t->stats.incremental++;
		else
			t->stats.full++;
	}

	rc = vn_spool_publish_ready(b.s, &t->spool, encoded, encoded_len,
	    b.words, b.n_chunks, &published);
	if (rc != 0) {
		/* The staged snapshot stands; ready is retried next time. */
		vn_log(SQLITE_WARNING, "verneuil: %s: cannot publish ready: %s: %s",
		    t->path, b.s->what, strerror(rc));
	} else if (published) {
		t->stats.ready++;
	} else {
		maybe_gc(&b, config->gc_weight);
	}
	result = VN_SNAPSHOT_DONE;
	if (have_new_id) {
		free(t->cached);
		t->cached = encoded;
		t->cached_len = encoded_len;
		t->cached_id = new_id;
		encoded = NULL;
	}
	goto out;

fail:
	t->stats.failed++;
	if (b.err != 0)
		vn_log(SQLITE_WARNING, "verneuil: %s: snapshot abandoned: %s: %s",
		    t->path, b.what, strerror(b.err));
	else
		vn_log(b.sqlite_rc ? b.sqlite_rc : SQLITE_IOERR,
		    "verneuil: %s: snapshot abandoned: %s (SQLite error %d)",
		    t->path, b.what, b.sqlite_rc);
	vn_tracker_clear_version(t);
	vn_spool_close(b.s); /* reopened (and recreated) next time */
	free(t->cached);
	t->cached = NULL;
out:
	if (have_old)
		vn_manifest_release(&old);
	free(old_buf);
	free(encoded);
	free(b.words);
	return result;
}
