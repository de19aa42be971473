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

int verneuil_selfcheck(sqlite3_file *db, const char *spool_root,
    const char *db_path, char *msg, size_t cap)
{
	struct vn_spool spool;
	struct vn_manifest m;
	struct chunk_dirs dirs = { .n = 0 };
	char canon[PATH_MAX], path[PATH_MAX + 64];
	uint8_t hdr[VN_HEADER_BYTES];
	uint8_t *mbuf = NULL, *file_chunk = NULL;
	size_t mlen = 0, hn, bundled_seen = 0;
	sqlite3_int64 size;
	uint64_t n_chunks;
	struct vn_umash_fp fp;
	int rc, err, result = VERNEUIL_SELFCHECK_ERROR, have_spool = 0,
	    have_m = 0, db_fd = -1;

	if (msg != NULL && cap > 0)
		msg[0] = 0;
	pthread_once(&sc_keys_once, sc_derive_keys);
	memset(&m, 0, sizeof(m));

	rc = db->pMethods->xFileSize(db, &size);
	if (rc != SQLITE_OK) {
		say(msg, cap, "xFileSize: SQLite error %d", rc);
		return VERNEUIL_SELFCHECK_ERROR;
	}
	if (size == 0)
		return VERNEUIL_SELFCHECK_EMPTY;
	hn = size < VN_HEADER_BYTES ? (size_t)size : VN_HEADER_BYTES;
	rc = db->pMethods->xRead(db, hdr, (int)hn, 0);
	if (rc != SQLITE_OK) {
		say(msg, cap, "reading the header: SQLite error %d", rc);
		return VERNEUIL_SELFCHECK_ERROR;
	}
	if (hn >= 20 && (hdr[18] == 2 || hdr[19] == 2))
		return VERNEUIL_SELFCHECK_WAL;
	if (realpath(db_path, canon) == NULL) {
		say(msg, cap, "realpath(%s): %s", db_path, strerror(errno));
		return VERNEUIL_SELFCHECK_ERROR;
	}
	if (vn_journal_is_hot(canon))
		return VERNEUIL_SELFCHECK_HOT;

	err = vn_spool_init(&spool, &sc_keys, spool_root, canon);
	if (err != 0) {
		say(msg, cap, "locating the spool directory: %s", strerror(err));
		return VERNEUIL_SELFCHECK_ERROR;
	}
	have_spool = 1;
	db_fd = open(spool.db_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (db_fd < 0) {
		say(msg, cap, "no spool directory %s: %s", spool.db_dir,
		    strerror(errno));
		result = VERNEUIL_SELFCHECK_MISMATCH;
		goto out;
	}
	snprintf(path, sizeof(path), "staging/meta/%s", spool.manifest_name);
	err = read_file_at(db_fd, path, VN_MAX_MANIFEST_BYTES, &mbuf, &mlen);
	if (err != 0) {
		say(msg, cap, "no staged manifest %s/%s: %s", spool.db_dir,
		    path, strerror(err));
		result = VERNEUIL_SELFCHECK_MISMATCH;
		goto out;
	}
	if (vn_manifest_decode(mbuf, mlen, &m) != 0) {
		say(msg, cap, "the staged manifest (%zu bytes) does not decode",
		    mlen);
		result = VERNEUIL_SELFCHECK_MISMATCH;
		goto out;
	}
	have_m = 1;

	result = VERNEUIL_SELFCHECK_MISMATCH;
	n_chunks = ((uint64_t)size + VN_CHUNK_SIZE - 1) / VN_CHUNK_SIZE;
	if (m.len != (uint64_t)size) {
		say(msg, cap, "manifest len %llu, database size %lld",
		    (unsigned long long)m.len, (long long)size);
		goto out;
	}
	if (m.n_words != 2 * n_chunks) {
		say(msg, cap, "manifest has %zu chunk words, expected %llu",
		    m.n_words, (unsigned long long)(2 * n_chunks));
		goto out;
	}
	fp = vn_umash_fprint(&sc_keys.header, 0, hdr, hn);
	if (!m.has_header_fprint ||
	    !fp_eq(&m.header_fprint, fp.hash[0], fp.hash[1])) {
		say(msg, cap, "header_fprint is not that of the database header");
		goto out;
	}
	fp = vn_umash_fprint(&sc_keys.directory, 0, m.chunks, 16 * n_chunks);
	if (!m.has_contents_fprint ||
	    !fp_eq(&m.contents_fprint, fp.hash[0], fp.hash[1])) {
		say(msg, cap, "contents_fprint is not that of the chunk list");
		goto out;
	}

	file_chunk = malloc(2 * VN_CHUNK_SIZE);
	if (file_chunk == NULL) {
		say(msg, cap, "out of memory");
		result = VERNEUIL_SELFCHECK_ERROR;
		goto out;
	}
	{
		int fd = openat(db_fd, "staging/chunks",
		    O_RDONLY | O_DIRECTORY | O_CLOEXEC);

		if (fd >= 0)
			dirs.fd[dirs.n++] = fd;
	}
	add_snapshot_dirs(&dirs, db_fd, "ready");
	add_snapshot_dirs(&dirs, db_fd, "consuming");

	for (uint64_t i = 0; i < n_chunks; i++) {
		sqlite3_int64 off = (sqlite3_int64)i * VN_CHUNK_SIZE;
		size_t len = size - off < VN_CHUNK_SIZE ?
		    (size_t)(size - off) : VN_CHUNK_SIZE;
		uint64_t major = m.chunks[2 * i], minor = m.chunks[2 * i + 1];
		char name[VN_CHUNK_NAME_LEN + 1];
		uint8_t *staged = NULL;
		size_t staged_len = 0;
		int found = 0;

		rc = db->pMethods->xRead(db, file_chunk, (int)len, off);
		if (rc != SQLITE_OK) {
			say(msg, cap, "reading chunk %llu: SQLite error %d",
			    (unsigned long long)i, rc);
			result = VERNEUIL_SELFCHECK_ERROR;
			goto out;
		}
		fp = vn_umash_fprint(&sc_keys.chunk, 0, file_chunk, len);
		if (!fp_eq(&fp, major, minor)) {
			say(msg, cap, "chunk %llu of %llu: manifest fingerprint "
			    "%016llx%016llx, database chunk %016llx%016llx",
			    (unsigned long long)i, (unsigned long long)n_chunks,
			    (unsigned long long)major, (unsigned long long)minor,
			    (unsigned long long)fp.hash[0],
			    (unsigned long long)fp.hash[1]);
			goto out;
		}
		if (i == 0) {
			if (!m.has_bundled0 || m.bundled0_len != len ||
			    memcmp(m.bundled0, file_chunk, len) != 0) {
				say(msg, cap, "bundled chunk 0 (%s, %zu bytes) is "
				    "not the database's first %zu bytes",
				    m.has_bundled0 ? "present" : "absent",
				    m.bundled0_len, len);
				goto out;
			}
			continue;
		}
		for (size_t k = 0; k < m.n_extra; k++) {
			if (m.extra[k].index != i)
				continue;
			if (m.extra[k].len != len ||
			    memcmp(m.extra[k].data, file_chunk, len) != 0) {
				say(msg, cap, "bundled chunk %llu (%zu bytes) "
				    "differs from the database's (%zu bytes)",
				    (unsigned long long)i, m.extra[k].len, len);
				goto out;
			}
			bundled_seen++;
		}
		if (len == VN_CHUNK_SIZE &&
		    fp_eq(&sc_keys.zero_chunk, major, minor))
			continue; /* the well-known zero chunk is never staged */
		vn_chunk_name(major, minor, name);
		for (int d = 0; d < dirs.n && !found; d++) {
			err = read_file_at(dirs.fd[d], name, 2 * VN_CHUNK_SIZE,
			    &staged, &staged_len);
			if (err == ENOENT)
				continue;
			if (err != 0) {
				say(msg, cap, "reading staged chunk %s: %s", name,
				    strerror(err));
				goto out;
			}
			found = 1;
		}
		if (!found) {
			say(msg, cap, "chunk %llu of %llu (%s) is in neither "
			    "staging/chunks nor ready/ nor consuming/ of %s",
			    (unsigned long long)i, (unsigned long long)n_chunks,
			    name, spool.db_dir);
			goto out;
		}
		if (staged_len != len || memcmp(staged, file_chunk, len) != 0) {
			say(msg, cap, "staged chunk %s (%zu bytes) differs from "
			    "database chunk %llu (%zu bytes)", name, staged_len,
			    (unsigned long long)i, len);
			free(staged);
			goto out;
		}
		free(staged);
	}
	if (bundled_seen != m.n_extra) {
		say(msg, cap, "%zu bundled chunks past the end or repeated",
		    m.n_extra - bundled_seen);
		goto out;
	}
	result = VERNEUIL_SELFCHECK_OK;
out:
	close_dirs(&dirs);
	free(file_chunk);
	if (have_m)
		vn_manifest_release(&m);
	free(mbuf);
	if (db_fd >= 0)
		close(db_fd);
	if (have_spool)
		vn_spool_fini(&spool);
	return result;
}
