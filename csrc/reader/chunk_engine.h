/*
 * The reader's chunk path in C: requests of chunks in flight many at once,
 * each request's bytes split into chunk blobs, each blob decoded (zstd),
 * verified against its own fingerprint (UMASH) and written into its place
 * in the disk cache, so that none of this work waits for, or holds,
 * Python's GIL.
 *
 * A request reads one object, or bytes [start, end) of one (a run of
 * adjacent blobs of a pack: docs/FORMAT.md, "Packed layout"), in one of
 * two ways: an HTTP GET (with a Range header for a range) on the engine's
 * own thread (libcurl's multi interface), or a read of a local file (a
 * directory store) on one of the engine's worker threads.  Its parts say
 * where each chunk's blob lies in the bytes read, the chunk's fingerprint,
 * where the verified bytes go in the disk cache, and whether the caller
 * wants them back in memory; each part gets an outcome of its own.
 *
 * The caller owns a fixed pool of requests (`vn_ce_request`, by index): it
 * fills a free one, submits its index, and gets the index back from
 * `vn_ce_take` once the request is over, its outcome filled in.  The engine
 * writes 8 bytes to the caller's eventfd (`notify_fd`) when it hands back a
 * request while none waited to be taken, so the caller wakes once per batch.
 *
 * Between submit and take the engine owns the request; before submit and
 * after take the caller does.  The engine's lock orders the two.
 *
 * cffi reads the declarations below as they are
 * (verneuil_fuse/reader/_chunk_engine_build.py): plain C, and #defines of
 * integers only.
 */
#ifndef VN_CHUNK_ENGINE_H
#define VN_CHUNK_ENGINE_H

#include <stddef.h>
#include <stdint.h>

/* A chunk's largest decoded size: the format's 64 KiB. */
#define VN_CE_CHUNK_SIZE 65536
/*
 * A chunk object's largest size, the format's MAX_CHUNK_BLOB_BYTES (64 KiB
 * and 1 KiB of zstd's slack): the bound of a whole-object request.
 */
#define VN_CE_BLOB_MAX 66560
/*
 * Where a pack's last blob ends at most, the format's MAX_PACK_BYTES
 * (64 MiB): a range request never ends past it, so a server that ignores
 * the Range header sends the engine at most this many bytes.
 */
#define VN_CE_PACK_MAX 67108864
/*
 * Parts of one request at most: 64 MiB of chunks kept, far past a run's
 * 1 MiB of blobs (format.MAX_RUN_BYTES, 16 to a few tens of chunks).
 */
#define VN_CE_PARTS_MAX 1024
/* Worker threads (file reads) at most. */
#define VN_CE_WORKERS_MAX 64
/* The longest URL or path of a request, its terminating NUL included. */
#define VN_CE_URL_MAX 2048
/* The longest error message kept (libcurl's CURL_ERROR_SIZE). */
#define VN_CE_ERROR_MAX 256

/* How a request reads its bytes (`vn_ce_request.kind`). */
enum vn_ce_kind {
	VN_CE_GET = 0,  /* an HTTP GET of `url` */
	VN_CE_READ = 1, /* a read of the regular file at path `url` (no symlink) */
};

/* How a request, or one of its parts, ended (`result`). */
enum vn_ce_result {
	VN_CE_CHUNK = 0,      /* verified (a request: every part was) */
	VN_CE_HTTP = 1,       /* a non-2xx answer: `status`, its body in `body` */
	VN_CE_TRANSPORT = 2,  /* no answer: `curl_code`, `error` */
	VN_CE_TOO_LARGE = 3,  /* more bytes than asked, or a chunk object over its bound: `declared` */
	VN_CE_MISMATCH = 4,   /* bytes that are not the chunk named (a request: some part's) */
	VN_CE_SHUTDOWN = 5,   /* the engine closed before it ended */
	VN_CE_FILE = 6,       /* a file that cannot be read: `sys_errno`, `error` */
	VN_CE_RANGE = 7,      /* an answer for other bytes than asked (its Content-Range) */
	VN_CE_SHORT = 8,      /* the object ends before the part's blob does (a pack cut or replaced) */
};

/* One chunk of a request. */
struct vn_ce_part {
	/* Set by the caller before `vn_ce_submit`. */
	uint64_t fp[2];        /* the chunk's fingerprint (major, minor) */
	uint32_t lo, hi;       /* its blob: bytes [lo, hi) of those read; a whole object: 0, 0 */
	int data_fd;           /* -1: not written to the disk cache */
	int idx_fd;            /* the segment's index, appended one record */
	int64_t offset;        /* where the bytes go in data_fd */
	int32_t keep;          /* nonzero: the verified bytes are handed back in `dest` */
	unsigned char *dest;   /* where kept bytes go: VN_CE_CHUNK_SIZE bytes of the caller's */
	/* Set by the engine before it hands the request back. */
	int32_t result;        /* enum vn_ce_result */
	int32_t write_errno;   /* 0: written (or not asked); else why not */
	uint32_t length;       /* the chunk's bytes (in `dest` if kept) */
};

struct vn_ce_request {
	/* Set by the caller before `vn_ce_submit`. */
	int32_t kind;          /* enum vn_ce_kind */
	char url[VN_CE_URL_MAX]; /* the URL, or the file's path */
	int64_t start;         /* bytes [start, end) of the object ... */
	int64_t end;           /* ... or -1: all of it (one part, at most VN_CE_BLOB_MAX bytes) */
	int32_t nparts;        /* parts[0 .. nparts), 1 to the engine's `max_parts` */
	int32_t timeout_ms;    /* the whole request's bound (an HTTP GET's only) */
	struct vn_ce_part *parts; /* the engine's, `max_parts` of them: not to be replaced */
	/* Set by the engine before it hands the request back. */
	int32_t result;        /* enum vn_ce_result; every part has its own */
	int32_t status;        /* HTTP status, 0 without an answer */
	int32_t curl_code;     /* CURLcode of a transport failure */
	int32_t sys_errno;     /* errno of a file that cannot be read */
	uint32_t body_len;     /* bytes of the body kept in `body` */
	int64_t declared;      /* the size of a too large object or answer, -1: unknown */
	unsigned char *body;   /* the bytes read, or an error's body (engine's memory) */
	char error[VN_CE_ERROR_MAX];
};

struct vn_ce_engine;

/*
 * A new engine with `slots` requests of up to `max_parts` parts each,
 * reading up to `max_body` bytes each (at least VN_CE_BLOB_MAX), with
 * `workers` threads for file reads (0: HTTP GETs only), chunk fingerprints
 * under the 32-byte UMASH key `chunk_key`; its threads start at once.
 * Its memory: `slots` x (`max_body` + `max_parts` x 64 KiB), touched as
 * used.  Returns 0, or an errno value.
 */
int vn_ce_open(int slots, size_t max_body, int max_parts, int workers, const void *chunk_key,
    int notify_fd, struct vn_ce_engine **out);
/* Request `i` of the pool (0 <= i < slots). */
struct vn_ce_request *vn_ce_request(struct vn_ce_engine *engine, int i);
/*
 * What every GET started from now on is sent with: `headers`, lines
 * separated by '\n'; `sigv4` libcurl's CURLOPT_AWS_SIGV4 and `userpwd`
 * "key:secret" (both NULL: unsigned); the connect timeout; and how long a
 * transfer may stay silent.  Returns 0, or an errno value.
 */
int vn_ce_set_auth(struct vn_ce_engine *engine, const char *headers, const char *sigv4,
    const char *userpwd, long connect_timeout_ms, long idle_timeout_s);
/*
 * Start requests `indices[0..n)`.  Returns 0; EINVAL if one of them is
 * malformed (a kind, range, part or path the engine does not take: none
 * is started); ESHUTDOWN once closed.
 */
int vn_ce_submit(struct vn_ce_engine *engine, const int *indices, int n);
/* Up to `cap` indices of requests that ended, into `out`; their count. */
int vn_ce_take(struct vn_ce_engine *engine, int *out, int cap);
/*
 * Stop the threads: GETs in flight and requests queued end as
 * VN_CE_SHUTDOWN (for `vn_ce_take`); a file read under way is let finish
 * first, so that nothing writes to the cache once this returns.
 * Idempotent; `vn_ce_free` then releases the memory.
 */
void vn_ce_close(struct vn_ce_engine *engine);
void vn_ce_free(struct vn_ce_engine *engine);

#endif
