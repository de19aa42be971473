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
 *   int verneuil_selfcheck_wal(sqlite3_file *db, const volatile void *shm0,
 *       const char *spool_root, const char *db_path, char *msg, size_t cap);
 *
 * `db` is the open main database file (any VFS layer that reaches it: reads
 * go through db->pMethods->xRead, never through a second file descriptor,
 * whose close(2) would drop the process's POSIX locks on the file);
 * `spool_root` is the replication_spooling_dir the VFS was registered with;
 * `db_path` is the database's path, as SQLite opened it.  The caller holds
 * at least a SHARED lock on the database, taken after the write
 * transaction's snapshot was staged (for the `verneuil` VFS: after
 * xUnlock(SHARED) returned).
 *
 * A database whose header says WAL is compared as SQLite reads it: the file
 * with, for each page, its latest committed frame in `db_path`-wal, and bytes
 * 18 and 19 of the header set to 1 (docs/WRITER.md, "WAL databases").  The
 * WAL is read here, apart from csrc/wal.c, the way SQLite's recovery reads
 * it: up to its last valid commit frame (verneuil_selfcheck; the caller
 * holds an exclusive lock on the database, or knows that no WAL writer
 * runs), or up to the frame the wal-index header in shared-memory region
 * `shm0` names (verneuil_selfcheck_wal; the caller holds the WAL write lock).
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
	VERNEUIL_SELFCHECK_UNREADABLE = 2, /* WAL: no committed state to read
					    * (the wal-index header is not
					    * valid, or the WAL does not hold
					    * the frames it names) */
	VERNEUIL_SELFCHECK_HOT = 3,       /* hot journal: no snapshot taken */
	VERNEUIL_SELFCHECK_MISMATCH = 4,  /* the staged snapshot is wrong */
	VERNEUIL_SELFCHECK_ERROR = 5,     /* could not check (I/O error...) */
};

int verneuil_selfcheck(sqlite3_file *db, const char *spool_root,
    const char *db_path, char *msg, size_t cap);
int verneuil_selfcheck_wal(sqlite3_file *db, const volatile void *shm0,
    const char *spool_root, const char *db_path, char *msg, size_t cap);

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

/* ---- the committed state of a WAL database -------------------------------- */

/* SQLite's WAL (src/wal.c): a 32-byte header, frames of a 24-byte header and
 * a page; the wal-index header (48 bytes, twice) in shared memory. */
#define SC_WAL_HEADER 32
#define SC_FRAME_HEADER 24
#define SC_WALINDEX_HEADER 48
/* Most pages of a checked database: the test suite's are small; a page's
 * frame offsets take 8 bytes each. */
#define SC_MAX_PAGES (1u << 24)

struct sc_wal {
	int fd;              /* <db>-wal, -1: none */
	uint32_t pgsz;
	int big_endian;      /* checksum words */
	uint8_t salt[8];
	uint32_t ck[2];      /* the chain so far */
	uint32_t mx, npage;  /* the last commit and its size in pages */
	uint64_t *at;        /* at[pgno - 1]: WAL offset of the page's latest
			      * committed frame's data; 0: none */
	uint32_t n_at;
	uint8_t *frame;
};

static uint32_t be32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 |
	    (uint32_t)p[2] << 8 | p[3];
}

static void sc_cksum(int big_endian, const uint8_t *a, size_t n,
    uint32_t s[2])
{
	for (size_t i = 0; i + 8 <= n; i += 8) {
		uint32_t x0, x1;

		if (big_endian) {
			x0 = be32(a + i);
			x1 = be32(a + i + 4);
		} else {
			memcpy(&x0, a + i, 4);
			memcpy(&x1, a + i + 4, 4);
		}
		s[0] += x0 + s[1];
		s[1] += x1 + s[0];
	}
}

/* Reads the WAL header: 1 if there is a valid one, 0 if not, -1 on I/O
 * errors other than a short file. */
static int sc_wal_header(struct sc_wal *w)
{
	uint8_t h[SC_WAL_HEADER];
	uint32_t magic, s[2] = { 0, 0 };

	if (w->fd < 0 || pread(w->fd, h, sizeof(h), 0) != (ssize_t)sizeof(h))
		return 0;
	magic = be32(h);
	w->pgsz = be32(h + 8);
	w->big_endian = (int)(magic & 1);
	sc_cksum(w->big_endian, h, 24, s);
	if ((magic & ~1u) != 0x377f0682u || be32(h + 4) != 3007000 ||
	    w->pgsz < 512 || w->pgsz > 65536 || (w->pgsz & (w->pgsz - 1)) ||
	    s[0] != be32(h + 24) || s[1] != be32(h + 28))
		return 0;
	memcpy(w->salt, h + 16, 8);
	w->ck[0] = s[0];
	w->ck[1] = s[1];
	w->frame = malloc(w->pgsz + SC_FRAME_HEADER);
	return w->frame != NULL ? 1 : -1;
}

/* Frame f: 1 valid (the chain moves on; *pgno, *commit), 0 not. */
static int sc_frame(struct sc_wal *w, uint32_t f, uint32_t *pgno,
    uint32_t *commit)
{
	size_t n = w->pgsz + SC_FRAME_HEADER;
	off_t off = SC_WAL_HEADER + (off_t)(f - 1) * (off_t)n;
	uint32_t s[2] = { w->ck[0], w->ck[1] };

	if (pread(w->fd, w->frame, n, off) != (ssize_t)n)
		return 0;
	*pgno = be32(w->frame);
	*commit = be32(w->frame + 4);
	if (*pgno == 0 || *pgno > SC_MAX_PAGES ||
	    memcmp(w->frame + 8, w->salt, 8) != 0)
		return 0;
	sc_cksum(w->big_endian, w->frame, 8, s);
	sc_cksum(w->big_endian, w->frame + SC_FRAME_HEADER, w->pgsz, s);
	if (s[0] != be32(w->frame + 16) || s[1] != be32(w->frame + 20))
		return 0;
	w->ck[0] = s[0];
	w->ck[1] = s[1];
	return 1;
}

static int sc_note(struct sc_wal *w, uint32_t pgno, uint32_t f)
{
	if (pgno > w->n_at) {
		uint32_t n = pgno < 1024 ? 1024 : 2 * pgno;
		uint64_t *at = realloc(w->at, (size_t)n * sizeof(*at));

		if (at == NULL)
			return -1;
		memset(at + w->n_at, 0, (size_t)(n - w->n_at) * sizeof(*at));
		w->at = at;
		w->n_at = n;
	}
	w->at[pgno - 1] = SC_WAL_HEADER + (uint64_t)(f - 1) *
	    (w->pgsz + SC_FRAME_HEADER) + SC_FRAME_HEADER;
	return 0;
}

/*
 * The committed frames: every valid frame up to `upto` (which must all be
 * valid, the last a commit), or (upto == 0) up to the last commit frame
 * before the first invalid one.  0, or -1 if the WAL is not as the
 * wal-index says.
 */
static int sc_wal_frames(struct sc_wal *w, uint32_t upto)
{
	uint32_t pending_from = 1, pgno, commit;
	uint32_t *pages = NULL;
	size_t cap = 0;
	int rc = 0;

	for (uint32_t f = 1; upto == 0 || f <= upto; f++) {
		if (!sc_frame(w, f, &pgno, &commit)) {
			rc = upto == 0 ? 0 : -1;
			break;
		}
		if (f - pending_from >= cap) {
			uint32_t *more = realloc(pages, (cap = 2 * cap + 64) *
			    sizeof(*pages));

			if (more == NULL) {
				rc = -1;
				break;
			}
			pages = more;
		}
		pages[f - pending_from] = pgno;
		if (commit == 0)
			continue;
		for (uint32_t g = pending_from; g <= f && rc == 0; g++)
			rc = sc_note(w, pages[g - pending_from], g);
		w->mx = f;
		w->npage = commit;
		pending_from = f + 1;
	}
	if (rc == 0 && upto != 0 && w->mx != upto)
		rc = -1;
	free(pages);
	return rc;
}

/* The wal-index header of shared-memory region 0: 0 and its last committed
 * frame and size, or -1 if it is not a valid one. */
static int sc_walindex(const volatile void *shm0, uint8_t salt[8],
    uint32_t *mx, uint32_t *npage, uint32_t *pgsz)
{
	uint16_t szpage;

	uint8_t h[2 * SC_WALINDEX_HEADER];
	uint32_t w[12], s[2] = { 0, 0 };

	if (shm0 == NULL)
		return -1;
	memcpy(h, (const void *)shm0, sizeof(h));
	memcpy(w, h, sizeof(w));
	if (memcmp(h, h + SC_WALINDEX_HEADER, SC_WALINDEX_HEADER) != 0 ||
	    h[12] == 0 || w[0] != 3007000)
		return -1;
	for (int i = 0; i < 10; i += 2) {
		s[0] += w[i] + s[1];
		s[1] += w[i + 1] + s[0];
	}
	if (s[0] != w[10] || s[1] != w[11])
		return -1;
	*mx = w[4];
	*npage = w[5];
	memcpy(&szpage, h + 14, 2);
	*pgsz = szpage == 1 ? 65536 : szpage;
	memcpy(salt, h + 32, 8);
	return 0;
}

static void sc_wal_free(struct sc_wal *w)
{
	if (w->fd >= 0)
		close(w->fd);
	free(w->at);
	free(w->frame);
	memset(w, 0, sizeof(*w));
	w->fd = -1;
}

/* One self-check as it goes through the checks below. */
struct check {
	sqlite3_file *db;
	char *msg;
	size_t cap;
	int is_wal;                  /* the committed state is file + WAL */
	const volatile void *shm0;   /* the wal-index, if the caller has it */
	struct sc_wal wal;
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

/* Bytes [off, off + len) of the committed state: the file's (past its end,
 * zeros, for a WAL database), each page with a committed frame replaced by
 * its latest one, the header's format versions 2 read as 1. */
static int read_state(struct check *c, uint8_t *buf, size_t len,
    sqlite3_int64 off)
{
	struct sc_wal *w = &c->wal;
	int rc = c->db->pMethods->xRead(c->db, buf, (int)len, off);

	if (rc != SQLITE_OK && !(c->is_wal && rc == SQLITE_IOERR_SHORT_READ)) {
		say(c->msg, c->cap, "reading %zu bytes at %lld: SQLite error %d",
		    len, (long long)off, rc);
		return -1;
	}
	for (uint64_t p = (uint64_t)off / (w->pgsz ? w->pgsz : 1);
	    c->is_wal && w->n_at > 0 && p * w->pgsz < (uint64_t)off + len &&
	    p < w->n_at; p++) {
		uint64_t page = p * w->pgsz;
		uint64_t from = page > (uint64_t)off ? page : (uint64_t)off;
		uint64_t to = page + w->pgsz < (uint64_t)off + len ?
		    page + w->pgsz : (uint64_t)off + len;

		if (w->at[p] == 0)
			continue;
		if (pread(w->fd, w->frame, w->pgsz, (off_t)w->at[p]) !=
		    (ssize_t)w->pgsz) {
			say(c->msg, c->cap, "reading page %llu from the WAL: %s",
			    (unsigned long long)p + 1, strerror(errno));
			return -1;
		}
		memcpy(buf + (from - (uint64_t)off), w->frame + (from - page),
		    (size_t)(to - from));
	}
	for (sqlite3_int64 i = 18; c->is_wal && i <= 19; i++)
		if (i >= off && i < off + (sqlite3_int64)len && buf[i - off] == 2)
			buf[i - off] = 1;
	return 0;
}

/* The WAL's committed frames and the committed state's size: up to the
 * frame the wal-index header names (c->shm0), or SQLite's recovery's. */
static int load_wal(struct check *c, const char *db_path)
{
	char path[PATH_MAX + 8];
	uint8_t salt[8];
	uint32_t mx = 0, npage = 0, pgsz = 0;
	int hdr;

	snprintf(path, sizeof(path), "%s-wal", db_path);
	c->wal.fd = open(path, O_RDONLY | O_CLOEXEC);
	if (c->shm0 != NULL &&
	    sc_walindex(c->shm0, salt, &mx, &npage, &pgsz) != 0) {
		say(c->msg, c->cap, "the wal-index header is not valid");
		return VERNEUIL_SELFCHECK_UNREADABLE;
	}
	hdr = sc_wal_header(&c->wal);
	if (hdr < 0 || (mx > 0 && (hdr == 0 ||
	    memcmp(salt, c->wal.salt, 8) != 0))) {
		say(c->msg, c->cap, "%s holds no header of the WAL's "
		    "generation the wal-index names", path);
		return hdr < 0 ? VERNEUIL_SELFCHECK_ERROR :
		    VERNEUIL_SELFCHECK_UNREADABLE;
	}
	if (hdr > 0 && (c->shm0 == NULL || mx > 0) &&
	    (sc_wal_frames(&c->wal, mx) != 0 ||
	    (c->shm0 != NULL && c->wal.npage != npage))) {
		say(c->msg, c->cap, "%s does not hold the %u committed frames "
		    "the wal-index names", path, mx);
		return VERNEUIL_SELFCHECK_UNREADABLE;
	}
	if (c->shm0 != NULL && mx == 0) {
		c->wal.npage = npage; /* kept across a WAL reset */
		c->wal.pgsz = pgsz;
	}
	if (c->wal.npage != 0)
		c->size = (sqlite3_int64)c->wal.npage * c->wal.pgsz;
	return VERNEUIL_SELFCHECK_OK;
}

/* The file itself: its size (the committed state's, for a WAL database),
 * its header, no hot journal.  VERNEUIL_SELFCHECK_OK to go on; otherwise
 * the result. */
static int check_file(struct check *c, const char *db_path)
{
	sqlite3_file *db = c->db;
	int rc;

	rc = db->pMethods->xFileSize(db, &c->size);
	if (rc != SQLITE_OK) {
		say(c->msg, c->cap, "xFileSize: SQLite error %d", rc);
		return VERNEUIL_SELFCHECK_ERROR;
	}
	c->hn = c->size < VN_HEADER_BYTES ? (size_t)c->size : VN_HEADER_BYTES;
	if (c->hn > 0 && (rc = db->pMethods->xRead(db, c->hdr, (int)c->hn,
	    0)) != SQLITE_OK) {
		say(c->msg, c->cap, "reading the header: SQLite error %d", rc);
		return VERNEUIL_SELFCHECK_ERROR;
	}
	c->is_wal = c->shm0 != NULL ||
	    (c->hn >= 20 && (c->hdr[18] == 2 || c->hdr[19] == 2));
	if (c->is_wal && (rc = load_wal(c, db_path)) != VERNEUIL_SELFCHECK_OK)
		return rc;
	if (c->size == 0)
		return VERNEUIL_SELFCHECK_EMPTY;
	c->hn = c->size < VN_HEADER_BYTES ? (size_t)c->size : VN_HEADER_BYTES;
	if (read_state(c, c->hdr, c->hn, 0) != 0)
		return VERNEUIL_SELFCHECK_ERROR;
	if (realpath(db_path, c->canon) == NULL) {
		say(c->msg, c->cap, "realpath(%s): %s", db_path, strerror(errno));
		return VERNEUIL_SELFCHECK_ERROR;
	}
	if (!c->is_wal && vn_journal_is_hot(c->canon))
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
	int fd;

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

		if (read_state(c, c->file_chunk, len, off) != 0)
			return VERNEUIL_SELFCHECK_ERROR;
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
	sc_wal_free(&c->wal);
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
	return verneuil_selfcheck_wal(db, NULL, spool_root, db_path, msg, cap);
}

int verneuil_selfcheck_wal(sqlite3_file *db, const volatile void *shm0,
    const char *spool_root, const char *db_path, char *msg, size_t cap)
{
	struct check c = { .db = db, .msg = msg, .cap = cap, .db_fd = -1,
	    .shm0 = shm0, .wal = { .fd = -1 } };
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
