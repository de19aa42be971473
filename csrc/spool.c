/*
 * The spool: see spool.h and docs/SPOOL.md.  The names of its files are
 * the store's object names (names.c).
 */
#define _GNU_SOURCE
#include "spool.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* Scratch entries (temp files and dirs) older than this belong to a writer
 * that died: a live writer fills and renames a scratch file within one
 * snapshot update, which takes seconds even for a large database, so ten
 * minutes leaves a wide margin while still bounding leftovers of crashes. */
#define VN_SCRATCH_STALE_SECONDS 600

/* Directories are created with this mode, less the umask: several users'
 * processes may write one database, and the spool is local scratch. */
#define VN_DIR_MODE 0777

/* Published files are read-only (SPOOL.md): nobody may update them in place. */
#define VN_FILE_MODE 0444

/* Random scratch names carry this many random bytes: 128 bits, so that
 * concurrent writers (threads, processes, forks) never collide. */
#define VN_SCRATCH_RANDOM_BYTES 16

/* Deepest tree remove_tree_at() descends: scratch/<tmp>/<uuid>/chunks/<file>
 * is 4 levels; anything deeper is not ours and is left alone. */
#define VN_TREE_MAX_DEPTH 8

/* Up to this many bytes of /proc/sys/kernel/random/boot_id are used (a
 * UUID is 36 characters). */
#define VN_BOOT_ID_MAX 64

static_assert(VN_MANIFEST_NAME_MAX <= NAME_MAX + 1,
    "manifest names must fit in a file name");
static_assert(VN_CHUNK_NAME_LEN <= NAME_MAX,
    "chunk names must fit in a file name");

static const char hex_digits[] = "0123456789abcdef";

/* ---- randomness --------------------------------------------------------- */

void vn_random_bytes(void *buf, size_t n)
{
	unsigned char *p = buf;
	size_t got = 0;

	while (got < n) {
		ssize_t r = getrandom(p + got, n - got, 0);

		if (r < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		got += (size_t)r;
	}
	if (got < n) {
		int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);

		if (fd >= 0) {
			ssize_t r;

			while (got < n && (r = read(fd, p + got, n - got)) > 0)
				got += (size_t)r;
			close(fd);
		}
	}
	if (got < n) {
		/* Last resort: not secret, merely distinct between processes. */
		struct timespec ts;
		uint64_t x;

		clock_gettime(CLOCK_REALTIME, &ts);
		x = ((uint64_t)ts.tv_sec * 1000000007u) ^ (uint64_t)ts.tv_nsec ^
		    ((uint64_t)getpid() << 32);
		for (; got < n; got++) {
			x ^= x << 13;
			x ^= x >> 7;
			x ^= x << 17;
			p[got] = (unsigned char)x;
		}
	}
}

static void random_name(char out[2 * VN_SCRATCH_RANDOM_BYTES + 1])
{
	unsigned char r[VN_SCRATCH_RANDOM_BYTES];

	vn_random_bytes(r, sizeof(r));
	for (size_t i = 0; i < sizeof(r); i++) {
		out[2 * i] = hex_digits[r[i] >> 4];
		out[2 * i + 1] = hex_digits[r[i] & 15];
	}
	out[2 * sizeof(r)] = 0;
}

static void random_uuid(char out[37])
{
	unsigned char u[16];

	vn_random_bytes(u, sizeof(u));
	u[6] = (unsigned char)((u[6] & 0x0f) | 0x40);
	u[8] = (unsigned char)((u[8] & 0x3f) | 0x80);
	snprintf(out, 37,
	    "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
	    "%02x%02x%02x%02x%02x%02x",
	    u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10],
	    u[11], u[12], u[13], u[14], u[15]);
}

/* ---- paths -------------------------------------------------------------- */

static int boot_root_name(char *out, size_t cap)
{
	char id[VN_BOOT_ID_MAX + 1] = { 0 };
	struct stat st;
	int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
	ssize_t n;

	if (fd < 0)
		return errno;
	n = read(fd, id, VN_BOOT_ID_MAX);
	close(fd);
	if (n <= 0)
		return EIO;
	id[strcspn(id, "\n \t")] = 0;
	if (stat("/proc/1", &st) != 0)
		return errno;
	if ((size_t)snprintf(out, cap, "%s.%lld", id, (long long)st.st_ctime) >= cap)
		return ENAMETOOLONG;
	return 0;
}

static int db_dir_path(const struct vn_keys *keys, const char *spool_root,
    const char *canon, char *out, size_t cap)
{
	char boot[2 * VN_BOOT_ID_MAX];
	struct stat st;
	uint64_t h;
	int rc;

	rc = boot_root_name(boot, sizeof(boot));
	if (rc != 0)
		return rc;
	if (stat(canon, &st) != 0)
		return errno;
	h = vn_umash_full(&keys->path, 0, 0, canon, strlen(canon));
	if ((size_t)snprintf(out, cap, "%s/%s/%016llx.%llx.%llx", spool_root,
		boot, (unsigned long long)h, (unsigned long long)st.st_dev,
		(unsigned long long)st.st_ino) >= cap)
		return ENAMETOOLONG;
	return 0;
}

int vn_spool_db_dir(const struct vn_keys *keys, const char *spool_root,
    const char *db_path, char *out, size_t cap)
{
	char canon[PATH_MAX];

	if (realpath(db_path, canon) == NULL)
		return errno;
	return db_dir_path(keys, spool_root, canon, out, cap);
}

int vn_spool_init(struct vn_spool *spool, const struct vn_keys *keys,
    const char *spool_root, const char *canon)
{
	char dir[PATH_MAX];
	int rc;

	memset(spool, 0, sizeof(*spool));
	rc = db_dir_path(keys, spool_root, canon, dir, sizeof(dir));
	if (rc == 0)
		rc = vn_manifest_name(keys, canon, spool->manifest_name);
	if (rc != 0)
		return rc;
	spool->db_dir = strdup(dir);
	spool->source = strdup(canon);
	if (spool->db_dir == NULL || spool->source == NULL) {
		vn_spool_fini(spool);
		return ENOMEM;
	}
	return 0;
}

void vn_spool_fini(struct vn_spool *spool)
{
	free(spool->db_dir);
	free(spool->source);
	spool->db_dir = NULL;
	spool->source = NULL;
}

/* ---- file helpers ------------------------------------------------------- */

/* Writes every byte of iov[0..cnt) (advancing over short writes); 0 or an
 * errno value.  Modifies iov. */
static int writev_all(int fd, struct iovec *iov, int cnt)
{
	while (cnt > 0) {
		ssize_t w = writev(fd, iov, cnt > IOV_MAX ? IOV_MAX : cnt);

		if (w < 0) {
			if (errno == EINTR)
				continue;
			return errno;
		}
		while (cnt > 0 && (size_t)w >= iov->iov_len) {
			w -= (ssize_t)iov->iov_len;
			iov++;
			cnt--;
		}
		if (cnt > 0) {
			iov->iov_base = (char *)iov->iov_base + w;
			iov->iov_len -= (size_t)w;
		}
	}
	return 0;
}

static void file_id_of(const struct stat *st, struct vn_file_id *id)
{
	id->dev = (uint64_t)st->st_dev;
	id->ino = (uint64_t)st->st_ino;
	id->size = (uint64_t)st->st_size;
	id->mtime_sec = (int64_t)st->st_mtim.tv_sec;
	id->mtime_nsec = (int64_t)st->st_mtim.tv_nsec;
}

int vn_file_id_equal(const struct vn_file_id *a, const struct vn_file_id *b)
{
	return a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
	    a->mtime_sec == b->mtime_sec && a->mtime_nsec == b->mtime_nsec;
}

/* Writes iov[0..cnt) to a fresh read-only scratch file (created 0444: it
 * is never writable through a name); its name goes to tmp, and its identity
 * to *id if not NULL. */
static int write_scratch(struct vn_spool_session *s, const struct iovec *iov,
    int cnt, char tmp[2 * VN_SCRATCH_RANDOM_BYTES + 1],
    struct vn_file_id *id)
{
	struct iovec left[VN_SPOOL_IOV_MAX];
	struct stat st;
	uint64_t total;
	int fd, rc;

	if (cnt > VN_SPOOL_IOV_MAX) {
		s->what = "write scratch file";
		return EINVAL;
	}
	memcpy(left, iov, (size_t)cnt * sizeof(*iov));
	total = 0;
	for (int k = 0; k < cnt; k++)
		total += iov[k].iov_len;
	rc = vn_spool_check_room(s, total);
	if (rc != 0)
		return rc;
	random_name(tmp);
	fd = openat(s->scratch_fd, tmp,
	    O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, VN_FILE_MODE);
	if (fd < 0) {
		s->what = "create scratch file";
		return errno;
	}
	rc = writev_all(fd, left, cnt);
	if (rc == 0 && id != NULL) {
		if (fstat(fd, &st) == 0)
			file_id_of(&st, id);
		else
			rc = errno;
	}
	if (close(fd) != 0 && rc == 0)
		rc = errno;
	if (rc != 0) {
		s->what = "write scratch file";
		unlinkat(s->scratch_fd, tmp, 0);
	}
	return rc;
}

int vn_spool_check_room(struct vn_spool_session *s, uint64_t bytes)
{
	struct statvfs sv;
	uint64_t avail, reserve;

	if (fstatvfs(s->db_fd, &sv) != 0)
		return 0;
	avail = (uint64_t)sv.f_bavail * sv.f_frsize;
	reserve = (uint64_t)sv.f_blocks * sv.f_frsize / 100 * VN_SPOOL_FREE_PERCENT;
	if (reserve > VN_SPOOL_FREE_MAX)
		reserve = VN_SPOOL_FREE_MAX;
	if (avail >= reserve && avail - reserve >= bytes)
		return 0;
	s->what = "keep the spool's file system from filling up";
	return ENOSPC;
}

/*
 * Publishes data as dirfd/name by scratch + rename.  When `replace`, the
 * name usually exists already: we then swap the two names atomically with
 * renameat2(RENAME_EXCHANGE) and unlink the old file from scratch.  Readers
 * see the same thing as with a plain rename (the name always exists and
 * moves to a new inode at once), but ext4 does not flush the new file's data
 * as it does for a rename over an existing file (auto_da_alloc), which costs
 * more than the rest of a commit's snapshot.
 */
static int publish_file_ex(struct vn_spool_session *s, int dirfd,
    const char *name, const struct iovec *iov, int cnt, int replace,
    struct vn_file_id *id)
{
	char tmp[2 * VN_SCRATCH_RANDOM_BYTES + 1];
	int rc = write_scratch(s, iov, cnt, tmp, id);

	if (rc != 0)
		return rc;
	if (replace) {
		if (renameat2(s->scratch_fd, tmp, dirfd, name, RENAME_EXCHANGE) == 0) {
			unlinkat(s->scratch_fd, tmp, 0); /* now the old file */
			return 0;
		}
		/* ENOENT: nothing to replace; EINVAL/ENOSYS: no support. */
	}
	if (renameat(s->scratch_fd, tmp, dirfd, name) != 0) {
		rc = errno;
		s->what = "rename scratch file into place";
		unlinkat(s->scratch_fd, tmp, 0);
	}
	return rc;
}

static int publish_file(struct vn_spool_session *s, int dirfd,
    const char *name, const void *data, size_t n)
{
	struct iovec iov = { .iov_base = (void *)data, .iov_len = n };

	return publish_file_ex(s, dirfd, name, &iov, 1, 0, NULL);
}

static int mkdir_p(const char *path)
{
	char buf[PATH_MAX];
	size_t n = strlen(path);

	if (n >= sizeof(buf))
		return ENAMETOOLONG;
	memcpy(buf, path, n + 1);
	for (size_t i = 1; i <= n; i++) {
		if (buf[i] != '/' && buf[i] != 0)
			continue;
		buf[i] = 0;
		if (mkdir(buf, VN_DIR_MODE) != 0 && errno != EEXIST)
			return errno;
		buf[i] = (char)(i == n ? 0 : '/');
	}
	return 0;
}

static int open_dir_at(int dirfd, const char *name, int create)
{
	int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);

	if (fd < 0 && errno == ENOENT && create) {
		if (mkdirat(dirfd, name, VN_DIR_MODE) != 0 && errno != EEXIST)
			return -1;
		fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	}
	return fd;
}

/* Removes dirfd/name, recursively if it is a directory. */
static void remove_tree_at(int dirfd, const char *name, int depth)
{
	DIR *d;
	struct dirent *e;
	int fd;

	if (unlinkat(dirfd, name, 0) == 0 || errno == ENOENT)
		return;
	if (errno != EISDIR && errno != EPERM)
		return;
	if (depth > VN_TREE_MAX_DEPTH)
		return;
	fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0)
		return;
	d = fdopendir(fd);
	if (d == NULL) {
		close(fd);
		return;
	}
	while ((e = readdir(d)) != NULL) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		remove_tree_at(fd, e->d_name, depth + 1);
	}
	closedir(d);
	unlinkat(dirfd, name, AT_REMOVEDIR);
}

/* ---- sessions ----------------------------------------------------------- */

static void session_reset(struct vn_spool_session *s)
{
	s->db_fd = s->chunks_fd = s->meta_fd = s->scratch_fd = -1;
	s->walrec_fd = -1;
	s->what = NULL;
	s->link_mode = VN_LINK_UNKNOWN;
}

void vn_spool_session_init(struct vn_spool_session *s)
{
	session_reset(s);
}

int vn_spool_session_valid(const struct vn_spool_session *s)
{
	/* Only the three leaves: a directory can only be removed once empty,
	 * so a removed <dbdir> or staging implies removed leaves.  (A renamed
	 * tree is not detected, as before: it still works, under its new
	 * name.) */
	const int fds[] = { s->chunks_fd, s->meta_fd, s->scratch_fd };
	struct stat st;

	if (s->db_fd < 0)
		return 0;
	for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++)
		if (fds[i] < 0 || fstat(fds[i], &st) != 0 || st.st_nlink == 0)
			return 0;
	return 1;
}

void vn_spool_close(struct vn_spool_session *s)
{
	int *fds[] = { &s->db_fd, &s->chunks_fd, &s->meta_fd, &s->scratch_fd,
	    &s->walrec_fd };

	for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++) {
		if (*fds[i] >= 0)
			close(*fds[i]);
		*fds[i] = -1;
	}
}

int vn_spool_open(const struct vn_spool *spool, struct vn_spool_session *s)
{
	int staging_fd = -1, rc;
	struct stat st;

	session_reset(s);
	s->db_fd = open(spool->db_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (s->db_fd < 0 && errno == ENOENT) {
		rc = mkdir_p(spool->db_dir);
		if (rc != 0) {
			s->what = "create the spool directory";
			return rc;
		}
		s->db_fd = open(spool->db_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	}
	if (s->db_fd < 0) {
		s->what = "open the spool directory";
		return errno;
	}
	if (fstatat(s->db_fd, "source", &st, 0) != 0) {
		rc = errno;
		if (rc != ENOENT) {
			s->what = "stat source";
			goto fail;
		}
		staging_fd = open_dir_at(s->db_fd, "staging", 1);
		s->scratch_fd = staging_fd < 0 ? -1 :
		    open_dir_at(staging_fd, "scratch", 1);
		if (s->scratch_fd < 0) {
			rc = errno;
			s->what = "create staging/scratch";
			goto fail;
		}
		rc = publish_file(s, s->db_fd, "source", spool->source,
		    strlen(spool->source));
		if (rc != 0)
			goto fail;
	}
	if (staging_fd < 0)
		staging_fd = open_dir_at(s->db_fd, "staging", 1);
	if (staging_fd < 0) {
		rc = errno;
		s->what = "open staging";
		goto fail;
	}
	if (s->scratch_fd < 0)
		s->scratch_fd = open_dir_at(staging_fd, "scratch", 1);
	s->chunks_fd = open_dir_at(staging_fd, "chunks", 1);
	s->meta_fd = open_dir_at(staging_fd, "meta", 1);
	if (s->scratch_fd < 0 || s->chunks_fd < 0 || s->meta_fd < 0) {
		rc = errno;
		s->what = "open staging/{chunks,meta,scratch}";
		goto fail;
	}
	close(staging_fd);
	return 0;

fail:
	if (staging_fd >= 0)
		close(staging_fd);
	vn_spool_close(s);
	return rc;
}

/* ---- the WAL record ------------------------------------------------------ */

/* Writers of several users may share a database's spool (VN_DIR_MODE): the
 * record is theirs to rewrite, less the umask. */
#define VN_WALREC_MODE 0666

static int open_walrec(struct vn_spool_session *s)
{
	if (s->walrec_fd >= 0)
		return 0;
	s->walrec_fd = openat(s->db_fd, "staging/wal-position",
	    O_RDWR | O_CREAT | O_CLOEXEC, VN_WALREC_MODE);
	if (s->walrec_fd < 0) {
		s->what = "open staging/wal-position";
		return errno;
	}
	return 0;
}

/* One pread (buf != NULL) or pwrite (out != NULL) of the record at offset
 * 0: 0 and the bytes moved in *moved, or an errno value. */
static int walrec_io(struct vn_spool_session *s, uint8_t *buf,
    const uint8_t *out, size_t len, size_t *moved)
{
	ssize_t n;
	int rc = open_walrec(s);

	*moved = 0;
	if (rc != 0)
		return rc;
	do
		n = buf != NULL ? pread(s->walrec_fd, buf, len, 0) :
		    pwrite(s->walrec_fd, out, len, 0);
	while (n < 0 && errno == EINTR);
	if (n < 0) {
		s->what = buf != NULL ? "read staging/wal-position" :
		    "write staging/wal-position";
		return errno;
	}
	*moved = (size_t)n;
	return 0;
}

int vn_spool_lock_wal(struct vn_spool_session *s)
{
	int rc = open_walrec(s);

	if (rc != 0)
		return rc;
	/* Signals may interrupt the wait: try again (the holder is one
	 * snapshot, which ends). */
	while (flock(s->walrec_fd, LOCK_EX) != 0) {
		if (errno != EINTR) {
			s->what = "lock staging/wal-position";
			return errno;
		}
	}
	return 0;
}

void vn_spool_unlock_wal(struct vn_spool_session *s)
{
	if (s->walrec_fd >= 0)
		flock(s->walrec_fd, LOCK_UN);
}

int vn_spool_read_walrec(struct vn_spool_session *s, uint8_t *buf, size_t cap,
    size_t *len)
{
	return walrec_io(s, buf, NULL, cap, len);
}

int vn_spool_write_walrec(struct vn_spool_session *s, const uint8_t *buf,
    size_t len)
{
	size_t written;
	int rc = walrec_io(s, NULL, buf, len, &written);

	if (rc == 0 && written != len) {
		s->what = "write staging/wal-position";
		rc = EIO;
	}
	return rc;
}

/*
 * Stages a chunk as an anonymous file: open(O_TMPFILE, 0444) in
 * staging/chunks, write it whole, then give it its name with linkat(2), which
 * fails rather than replace an existing name.  The file is read-only from its
 * creation and has no name until complete; a crash leaves nothing behind.
 * Returns 0, EOPNOTSUPP if the file system or the kernel cannot do it (the
 * caller falls back to scratch + rename), or another errno value.
 */
static int stage_tmpfile(struct vn_spool_session *s, const char *name,
    const void *data, size_t n, int *created)
{
	char proc[sizeof("/proc/self/fd/") + 3 * sizeof(int)];
	struct iovec iov = { .iov_base = (void *)data, .iov_len = n };
	int fd, rc;

	fd = openat(s->chunks_fd, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC,
	    VN_FILE_MODE);
	if (fd < 0) {
		if (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)
			return EOPNOTSUPP; /* no O_TMPFILE here */
		s->what = "create staged chunk";
		return errno;
	}
	rc = writev_all(fd, &iov, 1);
	if (rc != 0) {
		s->what = "write staged chunk";
		goto out;
	}
	/* flink(): AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH before Linux 6.10;
	 * the /proc/self/fd link works for any opener.  Remember which one
	 * works. */
	if (s->link_mode != VN_LINK_PROC) {
		if (linkat(fd, "", s->chunks_fd, name, AT_EMPTY_PATH) == 0) {
			s->link_mode = VN_LINK_EMPTY_PATH;
			goto out;
		}
		rc = errno;
		if (rc == EEXIST || s->link_mode == VN_LINK_EMPTY_PATH)
			goto linked;
	}
	snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
	if (linkat(AT_FDCWD, proc, s->chunks_fd, name, AT_SYMLINK_FOLLOW) == 0) {
		s->link_mode = VN_LINK_PROC;
		rc = 0;
		goto out;
	}
	rc = errno;
	if (s->link_mode == VN_LINK_UNKNOWN && rc != EEXIST) {
		/* Neither works (no /proc?): scratch + rename from now on. */
		s->link_mode = VN_LINK_NONE;
		close(fd);
		return EOPNOTSUPP;
	}
linked:
	if (rc == EEXIST) {
		rc = 0; /* another writer staged the same bytes meanwhile */
		*created = 0;
	} else {
		s->what = "link staged chunk";
	}
out:
	close(fd);
	return rc;
}

int vn_spool_stage_chunk(struct vn_spool_session *s, uint64_t major,
    uint64_t minor, const void *data, size_t n, int *created)
{
	char name[VN_CHUNK_NAME_LEN + 1];
	struct stat st;
	int rc;

	*created = 0;
	vn_chunk_name(major, minor, name);
	if (fstatat(s->chunks_fd, name, &st, 0) == 0)
		return 0;
	if (errno != ENOENT) {
		s->what = "stat staged chunk";
		return errno;
	}
	*created = 1;
	if (s->link_mode != VN_LINK_NONE) {
		rc = vn_spool_check_room(s, n);
		if (rc != 0) {
			*created = 0;
			return rc;
		}
		rc = stage_tmpfile(s, name, data, n, created);
		if (rc != EOPNOTSUPP)
			return rc;
		s->link_mode = VN_LINK_NONE;
	}
	return publish_file(s, s->chunks_fd, name, data, n);
}

int vn_spool_read_manifest(struct vn_spool_session *s,
    const struct vn_spool *spool, uint8_t **buf, size_t *len,
    struct vn_file_id *id)
{
	struct stat st;
	uint8_t *data;
	size_t got = 0;
	int fd, rc = 0;

	fd = openat(s->meta_fd, spool->manifest_name, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno;
	if (fstat(fd, &st) != 0) {
		rc = errno;
		close(fd);
		return rc;
	}
	file_id_of(&st, id);
	data = malloc(st.st_size > 0 ? (size_t)st.st_size : 1);
	if (data == NULL) {
		close(fd);
		return ENOMEM;
	}
	while (got < (size_t)st.st_size) {
		ssize_t r = read(fd, data + got, (size_t)st.st_size - got);

		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			rc = r < 0 ? errno : EIO;
			break;
		}
		got += (size_t)r;
	}
	close(fd);
	if (rc != 0) {
		free(data);
		return rc;
	}
	*buf = data;
	*len = got;
	return 0;
}

int vn_spool_publish_manifest(struct vn_spool_session *s,
    const struct vn_spool *spool, const struct iovec *iov, int cnt,
    struct vn_file_id *id)
{
	return publish_file_ex(s, s->meta_fd, spool->manifest_name, iov, cnt, 1,
	    id);
}

int vn_spool_manifest_id(struct vn_spool_session *s,
    const struct vn_spool *spool, struct vn_file_id *id)
{
	struct stat st;

	if (fstatat(s->meta_fd, spool->manifest_name, &st, 0) != 0)
		return errno;
	file_id_of(&st, id);
	return 0;
}

static int clear_staged_chunks(struct vn_spool_session *s)
{
	int fd = openat(s->chunks_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	DIR *d;
	struct dirent *e;

	if (fd < 0 || (d = fdopendir(fd)) == NULL) {
		if (fd >= 0)
			close(fd);
		s->what = "list staging/chunks";
		return errno;
	}
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		unlinkat(s->chunks_fd, e->d_name, 0);
	}
	closedir(d);
	return 0;
}

int vn_spool_publish_ready(struct vn_spool_session *s,
    const struct vn_spool *spool, const struct iovec *manifest, int cnt,
    const uint64_t *words, size_t n_chunks, int *published)
{
	char tmp[2 * VN_SCRATCH_RANDOM_BYTES + 1], uuid[37];
	char name[VN_CHUNK_NAME_LEN + 1];
	int tmp_fd = -1, uuid_fd = -1, cfd = -1, mfd = -1, rc = 0;
	struct vn_spool_session inner;

	*published = 0;
	/* "ready is missing or empty": rmdir succeeds only on an empty one. */
	if (unlinkat(s->db_fd, "ready", AT_REMOVEDIR) != 0 && errno != ENOENT) {
		if (errno == ENOTEMPTY || errno == EEXIST)
			return 0;
		s->what = "check ready";
		return errno;
	}
	random_name(tmp);
	random_uuid(uuid);
	if (mkdirat(s->scratch_fd, tmp, VN_DIR_MODE) != 0 ||
	    (tmp_fd = open_dir_at(s->scratch_fd, tmp, 0)) < 0 ||
	    (uuid_fd = open_dir_at(tmp_fd, uuid, 1)) < 0 ||
	    (cfd = open_dir_at(uuid_fd, "chunks", 1)) < 0 ||
	    (mfd = open_dir_at(uuid_fd, "meta", 1)) < 0) {
		rc = errno;
		s->what = "create the ready snapshot in scratch";
		goto out;
	}
	for (size_t i = 0; i < n_chunks; i++) {
		vn_chunk_name(words[2 * i], words[2 * i + 1], name);
		if (linkat(s->chunks_fd, name, cfd, name, 0) != 0 &&
		    errno != ENOENT && errno != EEXIST) {
			rc = errno;
			s->what = "link a chunk into the ready snapshot";
			goto out;
		}
	}
	inner = *s;
	rc = publish_file_ex(&inner, mfd, spool->manifest_name, manifest, cnt, 0,
	    NULL);
	if (rc != 0) {
		s->what = inner.what;
		goto out;
	}
	if (renameat(s->scratch_fd, tmp, s->db_fd, "ready") != 0) {
		if (errno != ENOTEMPTY && errno != EEXIST) {
			rc = errno;
			s->what = "rename the ready snapshot into place";
		}
		goto out;
	}
	*published = 1;
	tmp[0] = 0;

out:
	if (mfd >= 0)
		close(mfd);
	if (cfd >= 0)
		close(cfd);
	if (uuid_fd >= 0)
		close(uuid_fd);
	if (tmp_fd >= 0)
		close(tmp_fd);
	if (tmp[0] != 0)
		remove_tree_at(s->scratch_fd, tmp, 0);
	if (*published)
		rc = clear_staged_chunks(s);
	return rc;
}

static int cmp_fp(const void *a, const void *b)
{
	const uint64_t *x = a, *y = b;

	if (x[0] != y[0])
		return x[0] < y[0] ? -1 : 1;
	if (x[1] != y[1])
		return x[1] < y[1] ? -1 : 1;
	return 0;
}

static void gc_scratch(struct vn_spool_session *s)
{
	int fd = openat(s->scratch_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	time_t horizon = time(NULL) - VN_SCRATCH_STALE_SECONDS;
	DIR *d;
	struct dirent *e;

	if (fd < 0 || (d = fdopendir(fd)) == NULL) {
		if (fd >= 0)
			close(fd);
		return;
	}
	while ((e = readdir(d)) != NULL) {
		struct stat st;

		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		if (fstatat(s->scratch_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
		    st.st_mtime < horizon)
			remove_tree_at(s->scratch_fd, e->d_name, 0);
	}
	closedir(d);
}

int vn_spool_gc(struct vn_spool_session *s, const uint64_t *words,
    size_t n_chunks, size_t *removed)
{
	uint64_t *live = malloc(16 * (n_chunks ? n_chunks : 1));
	int fd;
	DIR *d;
	struct dirent *e;

	*removed = 0;
	if (live == NULL) {
		s->what = "allocate the GC set";
		return ENOMEM;
	}
	memcpy(live, words, 16 * n_chunks);
	qsort(live, n_chunks, 16, cmp_fp);
	fd = openat(s->chunks_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0 || (d = fdopendir(fd)) == NULL) {
		if (fd >= 0)
			close(fd);
		free(live);
		s->what = "list staging/chunks";
		return errno;
	}
	while ((e = readdir(d)) != NULL) {
		uint64_t key[2];

		if (vn_parse_chunk_name(e->d_name, &key[0], &key[1]) != 0)
			continue; /* not ours to judge: the copier dead-letters it */
		if (bsearch(key, live, n_chunks, 16, cmp_fp) != NULL)
			continue;
		if (unlinkat(s->chunks_fd, e->d_name, 0) == 0)
			(*removed)++;
	}
	closedir(d);
	free(live);
	gc_scratch(s);
	return 0;
}
