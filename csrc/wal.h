/*
 * Reading a database in WAL mode as SQLite sees it (docs/WRITER.md, "WAL
 * databases"): the committed state is the database file with, for each page,
 * its latest frame among the WAL's committed frames 1..mx.
 *
 * - A position (struct vn_wal_pos) names a committed state: the WAL's
 *   generation (the salts of its header, which change at every WAL reset),
 *   the last committed frame, the database's size in pages after it, and the
 *   frames' checksum chain there.  Positions come from the wal-index header
 *   in shared memory (vn_walindex_read), or from the WAL file itself
 *   (vn_wal_scan), the way SQLite's recovery reads it.
 * - An index (struct vn_wal) of one generation's frames: the page of each
 *   frame, the checksum chain after each verified frame, and the latest frame
 *   of each page.  It is extended as the WAL grows and dropped when the
 *   generation changes.  Frames are verified (salts and checksum chain, as
 *   SQLite's recovery does) from an anchor: the WAL header, or a position
 *   recorded earlier.
 * - vn_wal_read() reads bytes of the committed state through the index.
 *
 * The WAL file is read through a descriptor of our own ("<db>-wal"): SQLite
 * takes no lock on it, so opening and closing it is harmless, and it cannot
 * be deleted while the connection that calls us is open in WAL mode.
 *
 * No spool, no snapshot: tracker.c builds snapshots from what this reads.
 */
#ifndef VN_WAL_H
#define VN_WAL_H

#include <stddef.h>
#include <stdint.h>

#include <sqlite3.h>

/* SQLite's WAL format (src/wal.c): a 32-byte header, then frames of a
 * 24-byte header and one page. */
#define VN_WAL_HEADER_BYTES 32
#define VN_WAL_FRAME_HEADER_BYTES 24
#define VN_WAL_MAGIC 0x377f0682u   /* | 1: big-endian checksums */
#define VN_WAL_VERSION 3007000u
/* The wal-index's shared-memory regions are this large; region 0 starts
 * with two copies of the 48-byte header. */
#define VN_WALINDEX_REGION_BYTES 32768
#define VN_WALINDEX_HEADER_BYTES 48
#define VN_WALINDEX_VERSION 3007000u
/* SQLite's page sizes: powers of two from 512 to 65536. */
#define VN_WAL_MIN_PAGE 512
#define VN_WAL_MAX_PAGE 65536

/* A committed state of a WAL database. */
struct vn_wal_pos {
	uint8_t salt[8];    /* the generation; all zero: no WAL header yet
			     * (the state is the database file alone) */
	uint32_t mx;        /* last committed frame; 0: none */
	uint32_t npage;     /* pages after that commit; 0: the file's size */
	uint32_t pgsz;      /* page size; 0: unknown (no frames) */
	uint32_t cksum[2];  /* checksum chain after frame mx */
};

/* Same generation, same frame, same checksum chain. */
int vn_wal_pos_equal(const struct vn_wal_pos *a, const struct vn_wal_pos *b);

/* Whether a generation is "none" (no WAL header yet). */
int vn_wal_salt_none(const uint8_t salt[8]);

/*
 * The wal-index header at the start of shared-memory region 0, as SQLite
 * publishes it: 0 and *pos, or -1 if it is not a valid header (never
 * initialised, being recovered, of another version).  Without the WAL
 * write lock, expect -1 while a writer updates it (its two copies differ).
 */
int vn_walindex_read(const volatile void *region0, struct vn_wal_pos *pos);

/* Index of one WAL generation (see the top of this file). */
struct vn_wal {
	char *path;            /* "<db>-wal" */
	int fd;                /* -1: not open */
	int have_gen;          /* the fields below describe a generation */
	uint8_t salt[8];
	uint32_t pgsz;
	int big_endian;        /* checksums in big-endian words */
	uint32_t hdr_cksum[2]; /* the chain's start: the header's checksum */
	uint32_t n;            /* frames 1..n are indexed, all committed */
	uint32_t npage;        /* pages after the commit at frame n */
	uint32_t *pgno;        /* pgno[f - 1]: the page of frame f */
	uint32_t *ck;          /* ck[2 (f - 1)], ck[2 (f - 1) + 1]: the chain
				* after frame f, known for f > anchor */
	uint32_t anchor;       /* the chain is known from this frame on */
	uint32_t anchor_ck[2]; /* its value after frame `anchor` */
	int anchor_known;      /* anchor_ck holds it (else: not anchored) */
	size_t cap;            /* frames pgno and ck have room for */
	uint32_t *map;         /* open addressing: 2 words per slot, page and
				* latest frame; page 0 marks an empty slot */
	size_t map_slots;      /* a power of two */
	size_t map_used;
	uint8_t *io;           /* VN_WAL_IO_BYTES read buffer */
	const char *what;      /* the operation that failed, for the log */
};

/* Frames are read in blocks of at most this many bytes: one pread brings
 * the ~60 frames of 4 KiB pages an average transaction of a busy database
 * writes, and bounds the buffer a connection keeps. */
#define VN_WAL_IO_BYTES (256 * 1024)

/* db_name: SQLite's name of the database; the WAL is db_name + "-wal".
 * 0 or ENOMEM. */
int vn_wal_init(struct vn_wal *w, const char *db_name);
void vn_wal_fini(struct vn_wal *w);

/* Forgets the indexed generation (the next call starts from the file). */
void vn_wal_forget(struct vn_wal *w);

/*
 * Brings the index to the generation whose salts are `salt`: keeps it if it
 * is that one already; else reads the WAL file's header, which must be
 * valid and carry those salts (then the index restarts, empty).  Returns 0;
 * ENOENT when the file has no valid header of that generation (a WAL reset
 * whose first frame is not written yet: no frame can be read); another
 * errno value on I/O errors (w->what says which).
 */
int vn_wal_use_generation(struct vn_wal *w, const uint8_t salt[8]);

/*
 * Reads the WAL file's header into the index's generation (dropping the
 * index if it changed): 0, or ENOENT when there is no valid header (no file,
 * shorter than a header, another magic or version, a bad checksum): the
 * state is then the database file alone.  Other errno values: I/O errors.
 */
int vn_wal_read_header(struct vn_wal *w);

/* Reads the page numbers of frames n+1..upto from their headers, without
 * verifying them (they were verified when committed): 0 or an errno value
 * (EPROTO if a frame is not of this generation or is past the file's end). */
int vn_wal_index_headers(struct vn_wal *w, uint32_t upto);

/* Trusts `cksum` as the chain after frame n (the index must end there):
 * later frames are verified from it. */
void vn_wal_anchor(struct vn_wal *w, const uint32_t cksum[2]);

/* The chain after frame f: 0, or -1 if the index does not know it. */
int vn_wal_chain_at(const struct vn_wal *w, uint32_t f, uint32_t cksum[2]);

/*
 * Verifies and indexes the frames after n, the way SQLite's recovery reads
 * them (salts and checksum chain, from the chain after frame n, which must be
 * known).  Strict: every frame up to `upto` must be valid (else EPROTO), and
 * the index ends at `upto`.  Not strict: frames are read until the first
 * invalid one, the file's end or frame `upto` (0: no bound), and the index
 * ends at the last commit frame among them (later frames belong to no
 * commit).  *end (if not NULL) receives the position at the index's end.
 * 0 or an errno value.
 */
int vn_wal_verify(struct vn_wal *w, uint32_t upto, int strict,
    struct vn_wal_pos *end);

/* The latest frame of page `pgno` among frames 1..n; 0: none. */
uint32_t vn_wal_frame_of(const struct vn_wal *w, uint32_t pgno);

/*
 * Reads [off, off + len) of the committed state at the index's end: the
 * database file's bytes (read through `db`; past its end, zeros) with every
 * page that has a frame replaced by its latest frame's bytes.  0, or -1 with
 * *sqlite_rc set (the database's read failed) or w->what set and errno
 * value in *err (the WAL's).
 */
int vn_wal_read(struct vn_wal *w, sqlite3_file *db, uint8_t *buf, size_t len,
    uint64_t off, int *sqlite_rc, int *err);

#endif /* VN_WAL_H */
