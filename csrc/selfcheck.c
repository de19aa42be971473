/*
 * Self-check of the writer: rebuild a database from its staged snapshot in
 * the spool and compare it, byte for byte, with the database file.
 *
 * A debugging and testing aid, kept apart from the VFS proper: nothing in
 * vfs.c, tracker.c or spool.c calls it.  Its user is the SQLite test-suite
 * harness (scripts/sqlite_testsuite/testfixture_init.c), which runs it after
 * every write transaction of every test with the `verneuil` VFS as SQLite's
 * default VFS; any other C host can call it the same way.
 *
 *   int verneuil_selfcheck(sqlite3_file *db, const char *spool_root,
 *       const char *db_path, char *msg, size_t cap);
 *
 * `db` is the open main database file (any VFS layer that reaches it: reads
 * go through db->pMethods->xRead, never through a second file descriptor,
 * whose close(2) would drop the process's POSIX locks on the file);
 * `spool_root` is the replication_spooling_dir the VFS was registered with;
 * `db_path` is the database's path.  The caller holds at least a SHARED lock
 * on the database, taken after the write transaction's snapshot was staged
 * (for the `verneuil` VFS: after xUnlock(SHARED) returned).
 *
 * What is checked (docs/FORMAT.md, docs/SPOOL.md), against staging/meta/<name>:
 *   - the manifest decodes, `len` is the file's size and `chunks` has one
 *     fingerprint per 64 KiB chunk;
 *   - header_fprint is the fingerprint of bytes [0, 100) of the file, and
 *     contents_fprint that of the chunk list;
 *   - chunk 0 is bundled, equals the file's chunk 0 and has its fingerprint;
 *   - any other bundled chunk (b-tree tops) equals the file's chunk at its
 *     index, and is also a chunk file like the others (below);
 *   - every other chunk's fingerprint is that of the file's chunk, and the
 *     chunk is either the well-known all-zero chunk or a file with exactly
 *     the database's bytes in staging/chunks, ready/<uuid>/chunks or
 *     consuming/<uuid>/chunks (no copier runs in the test suite, so every
 *     chunk must still be in the spool).
 *
 * Returns one of the VERNEUIL_SELFCHECK_* codes below; for MISMATCH and
 * ERROR, `msg` (if not NULL) says what was found.  Uses malloc, never
 * sqlite3_malloc, so that SQLite's memory accounting is not disturbed.
 */
#define _GNU_SOURCE
#include <sqlite3.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "manifest_pb.h"
#include "names.h"
#include "spool.h"
#include "tracker.h"

enum {
	VERNEUIL_SELFCHECK_OK = 0,        /* staged snapshot == database */
	VERNEUIL_SELFCHECK_EMPTY = 1,     /* empty file: nothing is staged */
	VERNEUIL_SELFCHECK_WAL = 2,       /* WAL database: not replicated */
	VERNEUIL_SELFCHECK_HOT = 3,       /* hot journal: no snapshot taken */
	VERNEUIL_SELFCHECK_MISMATCH = 4,  /* the staged snapshot is wrong */
	VERNEUIL_SELFCHECK_ERROR = 5,     /* could not check (I/O error...) */
};

int verneuil_selfcheck(sqlite3_file *db, const char *spool_root,
    const char *db_path, char *msg, size_t cap);

static struct vn_keys sc_keys;
static pthread_once_t sc_keys_once = PTHREAD_ONCE_INIT;

static void sc_derive_keys(void)
{
	vn_keys_derive(&sc_keys);
}

static void say(char *msg, size_t cap, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static void say(char *msg, size_t cap, const char *fmt, ...)
{
	va_list ap;

	if (msg == NULL || cap == 0)
		return;
	va_start(ap, fmt);
	vsnprintf(msg, cap, fmt, ap);
	va_end(ap);
}

/* Reads all of file `name` under directory fd `dirfd` (at most `max`
 * bytes): 0, ENOENT, EFBIG or another errno value. */
static int read_file_at(int dirfd, const char *name, size_t max,
    uint8_t **out, size_t *len)
{
	struct stat st;
	uint8_t *buf;
	size_t got = 0;
	int fd, err;

	fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno;
	if (fstat(fd, &st) != 0) {
		err = errno;
		close(fd);
		return err;
	}
	if ((uint64_t)st.st_size > max) {
		close(fd);
		return EFBIG;
	}
	buf = malloc((size_t)st.st_size + 1);
	if (buf == NULL) {
		close(fd);
		return ENOMEM;
	}
	while (got < (size_t)st.st_size) {
		ssize_t n = pread(fd, buf + got, (size_t)st.st_size - got,
		    (off_t)got);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	close(fd);
	*out = buf;
	*len = got;
	return 0;
}

/* Where staged chunk files may be: staging/chunks, then the chunks of the
 * (at most one) snapshot in ready/ and in consuming/. */
struct chunk_dirs {
	int fd[3];
	int n;
};

static void add_snapshot_dirs(struct chunk_dirs *d, int db_fd, const char *sub)
{
	char path[PATH_MAX];
	DIR *dir;
	struct dirent *e;
	int fd = openat(db_fd, sub, O_RDONLY | O_DIRECTORY | O_CLOEXEC);

	if (fd < 0)
		return;
	dir = fdopendir(fd);
	if (dir == NULL) {
		close(fd);
		return;
	}
	while ((e = readdir(dir)) != NULL && d->n < 3) {
		int cfd;

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%s/chunks", e->d_name);
		cfd = openat(dirfd(dir), path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		if (cfd >= 0)
			d->fd[d->n++] = cfd;
	}
	closedir(dir);
}

static void close_dirs(struct chunk_dirs *d)
{
	for (int i = 0; i < d->n; i++)
		close(d->fd[i]);
	d->n = 0;
}

static int fp_eq(const struct vn_umash_fp *a, uint64_t major, uint64_t minor)
{
	return a->hash[0] == major && a->hash[1] == minor;
}

/* One self-check as it goes through the checks below. */
struct check {
	sqlite3_file *db;
	char *msg;
	size_t cap;
	sqlite3_int64 size;
	uint64_t n_chunks;
	uint8_t hdr[VN_HEADER_BYTES];
	size_t hn;                   /* bytes of hdr read */
	char canon[PATH_MAX];
	struct vn_spool spool;
	int have_spool;
	int db_fd;                   /* the database's spool directory */
	uint8_t *mbuf;               /* the staged manifest's bytes */
	size_t mlen;
	struct vn_manifest m;        /* decoded from mbuf */
	int have_m;
	struct chunk_dirs dirs;
	uint8_t *file_chunk;         /* 2 * VN_CHUNK_SIZE */
	size_t bundled_seen;         /* extra bundled chunks matched so far */
};

/* The file itself: its size, its header, not WAL, no hot journal.
 * VERNEUIL_SELFCHECK_OK to go on; otherwise the result. */
static int check_file(struct check *c, const char *db_path)
{
	sqlite3_file *db = c->db;
	int rc;

	rc = db->pMethods->xFileSize(db, &c->size);
	if (rc != SQLITE_OK) {
		say(c->msg, c->cap, "xFileSize: SQLite error %d", rc);
		return VERNEUIL_SELFCHECK_ERROR;
	}
	if (c->size == 0)
		return VERNEUIL_SELFCHECK_EMPTY;
	c->hn = c->size < VN_HEADER_BYTES ? (size_t)c->size : VN_HEADER_BYTES;
	rc = db->pMethods->xRead(db, c->hdr, (int)c->hn, 0);
	if (rc != SQLITE_OK) {
		say(c->msg, c->cap, "reading the header: SQLite error %d", rc);
		return VERNEUIL_SELFCHECK_ERROR;
	}
	if (c->hn >= 20 && (c->hdr[18] == 2 || c->hdr[19] == 2))
		return VERNEUIL_SELFCHECK_WAL;
	if (realpath(db_path, c->canon) == NULL) {
		say(c->msg, c->cap, "realpath(%s): %s", db_path, strerror(errno));
		return VERNEUIL_SELFCHECK_ERROR;
	}
	if (vn_journal_is_hot(c->canon))
		return VERNEUIL_SELFCHECK_HOT;
	c->n_chunks = ((uint64_t)c->size + VN_CHUNK_SIZE - 1) / VN_CHUNK_SIZE;
	return VERNEUIL_SELFCHECK_OK;
}

/* The database's spool directory holds a staged manifest that decodes. */
static int check_manifest_decodes(struct check *c, const char *spool_root)
{
	char path[PATH_MAX + 64];
	int err;

	err = vn_spool_init(&c->spool, &sc_keys, spool_root, c->canon);
	if (err != 0) {
		say(c->msg, c->cap, "locating the spool directory: %s",
		    strerror(err));
		return VERNEUIL_SELFCHECK_ERROR;
	}
	c->have_spool = 1;
	c->db_fd = open(c->spool.db_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (c->db_fd < 0) {
		say(c->msg, c->cap, "no spool directory %s: %s",
		    c->spool.db_dir, strerror(errno));
		return VERNEUIL_SELFCHECK_MISMATCH;
	}
	snprintf(path, sizeof(path), "staging/meta/%s", c->spool.manifest_name);
	err = read_file_at(c->db_fd, path, VN_MAX_MANIFEST_BYTES, &c->mbuf,
	    &c->mlen);
	if (err != 0) {
		say(c->msg, c->cap, "no staged manifest %s/%s: %s",
		    c->spool.db_dir, path, strerror(err));
		return VERNEUIL_SELFCHECK_MISMATCH;
	}
	if (vn_manifest_decode(c->mbuf, c->mlen, &c->m) != 0) {
		say(c->msg, c->cap, "the staged manifest (%zu bytes) does not "
		    "decode", c->mlen);
		return VERNEUIL_SELFCHECK_MISMATCH;
	}
	c->have_m = 1;
	return VERNEUIL_SELFCHECK_OK;
}

/* The manifest's len, chunk count, header_fprint and contents_fprint. */
static int check_manifest_fields(struct check *c)
{
	const struct vn_manifest *m = &c->m;
	struct vn_umash_fp fp;

	if (m->len != (uint64_t)c->size) {
		say(c->msg, c->cap, "manifest len %llu, database size %lld",
		    (unsigned long long)m->len, (long long)c->size);
		return VERNEUIL_SELFCHECK_MISMATCH;
	}
	if (m->n_words != 2 * c->n_chunks) {
		say(c->msg, c->cap, "manifest has %zu chunk words, expected %llu",
		    m->n_words, (unsigned long long)(2 * c->n_chunks));
		return VERNEUIL_SELFCHECK_MISMATCH;
	}
	fp = vn_umash_fprint(&sc_keys.header, 0, c->hdr, c->hn);
	if (!m->has_header_fprint ||
	    !fp_eq(&m->header_fprint, fp.hash[0], fp.hash[1])) {
		say(c->msg, c->cap,
		    "header_fprint is not that of the database header");
		return VERNEUIL_SELFCHECK_MISMATCH;
	}
	fp = vn_umash_fprint(&sc_keys.directory, 0, m->chunks,
	    16 * c->n_chunks);
	if (!m->has_contents_fprint ||
	    !fp_eq(&m->contents_fprint, fp.hash[0], fp.hash[1])) {
		say(c->msg, c->cap,
		    "contents_fprint is not that of the chunk list");
		return VERNEUIL_SELFCHECK_MISMATCH;
	}
	return VERNEUIL_SELFCHECK_OK;
}

/* Chunk i of the file (len bytes, in c->file_chunk) has the manifest's
 * fingerprint for chunk i. */
static int check_chunk_fprint(struct check *c, uint64_t i, size_t len)
{
	uint64_t major = c->m.chunks[2 * i], minor = c->m.chunks[2 * i + 1];
	struct vn_umash_fp fp = vn_umash_fprint(&sc_keys.chunk, 0,
	    c->file_chunk, len);

	if (fp_eq(&fp, major, minor))
		return VERNEUIL_SELFCHECK_OK;
	say(c->msg, c->cap, "chunk %llu of %llu: manifest fingerprint "
	    "%016llx%016llx, database chunk %016llx%016llx",
	    (unsigned long long)i, (unsigned long long)c->n_chunks,
	    (unsigned long long)major, (unsigned long long)minor,
	    (unsigned long long)fp.hash[0], (unsigned long long)fp.hash[1]);
	return VERNEUIL_SELFCHECK_MISMATCH;
}

/* Chunk 0 is bundled, with the file's bytes. */
static int check_bundled0(struct check *c, size_t len)
{
	const struct vn_manifest *m = &c->m;

	if (m->has_bundled0 && m->bundled0_len == len &&
	    memcmp(m->bundled0, c->file_chunk, len) == 0)
		return VERNEUIL_SELFCHECK_OK;
	say(c->msg, c->cap, "bundled chunk 0 (%s, %zu bytes) is not the "
	    "database's first %zu bytes", m->has_bundled0 ? "present" : "absent",
	    m->bundled0_len, len);
	return VERNEUIL_SELFCHECK_MISMATCH;
}

/* Any other bundle of chunk i (a b-tree top) has the file's bytes. */
static int check_bundled_tops(struct check *c, uint64_t i, size_t len)
{
	const struct vn_manifest *m = &c->m;

	for (size_t k = 0; k < m->n_extra; k++) {
		if (m->extra[k].index != i)
			continue;
		if (m->extra[k].len != len ||
		    memcmp(m->extra[k].data, c->file_chunk, len) != 0) {
			say(c->msg, c->cap, "bundled chunk %llu (%zu bytes) "
			    "differs from the database's (%zu bytes)",
			    (unsigned long long)i, m->extra[k].len, len);
			return VERNEUIL_SELFCHECK_MISMATCH;
		}
		c->bundled_seen++;
	}
	return VERNEUIL_SELFCHECK_OK;
}

/* Chunk i (other than chunk 0) is the well-known zero chunk, or a file in
 * staging/chunks, ready/ or consuming/ with the file's bytes. */
static int check_chunk_file(struct check *c, uint64_t i, size_t len)
{
	uint64_t major = c->m.chunks[2 * i], minor = c->m.chunks[2 * i + 1];
	char name[VN_CHUNK_NAME_LEN + 1];
	uint8_t *staged = NULL;
	size_t staged_len = 0;
	int found = 0, err, result = VERNEUIL_SELFCHECK_OK;

	if (len == VN_CHUNK_SIZE && fp_eq(&sc_keys.zero_chunk, major, minor))
		return VERNEUIL_SELFCHECK_OK; /* never staged */
	vn_chunk_name(major, minor, name);
	for (int d = 0; d < c->dirs.n && !found; d++) {
		err = read_file_at(c->dirs.fd[d], name, 2 * VN_CHUNK_SIZE,
		    &staged, &staged_len);
		if (err == ENOENT)
			continue;
		if (err != 0) {
			say(c->msg, c->cap, "reading staged chunk %s: %s", name,
			    strerror(err));
			return VERNEUIL_SELFCHECK_MISMATCH;
		}
		found = 1;
	}
	if (!found) {
		say(c->msg, c->cap, "chunk %llu of %llu (%s) is in neither "
		    "staging/chunks nor ready/ nor consuming/ of %s",
		    (unsigned long long)i, (unsigned long long)c->n_chunks, name,
		    c->spool.db_dir);
		return VERNEUIL_SELFCHECK_MISMATCH;
	}
	if (staged_len != len || memcmp(staged, c->file_chunk, len) != 0) {
		say(c->msg, c->cap, "staged chunk %s (%zu bytes) differs from "
		    "database chunk %llu (%zu bytes)", name, staged_len,
		    (unsigned long long)i, len);
		result = VERNEUIL_SELFCHECK_MISMATCH;
	}
	free(staged);
	return result;
}

/* Every chunk of the file, in order, against the manifest and the spool;
 * then no bundle is left over (past the end, or repeated). */
static int check_chunks(struct check *c)
{
	int result = VERNEUIL_SELFCHECK_OK;
	int fd, rc;

	c->file_chunk = malloc(2 * VN_CHUNK_SIZE);
	if (c->file_chunk == NULL) {
		say(c->msg, c->cap, "out of memory");
		return VERNEUIL_SELFCHECK_ERROR;
	}
	fd = openat(c->db_fd, "staging/chunks",
	    O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd >= 0)
		c->dirs.fd[c->dirs.n++] = fd;
	add_snapshot_dirs(&c->dirs, c->db_fd, "ready");
	add_snapshot_dirs(&c->dirs, c->db_fd, "consuming");
	for (uint64_t i = 0; i < c->n_chunks && result == VERNEUIL_SELFCHECK_OK;
	    i++) {
		sqlite3_int64 off = (sqlite3_int64)i * VN_CHUNK_SIZE;
		size_t len = c->size - off < VN_CHUNK_SIZE ?
		    (size_t)(c->size - off) : VN_CHUNK_SIZE;

		rc = c->db->pMethods->xRead(c->db, c->file_chunk, (int)len, off);
		if (rc != SQLITE_OK) {
			say(c->msg, c->cap, "reading chunk %llu: SQLite error %d",
			    (unsigned long long)i, rc);
			return VERNEUIL_SELFCHECK_ERROR;
		}
		result = check_chunk_fprint(c, i, len);
		if (result == VERNEUIL_SELFCHECK_OK && i == 0)
			result = check_bundled0(c, len);
		else if (result == VERNEUIL_SELFCHECK_OK)
			result = check_bundled_tops(c, i, len);
		if (result == VERNEUIL_SELFCHECK_OK && i != 0)
			result = check_chunk_file(c, i, len);
	}
	if (result == VERNEUIL_SELFCHECK_OK && c->bundled_seen != c->m.n_extra) {
		say(c->msg, c->cap, "%zu bundled chunks past the end or repeated",
		    c->m.n_extra - c->bundled_seen);
		result = VERNEUIL_SELFCHECK_MISMATCH;
	}
	return result;
}

static void check_release(struct check *c)
{
	close_dirs(&c->dirs);
	free(c->file_chunk);
	if (c->have_m)
		vn_manifest_release(&c->m);
	free(c->mbuf);
	if (c->db_fd >= 0)
		close(c->db_fd);
	if (c->have_spool)
		vn_spool_fini(&c->spool);
}

/* The checks listed at the top of this file, in order; the first that
 * fails gives the result. */
int verneuil_selfcheck(sqlite3_file *db, const char *spool_root,
    const char *db_path, char *msg, size_t cap)
{
	struct check c = { .db = db, .msg = msg, .cap = cap, .db_fd = -1 };
	int result;

	if (msg != NULL && cap > 0)
		msg[0] = 0;
	pthread_once(&sc_keys_once, sc_derive_keys);
	result = check_file(&c, db_path);
	if (result == VERNEUIL_SELFCHECK_OK)
		result = check_manifest_decodes(&c, spool_root);
	if (result == VERNEUIL_SELFCHECK_OK)
		result = check_manifest_fields(&c);
	if (result == VERNEUIL_SELFCHECK_OK)
		result = check_chunks(&c);
	check_release(&c);
	return result;
}
