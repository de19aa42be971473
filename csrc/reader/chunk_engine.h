/*
 * The reader's chunk path in C: many chunk GETs in flight on one thread of
 * its own (libcurl's multi interface), each answer decoded (zstd), verified
 * against its fingerprint (UMASH) and written into its place in the disk
 * cache there, so that none of this work waits for, or holds, Python's GIL.
 *
 * The caller owns a fixed pool of requests (`vn_ce_request`, by index): it
 * fills a free one, submits its index, and gets the index back from
 * `vn_ce_take` once the request is over, its outcome filled in.  The engine
 * writes 8 bytes to the caller's eventfd (`notify_fd`) after each turn of
 * its loop that finished some requests, so the caller wakes once per batch.
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
/* The longest URL of a request, its terminating NUL included. */
#define VN_CE_URL_MAX 2048
/* The longest error message kept (libcurl's CURL_ERROR_SIZE). */
#define VN_CE_ERROR_MAX 256

/* How a request ended (`vn_ce_request.result`). */
enum vn_ce_result {
	VN_CE_CHUNK = 0,      /* verified bytes in `out` */
	VN_CE_HTTP = 1,       /* a non-2xx answer: `status`, its body in `in` */
	VN_CE_TRANSPORT = 2,  /* no answer: `curl_code`, `error` */
	VN_CE_TOO_LARGE = 3,  /* a body over the engine's bound: `declared` */
	VN_CE_MISMATCH = 4,   /* a 2xx body that is not the chunk it names */
	VN_CE_SHUTDOWN = 5,   /* the engine closed before it ended */
};

struct vn_ce_request {
	/* Set by the caller before `vn_ce_submit`. */
	char url[VN_CE_URL_MAX];
	uint64_t fp[2];        /* the chunk's fingerprint (major, minor) */
	int data_fd;           /* -1: not written to the disk cache */
	int idx_fd;            /* the segment's index, appended one record */
	int64_t offset;        /* where the bytes go in data_fd */
	int32_t timeout_ms;    /* the whole request's bound */
	/* Set by the engine before it hands the request back. */
	int32_t result;        /* enum vn_ce_result */
	int32_t status;        /* HTTP status, 0 without an answer */
	int32_t curl_code;     /* CURLcode of a transport failure */
	int32_t write_errno;   /* 0: written (or not asked); else why not */
	uint32_t body_len;     /* bytes of the body kept in `in` */
	uint32_t length;       /* the chunk's bytes in `out` */
	int64_t declared;      /* Content-Length of a too large body, -1: unknown */
	unsigned char *body;   /* the body as received (engine's memory) */
	unsigned char *chunk;  /* the chunk's bytes (engine's memory) */
	char error[VN_CE_ERROR_MAX];
};

struct vn_ce_engine;

/*
 * A new engine with `slots` requests, bodies bounded by `max_body` bytes,
 * chunk fingerprints under the 32-byte UMASH key `chunk_key`; its thread
 * starts at once.  Returns 0, or an errno value.
 */
int vn_ce_open(int slots, size_t max_body, const void *chunk_key, int notify_fd,
    struct vn_ce_engine **out);
/* Request `i` of the pool (0 <= i < slots). */
struct vn_ce_request *vn_ce_request(struct vn_ce_engine *engine, int i);
/*
 * What every request started from now on is sent with: `headers`, lines
 * separated by '\n'; `sigv4` libcurl's CURLOPT_AWS_SIGV4 and `userpwd`
 * "key:secret" (both NULL: unsigned); the connect timeout; and how long a
 * transfer may stay silent.  Returns 0, or an errno value.
 */
int vn_ce_set_auth(struct vn_ce_engine *engine, const char *headers, const char *sigv4,
    const char *userpwd, long connect_timeout_ms, long idle_timeout_s);
/* Start requests `indices[0..n)`.  Returns 0, or ESHUTDOWN once closed. */
int vn_ce_submit(struct vn_ce_engine *engine, const int *indices, int n);
/* Up to `cap` indices of requests that ended, into `out`; their count. */
int vn_ce_take(struct vn_ce_engine *engine, int *out, int cap);
/*
 * Stop the thread: requests in flight or queued end as VN_CE_SHUTDOWN (for
 * `vn_ce_take`).  Idempotent; `vn_ce_free` then releases the memory.
 */
void vn_ce_close(struct vn_ce_engine *engine);
void vn_ce_free(struct vn_ce_engine *engine);

#endif
