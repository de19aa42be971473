/*
 * Reading a database in WAL mode as SQLite sees it: see wal.h.  The formats
 * (WAL header, frame header, checksum chain, wal-index header) are those of
 * SQLite's src/wal.c, unchanged since 3.7.0 (both carry version 3007000).
 */
#define _GNU_SOURCE
#include "wal.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static_assert(VN_WAL_IO_BYTES >= VN_WAL_MAX_PAGE + VN_WAL_FRAME_HEADER_BYTES,
    "a read block holds at least one frame of the largest page");
static_assert(VN_WALINDEX_HEADER_BYTES * 2 <= VN_WALINDEX_REGION_BYTES,
    "both copies of the wal-index header lie in region 0");

/* SQLite's WalIndexHdr, in the host's byte order. */
struct walindex_hdr {
	uint32_t version;
	uint32_t unused;
	uint32_t change;
	uint8_t is_init;
	uint8_t big_endian;
	uint16_t page_size;  /* 1 stands for 65536 */
	uint32_t mx_frame;
	uint32_t n_page;
	uint32_t frame_cksum[2];
	uint8_t salt[8];
	uint32_t cksum[2];
};

static_assert(sizeof(struct walindex_hdr) == VN_WALINDEX_HEADER_BYTES,
    "the wal-index header is 48 bytes");

/* A page number's slot in the map: Fibonacci hashing. */
#define MAP_HASH_MULTIPLIER 0x9E3779B1u
/* The map starts with this many slots and doubles at half full. */
#define MAP_MIN_SLOTS 256

static uint32_t get_be32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 |
	    (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static uint32_t get_le32(const uint8_t *p)
{
	return (uint32_t)p[3] << 24 | (uint32_t)p[2] << 16 |
	    (uint32_t)p[1] << 8 | (uint32_t)p[0];
}

/* SQLite's walChecksumBytes: the chain over n bytes (a multiple of 8),
 * read as 32-bit words in the given byte order. */
static void chain(int big_endian, const uint8_t *a, size_t n, uint32_t ck[2])
{
	uint32_t s1 = ck[0], s2 = ck[1];

	for (size_t i = 0; i + 8 <= n; i += 8) {
		uint32_t x0 = big_endian ? get_be32(a + i) : get_le32(a + i);
		uint32_t x1 = big_endian ? get_be32(a + i + 4) : get_le32(a + i + 4);

		s1 += x0 + s2;
		s2 += x1 + s1;
	}
	ck[0] = s1;
	ck[1] = s2;
}

int vn_wal_salt_none(const uint8_t salt[8])
{
	static const uint8_t zero[8];

	return memcmp(salt, zero, sizeof(zero)) == 0;
}

int vn_wal_pos_equal(const struct vn_wal_pos *a, const struct vn_wal_pos *b)
{
	/* The chain is the WAL header's when no frame is committed: the
	 * generation says it all. */
	return memcmp(a->salt, b->salt, sizeof(a->salt)) == 0 &&
	    a->mx == b->mx && (a->mx == 0 ||
	    (a->cksum[0] == b->cksum[0] && a->cksum[1] == b->cksum[1]));
}

int vn_walindex_read(const volatile void *region0, struct vn_wal_pos *pos)
{
	struct walindex_hdr h[2];
	uint32_t ck[2] = { 0, 0 };
	uint32_t words[10];

	if (region0 == NULL)
		return -1;
	/* Copy 0, then copy 1: a writer writes them in the other order (SQLite's
	 * walIndexTryHdr), so equal copies are not a torn update even without
	 * the write lock. */
	memcpy(&h[0], (const void *)region0, sizeof(h[0]));
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	memcpy(&h[1], (const void *)((const volatile uint8_t *)region0 +
	    sizeof(h[0])), sizeof(h[1]));
	if (memcmp(&h[0], &h[1], sizeof(h[0])) != 0 || !h[0].is_init ||
	    h[0].version != VN_WALINDEX_VERSION)
		return -1;
	/* Its own checksum, over its first 40 bytes in native words. */
	memcpy(words, &h[0], sizeof(words));
	for (size_t i = 0; i < 10; i += 2) {
		ck[0] += words[i] + ck[1];
		ck[1] += words[i + 1] + ck[0];
	}
	if (ck[0] != h[0].cksum[0] || ck[1] != h[0].cksum[1])
		return -1;
	memset(pos, 0, sizeof(*pos));
	memcpy(pos->salt, h[0].salt, sizeof(pos->salt));
	pos->mx = h[0].mx_frame;
	pos->npage = h[0].n_page;
	pos->pgsz = h[0].page_size == 1 ? 65536 : h[0].page_size;
	pos->cksum[0] = h[0].frame_cksum[0];
	pos->cksum[1] = h[0].frame_cksum[1];
	if (pos->npage != 0 && (pos->pgsz < VN_WAL_MIN_PAGE ||
	    (pos->pgsz & (pos->pgsz - 1)) != 0))
		return -1;
	return 0;
}

/* ---- the index ------------------------------------------------------------ */

int vn_wal_init(struct vn_wal *w, const char *db_name)
{
	size_t n = strlen(db_name);

	memset(w, 0, sizeof(*w));
	w->fd = -1;
	w->path = malloc(n + sizeof("-wal"));
	if (w->path == NULL)
		return ENOMEM;
	memcpy(w->path, db_name, n);
	memcpy(w->path + n, "-wal", sizeof("-wal"));
	return 0;
}

void vn_wal_fini(struct vn_wal *w)
{
	if (w->fd >= 0)
		close(w->fd);
	free(w->path);
	free(w->pgno);
	free(w->ck);
	free(w->map);
	free(w->io);
	memset(w, 0, sizeof(*w));
	w->fd = -1;
}

static void drop_frames(struct vn_wal *w)
{
	w->n = 0;
	w->npage = 0;
	w->anchor = 0;
	w->anchor_ck[0] = w->hdr_cksum[0];
	w->anchor_ck[1] = w->hdr_cksum[1];
	w->anchor_known = 1;
	if (w->map != NULL)
		memset(w->map, 0, 2 * w->map_slots * sizeof(uint32_t));
	w->map_used = 0;
}

void vn_wal_forget(struct vn_wal *w)
{
	drop_frames(w);
	w->have_gen = 0;
}

static size_t map_slot(const uint32_t *map, size_t slots, uint32_t pgno)
{
	size_t i = (size_t)(pgno * MAP_HASH_MULTIPLIER) & (slots - 1);

	while (map[2 * i] != 0 && map[2 * i] != pgno)
		i = (i + 1) & (slots - 1);
	return i;
}

static int map_grow(struct vn_wal *w)
{
	size_t slots = w->map_slots ? 2 * w->map_slots : MAP_MIN_SLOTS;
	uint32_t *map = calloc(2 * slots, sizeof(uint32_t));

	if (map == NULL)
		return ENOMEM;
	for (size_t i = 0; i < w->map_slots; i++) {
		uint32_t pgno = w->map[2 * i];

		if (pgno != 0) {
			size_t j = map_slot(map, slots, pgno);

			map[2 * j] = pgno;
			map[2 * j + 1] = w->map[2 * i + 1];
		}
	}
	free(w->map);
	w->map = map;
	w->map_slots = slots;
	return 0;
}

static int map_put(struct vn_wal *w, uint32_t pgno, uint32_t frame)
{
	size_t i;

	if (2 * (w->map_used + 1) > w->map_slots && map_grow(w) != 0)
		return ENOMEM;
	i = map_slot(w->map, w->map_slots, pgno);
	if (w->map[2 * i] == 0)
		w->map_used++;
	w->map[2 * i] = pgno;
	w->map[2 * i + 1] = frame;
	return 0;
}

uint32_t vn_wal_frame_of(const struct vn_wal *w, uint32_t pgno)
{
	size_t i;

	if (!w->have_gen || w->n == 0 || w->map_slots == 0 || pgno == 0)
		return 0;
	i = map_slot(w->map, w->map_slots, pgno);
	return w->map[2 * i] == pgno ? w->map[2 * i + 1] : 0;
}

static int reserve_frames(struct vn_wal *w, uint32_t upto)
{
	size_t want = w->cap ? w->cap : 1024;
	uint32_t *pgno, *ck;

	if (upto <= w->cap)
		return 0;
	while (want < upto)
		want *= 2;
	pgno = realloc(w->pgno, want * sizeof(uint32_t));
	if (pgno == NULL)
		return ENOMEM;
	w->pgno = pgno;
	ck = realloc(w->ck, 2 * want * sizeof(uint32_t));
	if (ck == NULL)
		return ENOMEM;
	w->ck = ck;
	w->cap = want;
	return 0;
}

/* Makes frames n+1..upto part of the index (their pgno already set). */
static int commit_frames(struct vn_wal *w, uint32_t upto)
{
	for (uint32_t f = w->n + 1; f <= upto; f++)
		if (map_put(w, w->pgno[f - 1], f) != 0)
			return ENOMEM;
	w->n = upto;
	return 0;
}

/* ---- the file -------------------------------------------------------------- */

static int fail(struct vn_wal *w, const char *what, int err)
{
	w->what = what;
	return err;
}

static int pread_all(int fd, uint8_t *buf, size_t len, uint64_t off)
{
	size_t got = 0;

	while (got < len) {
		ssize_t r = pread(fd, buf + got, len - got, (off_t)(off + got));

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return errno;
		if (r == 0)
			return EPROTO; /* past the end */
		got += (size_t)r;
	}
	return 0;
}

/* Opens the WAL file, or reopens it when the one we hold was deleted (a new
 * WAL may have the same name): 0, ENOENT or another errno value. */
static int open_file(struct vn_wal *w)
{
	struct stat st;

	if (w->fd >= 0 && fstat(w->fd, &st) == 0 && st.st_nlink > 0)
		return 0;
	if (w->fd >= 0)
		close(w->fd);
	w->fd = open(w->path, O_RDONLY | O_CLOEXEC);
	if (w->fd < 0)
		return fail(w, "open the WAL", errno);
	return 0;
}

static uint64_t frame_offset(const struct vn_wal *w, uint32_t f)
{
	return VN_WAL_HEADER_BYTES +
	    (uint64_t)(f - 1) * (w->pgsz + VN_WAL_FRAME_HEADER_BYTES);
}

int vn_wal_read_header(struct vn_wal *w)
{
	uint8_t h[VN_WAL_HEADER_BYTES];
	uint32_t magic, pgsz, ck[2] = { 0, 0 };
	int big, rc;

	rc = open_file(w);
	if (rc == 0)
		rc = pread_all(w->fd, h, sizeof(h), 0);
	if (rc == EPROTO || rc == ENOENT) {
		vn_wal_forget(w);
		return ENOENT;
	}
	if (rc != 0)
		return fail(w, "read the WAL header", rc);
	magic = get_be32(h);
	pgsz = get_be32(h + 8);
	big = (int)(magic & 1);
	chain(big, h, 24, ck);
	if ((magic & ~1u) != VN_WAL_MAGIC || get_be32(h + 4) != VN_WAL_VERSION ||
	    pgsz < VN_WAL_MIN_PAGE || pgsz > VN_WAL_MAX_PAGE ||
	    (pgsz & (pgsz - 1)) != 0 || ck[0] != get_be32(h + 24) ||
	    ck[1] != get_be32(h + 28)) {
		vn_wal_forget(w);
		return ENOENT;
	}
	if (w->have_gen && memcmp(w->salt, h + 16, 8) == 0 && w->pgsz == pgsz &&
	    w->big_endian == big && w->hdr_cksum[0] == ck[0] &&
	    w->hdr_cksum[1] == ck[1])
		return 0; /* the generation we index */
	w->have_gen = 1;
	memcpy(w->salt, h + 16, 8);
	w->pgsz = pgsz;
	w->big_endian = big;
	w->hdr_cksum[0] = ck[0];
	w->hdr_cksum[1] = ck[1];
	drop_frames(w);
	if (w->io == NULL && (w->io = malloc(VN_WAL_IO_BYTES)) == NULL)
		return fail(w, "allocate the WAL buffer", ENOMEM);
	return 0;
}

int vn_wal_use_generation(struct vn_wal *w, const uint8_t salt[8])
{
	int rc;

	if (w->have_gen && memcmp(w->salt, salt, 8) == 0)
		return 0;
	rc = vn_wal_read_header(w);
	if (rc != 0)
		return rc;
	if (memcmp(w->salt, salt, 8) != 0) {
		vn_wal_forget(w);
		return ENOENT;
	}
	return 0;
}

void vn_wal_anchor(struct vn_wal *w, const uint32_t cksum[2])
{
	w->anchor = w->n;
	w->anchor_ck[0] = cksum[0];
	w->anchor_ck[1] = cksum[1];
	w->anchor_known = 1;
}

int vn_wal_chain_at(const struct vn_wal *w, uint32_t f, uint32_t cksum[2])
{
	if (f == w->anchor) {
		if (!w->anchor_known)
			return -1;
		cksum[0] = w->anchor_ck[0];
		cksum[1] = w->anchor_ck[1];
		return 0;
	}
	if (f < w->anchor || f > w->n)
		return -1;
	cksum[0] = w->ck[2 * (f - 1)];
	cksum[1] = w->ck[2 * (f - 1) + 1];
	return 0;
}

/* Reads frames from..from+*count-1 (whole frames, at most one block) into
 * w->io; *count shrinks to what the file holds (0: none). */
static int read_frames(struct vn_wal *w, uint32_t from, uint32_t *count)
{
	size_t frame = (size_t)w->pgsz + VN_WAL_FRAME_HEADER_BYTES;
	uint64_t off = frame_offset(w, from);
	struct stat st;
	uint64_t in_file;
	uint32_t n = *count;

	if (n > VN_WAL_IO_BYTES / frame)
		n = (uint32_t)(VN_WAL_IO_BYTES / frame);
	if (fstat(w->fd, &st) != 0)
		return fail(w, "stat the WAL", errno);
	in_file = (uint64_t)st.st_size > off ?
	    ((uint64_t)st.st_size - off) / frame : 0;
	if (n > in_file)
		n = (uint32_t)in_file;
	*count = n;
	if (n == 0)
		return 0;
	return pread_all(w->fd, w->io, n * frame, off) == 0 ? 0 :
	    fail(w, "read the WAL", EIO);
}

int vn_wal_index_headers(struct vn_wal *w, uint32_t upto)
{
	size_t frame = (size_t)w->pgsz + VN_WAL_FRAME_HEADER_BYTES;
	int rc;

	if (!w->have_gen || upto < w->n)
		return fail(w, "index the WAL", EPROTO);
	rc = reserve_frames(w, upto);
	if (rc != 0)
		return fail(w, "allocate the WAL index", rc);
	while (w->n < upto) {
		uint32_t count = upto - w->n;

		rc = read_frames(w, w->n + 1, &count);
		if (rc != 0)
			return rc;
		if (count == 0)
			return fail(w, "find committed frames in the WAL", EPROTO);
		for (uint32_t k = 0; k < count; k++) {
			const uint8_t *fh = w->io + k * frame;

			if (get_be32(fh) == 0 || memcmp(fh + 8, w->salt, 8) != 0)
				return fail(w, "find committed frames in the WAL",
				    EPROTO);
			w->pgno[w->n + k] = get_be32(fh);
			w->npage = get_be32(fh + 4);
		}
		rc = commit_frames(w, w->n + count);
		if (rc != 0)
			return fail(w, "allocate the WAL index", rc);
	}
	/* Frame `upto` ends a commit (the caller's position says so). */
	if (w->npage == 0)
		return fail(w, "find the commit frame in the WAL", EPROTO);
	/* The chain after these frames is unknown until anchored. */
	w->anchor = w->n;
	w->anchor_known = 0;
	return 0;
}

/* Whether frame f (its bytes at fh) is valid after chain value ck (which
 * becomes the chain after it); *commit: its commit size in pages, 0 if it
 * is not a commit frame. */
static int frame_valid(const struct vn_wal *w, const uint8_t *fh,
    uint32_t ck[2], uint32_t *commit)
{
	if (get_be32(fh) == 0 || memcmp(fh + 8, w->salt, 8) != 0)
		return 0;
	chain(w->big_endian, fh, 8, ck);
	chain(w->big_endian, fh + VN_WAL_FRAME_HEADER_BYTES, w->pgsz, ck);
	if (ck[0] != get_be32(fh + 16) || ck[1] != get_be32(fh + 20))
		return 0;
	*commit = get_be32(fh + 4);
	return 1;
}

/* One block of vn_wal_verify from frame `from` (= pending end + 1): *done
 * when the walk is over. */
static int verify_block(struct vn_wal *w, uint32_t from, uint32_t upto,
    int strict, uint32_t ck[2], uint32_t *pending, int *done)
{
	size_t frame = (size_t)w->pgsz + VN_WAL_FRAME_HEADER_BYTES;
	uint32_t count = upto > 0 ? upto - from + 1 : UINT32_MAX - from;
	uint32_t commit;
	int rc;

	rc = read_frames(w, from, &count);
	if (rc != 0)
		return rc;
	if (count == 0) {
		*done = 1;
		return strict ? fail(w, "find committed frames in the WAL",
		    EPROTO) : 0;
	}
	for (uint32_t k = 0; k < count; k++) {
		const uint8_t *fh = w->io + k * frame;
		uint32_t f = from + k;

		if (!frame_valid(w, fh, ck, &commit)) {
			*done = 1;
			return strict ? fail(w, "verify the WAL's frames",
			    EPROTO) : 0;
		}
		w->pgno[f - 1] = get_be32(fh);
		w->ck[2 * (f - 1)] = ck[0];
		w->ck[2 * (f - 1) + 1] = ck[1];
		*pending = f;
		if (commit != 0) {
			if (commit_frames(w, f) != 0)
				return fail(w, "allocate the WAL index", ENOMEM);
			w->npage = commit;
		}
		if (f == upto) {
			*done = 1;
			return commit != 0 || !strict ? 0 : fail(w,
			    "find the commit frame in the WAL", EPROTO);
		}
	}
	return 0;
}

int vn_wal_verify(struct vn_wal *w, uint32_t upto, int strict,
    struct vn_wal_pos *end)
{
	uint32_t ck[2], pending;
	int done = 0, rc;

	if (!w->have_gen || (strict && upto < w->n) ||
	    vn_wal_chain_at(w, w->n, ck) != 0)
		return fail(w, "verify the WAL", EPROTO);
	pending = w->n;
	while (!done && !(upto > 0 && pending >= upto)) {
		rc = reserve_frames(w, pending + (uint32_t)(VN_WAL_IO_BYTES /
		    VN_WAL_MIN_PAGE) + 1);
		if (rc != 0)
			return fail(w, "allocate the WAL index", rc);
		rc = verify_block(w, pending + 1, upto, strict, ck, &pending,
		    &done);
		if (rc != 0)
			return rc;
	}
	if (end != NULL) {
		memset(end, 0, sizeof(*end));
		memcpy(end->salt, w->salt, sizeof(end->salt));
		end->mx = w->n;
		end->pgsz = w->pgsz;
		if (w->n > 0) {
			end->npage = w->npage;
			vn_wal_chain_at(w, w->n, end->cksum);
		}
	}
	return 0;
}

/* Copies the bytes of frame f's page that fall in [off, off + len) into
 * buf (which holds that range). */
static int overlay_page(struct vn_wal *w, uint32_t pgno, uint32_t f,
    uint8_t *buf, size_t len, uint64_t off)
{
	uint64_t page_off = (uint64_t)(pgno - 1) * w->pgsz;
	uint64_t from = page_off > off ? page_off : off;
	uint64_t to = page_off + w->pgsz < off + len ? page_off + w->pgsz :
	    off + len;
	uint64_t at = frame_offset(w, f) + VN_WAL_FRAME_HEADER_BYTES;
	int rc;

	if (from == page_off && to == page_off + w->pgsz) {
		rc = pread_all(w->fd, buf + (from - off), w->pgsz, at);
	} else {
		rc = pread_all(w->fd, w->io, w->pgsz, at);
		if (rc == 0)
			memcpy(buf + (from - off), w->io + (from - page_off),
			    (size_t)(to - from));
	}
	return rc == 0 ? 0 : fail(w, "read a page from the WAL", rc);
}

int vn_wal_read(struct vn_wal *w, sqlite3_file *db, uint8_t *buf, size_t len,
    uint64_t off, int *sqlite_rc, int *err)
{
	uint64_t first, last;
	int rc;

	*sqlite_rc = SQLITE_OK;
	*err = 0;
	if (len == 0)
		return 0;
	/* Past the file's end SQLite reads zeros; the unix VFS fills them. */
	rc = db->pMethods->xRead(db, buf, (int)len, (sqlite3_int64)off);
	if (rc != SQLITE_OK && rc != SQLITE_IOERR_SHORT_READ) {
		*sqlite_rc = rc;
		return -1;
	}
	if (!w->have_gen || w->n == 0)
		return 0;
	first = off / w->pgsz + 1;
	last = (off + len - 1) / w->pgsz + 1;
	for (uint64_t p = first; p <= last && p <= UINT32_MAX; p++) {
		uint32_t f = vn_wal_frame_of(w, (uint32_t)p);

		if (f != 0 && (*err = overlay_page(w, (uint32_t)p, f, buf, len,
		    off)) != 0)
			return -1;
	}
	return 0;
}
