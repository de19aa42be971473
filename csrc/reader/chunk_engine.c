/*
 * The reader's chunk path in C (see chunk_engine.h).  Requests come in two
 * kinds and end the same way:
 *
 * - an HTTP GET runs on the engine's thread, in libcurl's multi loop; its
 *   answer is checked there (a 2xx, the asked range, no more bytes than
 *   asked) and finished there;
 * - a file read (a directory store) runs on one of `workers` threads: open
 *   (no symlink, a regular file only), pread of the object or its range;
 *   blocking reads in parallel keep a disk's queue busy and decode on every
 *   core, with no Python per chunk.
 *
 * Finishing a request: each part's blob is zstd-decoded (one frame, at most
 * 64 KiB, any bytes after it ignored; or the raw bytes), checked against
 * its full 128-bit fingerprint, and written with its index record into the
 * disk cache's segment (the record format of verneuil_fuse/reader/cache.py)
 * and/or kept in the part's memory for the caller.  A blob the bytes read
 * do not reach is VN_CE_SHORT: every part is verified or an error, never
 * wrong bytes.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include "chunk_engine.h"
#include "umash.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <zlib.h>
#include <zstd.h>

static_assert(sizeof(int64_t) == sizeof(off_t), "pread and pwrite offsets are 64-bit");
static_assert(CURL_ERROR_SIZE <= VN_CE_ERROR_MAX, "libcurl's messages fit");
static_assert(VN_CE_BLOB_MAX >= VN_CE_CHUNK_SIZE, "a raw chunk is a valid blob");
static_assert(VN_CE_PACK_MAX <= UINT32_MAX, "a part's place in the bytes read fits 32 bits");

/*
 * The loop's longest sleep: libcurl's own timers (request timeouts) and a
 * submission or close (the engine's eventfd) wake it sooner; a second is
 * only the bound of a lost wake-up.
 */
#define POLL_MS 1000
/* Sockets handed to libcurl per turn at most: a turn's worth of answers. */
#define MAX_EVENTS 64
/* libcurl's receive buffer: a chunk's zstd frame in one write callback. */
#define RECEIVE_BUFFER (128L << 10)
/* The cache's index record: fp major, minor, offset, length, check. */
#define RECORD_BYTES 32
/* XORed into the record's CRC-32, so that zeros left by a crash never pass. */
#define RECORD_SALT 0x56434331u
/*
 * A store's file, opened as LocalBackend opens it: a symlink planted under
 * a key is refused (ELOOP), and a FIFO never blocks the open (then refused
 * as not a regular file); O_NONBLOCK changes nothing for a regular file.
 */
#define OPEN_FLAGS (O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
/* A range as libcurl takes it, "a-b": two offsets of 20 digits at most. */
#define RANGE_TEXT 48
static_assert(RANGE_TEXT >= 20 + 1 + 20 + 1, "two 64-bit offsets, a dash and a NUL fit");
/* The HTTP status of a range answered, and of one past the object's end. */
#define HTTP_PARTIAL 206
#define HTTP_RANGE_NOT_SATISFIABLE 416

static const unsigned char zstd_magic[4] = { 0x28, 0xb5, 0x2f, 0xfd };

struct auth {
	int refs; /* the engine's, and each handle's that was set up with it */
	struct curl_slist *headers;
	char *sigv4;
	char *userpwd;
	long connect_ms;
	long idle_s;
};

/* What finishing a request needs of its thread's own. */
struct finisher {
	ZSTD_DCtx *dctx;
	unsigned char *scratch; /* a part's decoded bytes, when not kept */
};

/* A request's HTTP handle, and what its answer said so far. */
struct slot {
	struct vn_ce_engine *engine;
	struct vn_ce_request *req;
	CURL *easy;
	struct auth *applied; /* what the handle was last set up with */
	int stale;            /* setting `applied` up failed: again next time */
	int too_large;
	int enough;           /* a 200 for a range: stopped at the range's end */
	int64_t seen;         /* bytes of a 200's body so far */
	int64_t first, last;  /* its Content-Range, -1: none */
	char range[RANGE_TEXT];
};

struct worker {
	struct vn_ce_engine *engine;
	pthread_t thread;
	int started;
	struct finisher fin;
};

struct vn_ce_engine {
	int nslots;
	int max_parts;
	size_t max_body;
	struct vn_ce_request *reqs;
	struct vn_ce_part *parts;
	struct slot *slots;
	struct vn_umash_params params;
	struct finisher fin; /* the HTTP thread's */
	CURLM *multi;
	/*
	 * libcurl's socket interface: it says which sockets to watch for what
	 * (`on_socket`, into `epoll_fd`) and when its next timeout is
	 * (`on_timer`); a turn hands it only the sockets found ready, so it
	 * costs the transfers that moved, not every transfer in flight.
	 */
	int epoll_fd;
	int wake_fd;         /* eventfd in epoll_fd: a submission, or close */
	int64_t timer_at_ms; /* libcurl's next timeout (CLOCK_MONOTONIC), -1: none */
	int notify_fd;
	pthread_t thread;
	int started;
	int nworkers;
	struct worker *workers;

	pthread_mutex_t lock; /* guards what follows */
	pthread_cond_t work;  /* a file read queued, or stop */
	int stop;
	int closed;
	struct auth *auth;
	int *queue; /* GETs submitted, not yet started */
	int nqueue;
	int *jobs; /* file reads submitted, not yet started: a ring */
	int jobs_head, njobs;
	int *done; /* ended, not yet taken */
	int ndone;
};

static pthread_once_t global_once = PTHREAD_ONCE_INIT;
static CURLcode global_status;

static void global_init(void)
{
	global_status = curl_global_init(CURL_GLOBAL_DEFAULT);
}

/* ------------------------------------------------------------- auth */

static void auth_release(struct vn_ce_engine *e, struct auth *a)
{
	int last;

	if (a == NULL)
		return;
	pthread_mutex_lock(&e->lock);
	last = --a->refs == 0;
	pthread_mutex_unlock(&e->lock);
	if (!last)
		return;
	curl_slist_free_all(a->headers);
	free(a->sigv4);
	free(a->userpwd);
	free(a);
}

int vn_ce_set_auth(struct vn_ce_engine *e, const char *headers, const char *sigv4,
    const char *userpwd, long connect_timeout_ms, long idle_timeout_s)
{
	struct auth *a = calloc(1, sizeof(*a)), *old;
	const char *line = headers;

	if (a == NULL)
		return ENOMEM;
	a->refs = 1;
	a->connect_ms = connect_timeout_ms;
	a->idle_s = idle_timeout_s;
	/*
	 * Only the caller's headers: GETs send no Expect, and libcurl 7.88
	 * would sign even a header given empty to remove it.
	 */
	while (line != NULL && *line != '\0') {
		const char *end = strchr(line, '\n');
		size_t len = end != NULL ? (size_t)(end - line) : strlen(line);
		char *copy = strndup(line, len);
		struct curl_slist *more = copy != NULL ? curl_slist_append(a->headers, copy) : NULL;

		free(copy);
		if (more == NULL) {
			curl_slist_free_all(a->headers);
			a->headers = NULL;
			break;
		}
		a->headers = more;
		line = end != NULL ? end + 1 : NULL;
	}
	if (sigv4 != NULL)
		a->sigv4 = strdup(sigv4);
	if (userpwd != NULL)
		a->userpwd = strdup(userpwd);
	if ((headers != NULL && *headers != '\0' && a->headers == NULL) || (sigv4 != NULL && a->sigv4 == NULL) ||
	    (userpwd != NULL && a->userpwd == NULL)) {
		curl_slist_free_all(a->headers);
		free(a->sigv4);
		free(a->userpwd);
		free(a);
		return ENOMEM;
	}
	pthread_mutex_lock(&e->lock);
	old = e->auth;
	e->auth = a;
	pthread_mutex_unlock(&e->lock);
	auth_release(e, old);
	return 0;
}

/* ------------------------------------------- decode, verify, cache write */

static int matches(const struct vn_ce_engine *e, const struct vn_ce_part *p,
    const void *data, size_t len)
{
	struct vn_umash_fp fp = vn_umash_fprint(&e->params, 0, data, len);

	return fp.hash[0] == p->fp[0] && fp.hash[1] == p->fp[1];
}

/*
 * Part `p`'s blob `blob[0..n)`, decoded and verified: VN_CE_CHUNK, its
 * bytes at `*out` (in `p->dest` if kept), or VN_CE_MISMATCH.
 */
static int decode(struct finisher *f, const struct vn_ce_engine *e, struct vn_ce_part *p,
    const unsigned char *blob, size_t n, const unsigned char **out)
{
	unsigned char *dest = p->keep ? p->dest : f->scratch;

	if (n >= sizeof(zstd_magic) && memcmp(blob, zstd_magic, sizeof(zstd_magic)) == 0) {
		size_t frame = ZSTD_findFrameCompressedSize(blob, n);

		if (!ZSTD_isError(frame)) {
			/* At most a chunk's size: a longer frame fails here. */
			size_t len = ZSTD_decompressDCtx(f->dctx, dest, VN_CE_CHUNK_SIZE, blob, frame);

			if (!ZSTD_isError(len) && matches(e, p, dest, len)) {
				p->length = (uint32_t)len;
				*out = dest;
				return VN_CE_CHUNK;
			}
		}
	}
	if (n <= VN_CE_CHUNK_SIZE && matches(e, p, blob, n)) {
		if (p->keep)
			memcpy(p->dest, blob, n);
		p->length = (uint32_t)n;
		*out = blob;
		return VN_CE_CHUNK;
	}
	return VN_CE_MISMATCH;
}

static void put_le64(unsigned char *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static void put_le32(unsigned char *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

/* The chunk `data` into its place in the cache, then its index record. */
static void write_to_cache(struct vn_ce_part *p, const unsigned char *data)
{
	unsigned char record[RECORD_BYTES];
	size_t done = 0;
	ssize_t n;

	while (done < p->length) {
		n = pwrite(p->data_fd, data + done, p->length - done, p->offset + (off_t)done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			p->write_errno = n < 0 ? errno : EIO;
			return;
		}
		done += (size_t)n;
	}
	put_le64(record, p->fp[0]);
	put_le64(record + 8, p->fp[1]);
	put_le64(record + 16, (uint64_t)p->offset);
	put_le32(record + 24, p->length);
	put_le32(record + 28, (uint32_t)crc32(0L, record, 28) ^ RECORD_SALT);
	do
		n = write(p->idx_fd, record, sizeof(record));
	while (n < 0 && errno == EINTR);
	if (n != (ssize_t)sizeof(record))
		p->write_errno = n < 0 ? errno : EIO;
}

/* The request ended without its bytes: every part ends as it did. */
static void fail(struct vn_ce_request *r, int result)
{
	r->result = result;
	for (int i = 0; i < r->nparts; i++)
		r->parts[i].result = result;
}

/* The bytes are in `body`: every part decoded, verified, written, kept. */
static void finish_parts(struct finisher *f, const struct vn_ce_engine *e, struct vn_ce_request *r)
{
	int mismatch = 0, short_ = 0;

	for (int i = 0; i < r->nparts; i++) {
		struct vn_ce_part *p = &r->parts[i];
		uint32_t hi = p->hi != 0 ? p->hi : r->body_len;
		const unsigned char *bytes = NULL;

		if (hi > r->body_len) {
			p->result = VN_CE_SHORT;
			short_++;
			continue;
		}
		p->result = decode(f, e, p, r->body + p->lo, hi - p->lo, &bytes);
		if (p->result != VN_CE_CHUNK)
			mismatch++;
		else if (p->data_fd >= 0 && p->length > 0)
			write_to_cache(p, bytes);
	}
	r->result = mismatch ? VN_CE_MISMATCH : short_ ? VN_CE_SHORT : VN_CE_CHUNK;
}

static void reset_outcome(struct vn_ce_request *r)
{
	r->result = VN_CE_TRANSPORT;
	r->status = 0;
	r->curl_code = 0;
	r->sys_errno = 0;
	r->body_len = 0;
	r->declared = -1;
	r->error[0] = '\0';
	for (int i = 0; i < r->nparts; i++) {
		r->parts[i].result = VN_CE_TRANSPORT;
		r->parts[i].write_errno = 0;
		r->parts[i].length = 0;
	}
}

/* ----------------------------------------------------------- a file read */

/* Up to `want` bytes at `at`: how many (fewer only at the file's end), or -1. */
static ssize_t read_at(int fd, unsigned char *buf, size_t want, off_t at)
{
	size_t done = 0;

	while (done < want) {
		ssize_t n = pread(fd, buf + done, want - done, at + (off_t)done);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -1;
		if (n == 0)
			break;
		done += (size_t)n;
	}
	return (ssize_t)done;
}

/* The file cannot be read: `err`, and what is wrong with it (NULL: `err` says it). */
static void file_error(struct vn_ce_request *r, int err, const char *what)
{
	r->sys_errno = err;
	snprintf(r->error, sizeof(r->error), "%s", what != NULL ? what : "");
	fail(r, VN_CE_FILE);
}

/*
 * The object's bytes from open file `fd` into `body`: 0, or -1 with the
 * request failed.  A whole object over VN_CE_BLOB_MAX is too large, even if
 * it grew since fstat: one byte past the bound is looked for.
 */
static int read_body(struct vn_ce_request *r, int fd, const struct stat *st)
{
	size_t want = r->end < 0 ? VN_CE_BLOB_MAX : (size_t)(r->end - r->start);
	unsigned char past;
	ssize_t n;

	if (r->end < 0 && st->st_size > VN_CE_BLOB_MAX) {
		r->declared = st->st_size;
		fail(r, VN_CE_TOO_LARGE);
		return -1;
	}
	n = read_at(fd, r->body, want, (off_t)r->start);
	if (n < 0) {
		file_error(r, errno, NULL);
		return -1;
	}
	if (r->end < 0 && (size_t)n == want && read_at(fd, &past, 1, (off_t)want) == 1) {
		fail(r, VN_CE_TOO_LARGE);
		return -1;
	}
	r->body_len = (uint32_t)n;
	return 0;
}

/* A file read, start to end, on a worker's thread. */
static void read_file(struct finisher *f, const struct vn_ce_engine *e, struct vn_ce_request *r)
{
	struct stat st;
	int fd;

	reset_outcome(r);
	fd = open(r->url, OPEN_FLAGS);
	if (fd < 0) {
		file_error(r, errno, NULL);
		return;
	}
	if (fstat(fd, &st) != 0)
		file_error(r, errno, NULL);
	else if (S_ISDIR(st.st_mode))
		file_error(r, EISDIR, "is a directory, not a blob");
	else if (!S_ISREG(st.st_mode))
		file_error(r, EINVAL, "not a regular file, not a blob");
	else if (read_body(r, fd, &st) == 0)
		finish_parts(f, e, r);
	close(fd);
}

/* ---------------------------------------------------------- an HTTP GET */

/*
 * libcurl's CURLOPT_HEADERFUNCTION: the answer's Content-Range ("bytes
 * a-b/total"); a new status line (an interim answer's end) forgets it.
 */
static size_t on_header(char *line, size_t size, size_t nmemb, void *arg)
{
	static const char name[] = "content-range:";
	struct slot *s = arg;
	size_t n = size * nmemb;
	char text[RANGE_TEXT * 2];
	int64_t first, last;

	if (n >= 5 && memcmp(line, "HTTP/", 5) == 0)
		s->first = s->last = -1;
	if (n <= sizeof(name) - 1 || n >= sizeof(text) || strncasecmp(line, name, sizeof(name) - 1) != 0)
		return n;
	memcpy(text, line + sizeof(name) - 1, n - (sizeof(name) - 1));
	text[n - (sizeof(name) - 1)] = '\0';
	if (sscanf(text, " bytes %" SCNd64 "-%" SCNd64, &first, &last) == 2 && first >= 0 && last >= first) {
		s->first = first;
		s->last = last;
	}
	return n;
}

/*
 * A 2xx answer other than 206 to a range request (a server that ignores
 * Range sends the whole object): only bytes [start, end) of it are kept,
 * and the transfer stops at `end`.
 */
static size_t take_range(struct slot *s, const char *data, size_t n)
{
	struct vn_ce_request *r = s->req;
	int64_t at = s->seen, lo = at > r->start ? at : r->start;
	int64_t hi = at + (int64_t)n < r->end ? at + (int64_t)n : r->end;

	s->seen += (int64_t)n;
	if (hi > lo) {
		memcpy(r->body + (lo - r->start), data + (lo - at), (size_t)(hi - lo));
		r->body_len = (uint32_t)(hi - r->start);
	}
	if (s->seen >= r->end) {
		s->enough = 1;
		return 0; /* ends the transfer: the rest is not read */
	}
	return n;
}

static size_t on_body(char *data, size_t size, size_t nmemb, void *arg)
{
	struct slot *s = arg;
	struct vn_ce_request *r = s->req;
	size_t n = size * nmemb, room;
	long status = 0;

	curl_easy_getinfo(s->easy, CURLINFO_RESPONSE_CODE, &status);
	if (status / 100 != 2) {
		room = s->engine->max_body - r->body_len;
		n = n < room ? n : room; /* an error's body: its start is enough */
	} else if (r->end >= 0 && status != HTTP_PARTIAL) {
		return take_range(s, data, n);
	} else {
		room = (r->end >= 0 ? (size_t)(r->end - r->start) : VN_CE_BLOB_MAX) - r->body_len;
		if (n > room) {
			s->too_large = 1;
			return 0; /* ends the transfer */
		}
	}
	memcpy(r->body + r->body_len, data, n);
	r->body_len += (uint32_t)n;
	return size * nmemb;
}

static int set_up(struct slot *s, struct auth *a)
{
	CURL *h = s->easy;
	struct vn_ce_request *r = s->req;
	int rc = CURLE_OK;

	if (s->applied != a || s->stale) {
		/* The handle holds a reference: libcurl keeps pointers into it. */
		if (s->applied != a) {
			pthread_mutex_lock(&s->engine->lock);
			a->refs++;
			pthread_mutex_unlock(&s->engine->lock);
			auth_release(s->engine, s->applied);
			s->applied = a;
		}
		rc |= curl_easy_setopt(h, CURLOPT_HTTPHEADER, a->headers);
		rc |= curl_easy_setopt(h, CURLOPT_AWS_SIGV4, a->sigv4);
		rc |= curl_easy_setopt(h, CURLOPT_USERPWD, a->userpwd);
		rc |= curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, a->connect_ms);
		/* Silence ends a transfer: less than a byte a second for idle_s. */
		rc |= curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
		rc |= curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, a->idle_s);
		s->stale = rc != CURLE_OK;
	}
	if (r->end >= 0)
		snprintf(s->range, sizeof(s->range), "%" PRId64 "-%" PRId64, r->start, r->end - 1);
	rc |= curl_easy_setopt(h, CURLOPT_RANGE, r->end >= 0 ? s->range : NULL);
	rc |= curl_easy_setopt(h, CURLOPT_URL, r->url);
	rc |= curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)r->timeout_ms);
	return rc == CURLE_OK ? 0 : -1;
}

/*
 * A 2xx answer holds what was asked: for a range, a 206's Content-Range
 * starts at `start`, ends by `end` and spans the body exactly (a shorter
 * one: the object ends sooner); anything else was cut to the range by
 * `take_range`.  A whole object's GET takes any 2xx.
 */
static int range_matches(const struct slot *s, long status)
{
	const struct vn_ce_request *r = s->req;

	if (r->end < 0 || status != HTTP_PARTIAL)
		return 1;
	return s->first == r->start && s->last < r->end && s->last - s->first + 1 == (int64_t)r->body_len;
}

/*
 * A GET's answer checked: 1 when its bytes are in for its parts to be
 * finished (`finish_parts`), else 0 with the request failed.
 */
static int check_answer(struct slot *s, CURLcode code)
{
	struct vn_ce_request *r = s->req;
	long status = 0;
	curl_off_t declared = -1;

	curl_easy_getinfo(s->easy, CURLINFO_RESPONSE_CODE, &status);
	r->status = (int32_t)status;
	if (s->too_large) {
		if (curl_easy_getinfo(s->easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &declared) == CURLE_OK)
			r->declared = declared;
		fail(r, VN_CE_TOO_LARGE);
	} else if (code != CURLE_OK && !s->enough) {
		r->curl_code = (int32_t)code;
		if (r->error[0] == '\0')
			snprintf(r->error, sizeof(r->error), "%s", curl_easy_strerror(code));
		fail(r, VN_CE_TRANSPORT);
	} else if (status == HTTP_RANGE_NOT_SATISFIABLE && r->end >= 0) {
		r->body_len = 0; /* the object ends before the range starts */
		fail(r, VN_CE_SHORT);
	} else if (status / 100 != 2) {
		fail(r, VN_CE_HTTP);
	} else if (!range_matches(s, status)) {
		if (s->first < 0)
			snprintf(r->error, sizeof(r->error), "asked bytes %" PRId64 "-%" PRId64 ", got a 206 "
			    "without Content-Range", r->start, r->end - 1);
		else
			snprintf(r->error, sizeof(r->error), "asked bytes %" PRId64 "-%" PRId64 ", got %" PRId64
			    "-%" PRId64 " (%" PRIu32 " bytes)", r->start, r->end - 1, s->first, s->last, r->body_len);
		fail(r, VN_CE_RANGE);
	} else {
		return 1;
	}
	return 0;
}

/* ------------------------------------------------------ handing back */

static void hand_back(struct vn_ce_engine *e, const int *ended, int n)
{
	uint64_t one = 1;
	ssize_t w;
	int was_empty;

	if (n == 0)
		return;
	pthread_mutex_lock(&e->lock);
	was_empty = e->ndone == 0;
	memcpy(e->done + e->ndone, ended, (size_t)n * sizeof(*ended));
	e->ndone += n;
	pthread_mutex_unlock(&e->lock);
	if (!was_empty)
		return; /* the caller was told, and takes them all at once */
	do
		w = write(e->notify_fd, &one, sizeof(one));
	while (w < 0 && errno == EINTR);
	/* EAGAIN: the counter is full, the caller is woken anyway. */
}

/* ------------------------------------------------------------ the loop */

/*
 * Take what was submitted since the last turn into `started`, with a
 * reference to the requests' auth (NULL: none set yet); their count, or -1
 * once the engine is closed.
 */
static int take_queued(struct vn_ce_engine *e, int *started, struct auth **a)
{
	int n;

	*a = NULL;
	pthread_mutex_lock(&e->lock);
	n = e->stop ? -1 : e->nqueue;
	if (n > 0) {
		memcpy(started, e->queue, (size_t)n * sizeof(int));
		e->nqueue = 0;
		*a = e->auth;
		if (*a != NULL)
			(*a)->refs++;
	}
	pthread_mutex_unlock(&e->lock);
	return n;
}

/* Add requests to the multi handle; those that cannot start end at once. */
static int start_requests(struct vn_ce_engine *e, const int *started, int n, struct auth *a,
    char *active, int *ended)
{
	int nended = 0;

	for (int i = 0; i < n; i++) {
		struct slot *s = &e->slots[started[i]];

		reset_outcome(s->req);
		s->too_large = s->enough = 0;
		s->seen = 0;
		s->first = s->last = -1;
		if (a == NULL || set_up(s, a) != 0 || curl_multi_add_handle(e->multi, s->easy) != CURLM_OK) {
			snprintf(s->req->error, sizeof(s->req->error), "%s",
			    a == NULL ? "no credentials set" : "cannot set the request up");
			s->req->curl_code = CURLE_FAILED_INIT;
			fail(s->req, VN_CE_TRANSPORT);
			ended[nended++] = started[i];
			continue;
		}
		active[started[i]] = 1;
	}
	return nended;
}

/* A file read, or a GET's answer to finish, for a worker. */
static void queue_job(struct vn_ce_engine *e, int i)
{
	pthread_mutex_lock(&e->lock);
	e->jobs[(e->jobs_head + e->njobs++) % e->nslots] = i;
	pthread_mutex_unlock(&e->lock);
	pthread_cond_signal(&e->work);
}

/*
 * The transfers libcurl ended: finished here, appended to `ended`, or,
 * with workers, handed to them to finish (decoding on every core).
 */
static int collect_ended(struct vn_ce_engine *e, char *active, int *ended, int nended)
{
	CURLMsg *msg;
	int left;

	while ((msg = curl_multi_info_read(e->multi, &left)) != NULL) {
		struct slot *s;
		int i;

		if (msg->msg != CURLMSG_DONE)
			continue;
		curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&s);
		curl_multi_remove_handle(e->multi, s->easy);
		i = (int)(s - e->slots);
		active[i] = 0;
		if (!check_answer(s, msg->data.result)) {
			ended[nended++] = i;
		} else if (e->nworkers > 0) {
			queue_job(e, i);
		} else {
			finish_parts(&e->fin, e, s->req);
			ended[nended++] = i;
		}
	}
	return nended;
}

/* Closed: the GETs in flight or queued end now, unanswered. */
static void abort_all(struct vn_ce_engine *e, const char *active, int *ended)
{
	int nended = 0;

	for (int i = 0; i < e->nslots; i++) {
		if (!active[i])
			continue;
		curl_multi_remove_handle(e->multi, e->slots[i].easy);
		fail(&e->reqs[i], VN_CE_SHUTDOWN);
		ended[nended++] = i;
	}
	pthread_mutex_lock(&e->lock);
	for (int i = 0; i < e->nqueue; i++) {
		fail(&e->reqs[e->queue[i]], VN_CE_SHUTDOWN);
		ended[nended++] = e->queue[i];
	}
	e->nqueue = 0;
	pthread_mutex_unlock(&e->lock);
	hand_back(e, ended, nended);
}

static int64_t now_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* libcurl's CURLMOPT_SOCKETFUNCTION: watch `sock` for what it says. */
static int on_socket(CURL *easy, curl_socket_t sock, int what, void *arg, void *sockp)
{
	struct vn_ce_engine *e = arg;
	struct epoll_event ev = { 0 };

	(void)easy;
	if (what == CURL_POLL_REMOVE) {
		epoll_ctl(e->epoll_fd, EPOLL_CTL_DEL, sock, NULL); /* ENOENT: closed already */
		return 0;
	}
	ev.events = ((what & CURL_POLL_IN) ? EPOLLIN : 0) | ((what & CURL_POLL_OUT) ? EPOLLOUT : 0);
	ev.data.fd = sock;
	/* A socket number may come back for a new socket: add or modify. */
	if (epoll_ctl(e->epoll_fd, sockp == NULL ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, sock, &ev) != 0)
		epoll_ctl(e->epoll_fd, sockp == NULL ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, sock, &ev);
	curl_multi_assign(e->multi, sock, e);
	return 0;
}

/* libcurl's CURLMOPT_TIMERFUNCTION: its next timeout, -1 for none. */
static int on_timer(CURLM *multi, long timeout_ms, void *arg)
{
	struct vn_ce_engine *e = arg;

	(void)multi;
	e->timer_at_ms = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
	return 0;
}

/* Wait for ready sockets, libcurl's timeout or a wake-up; act on them. */
static void wait_and_act(struct vn_ce_engine *e)
{
	struct epoll_event events[MAX_EVENTS];
	int64_t wait = POLL_MS;
	int n, running;

	if (e->timer_at_ms >= 0) {
		wait = e->timer_at_ms - now_ms();
		wait = wait < 0 ? 0 : wait > POLL_MS ? POLL_MS : wait;
	}
	n = epoll_wait(e->epoll_fd, events, MAX_EVENTS, (int)wait);
	for (int i = 0; i < n; i++) {
		int fd = events[i].data.fd, flags = 0;

		if (fd == e->wake_fd) {
			uint64_t count;

			if (read(e->wake_fd, &count, sizeof(count)) < 0) {
				/* EAGAIN: another turn read it */
			}
			continue;
		}
		flags |= (events[i].events & EPOLLIN) ? CURL_CSELECT_IN : 0;
		flags |= (events[i].events & EPOLLOUT) ? CURL_CSELECT_OUT : 0;
		flags |= (events[i].events & (EPOLLERR | EPOLLHUP)) ? CURL_CSELECT_ERR : 0;
		curl_multi_socket_action(e->multi, fd, flags, &running);
	}
	if (e->timer_at_ms >= 0 && now_ms() >= e->timer_at_ms) {
		e->timer_at_ms = -1;
		curl_multi_socket_action(e->multi, CURL_SOCKET_TIMEOUT, 0, &running);
	}
}

static void wake(struct vn_ce_engine *e)
{
	uint64_t one = 1;

	if (write(e->wake_fd, &one, sizeof(one)) < 0) {
		/* EAGAIN: the counter is full, the loop wakes anyway */
	}
}

/* The engine's HTTP thread: a turn starts, moves and finishes transfers. */
static void *run(void *arg)
{
	struct vn_ce_engine *e = arg;
	int *started = malloc((size_t)e->nslots * sizeof(int));
	int *ended = malloc((size_t)e->nslots * sizeof(int));
	char *active = calloc((size_t)e->nslots, 1);

	if (started == NULL || ended == NULL || active == NULL) {
		pthread_mutex_lock(&e->lock);
		e->stop = 1;
		pthread_mutex_unlock(&e->lock);
	}
	for (;;) {
		struct auth *a;
		int nstarted = take_queued(e, started, &a), nended;

		if (nstarted < 0)
			break;
		nended = start_requests(e, started, nstarted, a, active, ended);
		auth_release(e, a);
		if (nended == 0)
			wait_and_act(e);
		nended = collect_ended(e, active, ended, nended);
		hand_back(e, ended, nended);
	}
	if (active != NULL && ended != NULL)
		abort_all(e, active, ended);
	free(started);
	free(ended);
	free(active);
	return NULL;
}

/* ----------------------------------------------------------- the workers */

/* The next job (`e->lock` held), or -1 for none. */
static int pop_job(struct vn_ce_engine *e)
{
	int i;

	if (e->njobs == 0)
		return -1;
	i = e->jobs[e->jobs_head];
	e->jobs_head = (e->jobs_head + 1) % e->nslots;
	e->njobs--;
	return i;
}

/*
 * A worker's thread, until the engine stops: file reads, and the GETs'
 * answers to finish, one at a time.
 */
static void *work(void *arg)
{
	struct worker *w = arg;
	struct vn_ce_engine *e = w->engine;

	for (;;) {
		int i;

		pthread_mutex_lock(&e->lock);
		while (!e->stop && e->njobs == 0)
			pthread_cond_wait(&e->work, &e->lock);
		i = e->stop ? -1 : pop_job(e);
		pthread_mutex_unlock(&e->lock);
		if (i < 0)
			break;
		if (e->reqs[i].kind == VN_CE_GET)
			finish_parts(&w->fin, e, &e->reqs[i]); /* its answer is in */
		else
			read_file(&w->fin, e, &e->reqs[i]);
		hand_back(e, &i, 1);
	}
	return NULL;
}

/* Closed, the threads joined: the jobs still queued end now. */
static void abort_jobs(struct vn_ce_engine *e)
{
	for (;;) {
		int i;

		pthread_mutex_lock(&e->lock);
		i = pop_job(e);
		pthread_mutex_unlock(&e->lock);
		if (i < 0)
			return;
		fail(&e->reqs[i], VN_CE_SHUTDOWN);
		hand_back(e, &i, 1);
	}
}

/* ----------------------------------------------------------- the caller */

static int init_finisher(struct finisher *f)
{
	f->dctx = ZSTD_createDCtx();
	f->scratch = malloc(VN_CE_CHUNK_SIZE);
	return f->dctx != NULL && f->scratch != NULL ? 0 : -1;
}

static void free_finisher(struct finisher *f)
{
	ZSTD_freeDCtx(f->dctx);
	free(f->scratch);
}

/* The multi handle's socket interface, and the eventfd that wakes its loop. */
static int init_loop(struct vn_ce_engine *e)
{
	struct epoll_event ev = { .events = EPOLLIN };
	int rc = CURLM_OK;

	e->timer_at_ms = -1;
	e->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
	e->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	ev.data.fd = e->wake_fd;
	if (e->epoll_fd < 0 || e->wake_fd < 0 || epoll_ctl(e->epoll_fd, EPOLL_CTL_ADD, e->wake_fd, &ev) != 0)
		return -1;
	rc |= curl_multi_setopt(e->multi, CURLMOPT_SOCKETFUNCTION, on_socket);
	rc |= curl_multi_setopt(e->multi, CURLMOPT_SOCKETDATA, e);
	rc |= curl_multi_setopt(e->multi, CURLMOPT_TIMERFUNCTION, on_timer);
	rc |= curl_multi_setopt(e->multi, CURLMOPT_TIMERDATA, e);
	/* Idle connections kept: one per request that may be in flight. */
	rc |= curl_multi_setopt(e->multi, CURLMOPT_MAXCONNECTS, (long)e->nslots);
	return rc == CURLM_OK ? 0 : -1;
}

/* Request `i`'s buffers, parts and easy handle, set up for what never changes. */
static int init_slot(struct vn_ce_engine *e, int i)
{
	struct slot *s = &e->slots[i];
	struct vn_ce_request *r = &e->reqs[i];
	int rc = CURLE_OK;

	r->parts = &e->parts[(size_t)i * (size_t)e->max_parts];
	for (int k = 0; k < e->max_parts; k++)
		r->parts[k].data_fd = r->parts[k].idx_fd = -1;
	r->end = -1;
	r->body = malloc(e->max_body);
	s->engine = e;
	s->req = r;
	s->easy = curl_easy_init();
	if (r->body == NULL || s->easy == NULL)
		return -1;
	rc |= curl_easy_setopt(s->easy, CURLOPT_PRIVATE, (char *)s);
	rc |= curl_easy_setopt(s->easy, CURLOPT_WRITEFUNCTION, on_body);
	rc |= curl_easy_setopt(s->easy, CURLOPT_WRITEDATA, s);
	rc |= curl_easy_setopt(s->easy, CURLOPT_HEADERFUNCTION, on_header);
	rc |= curl_easy_setopt(s->easy, CURLOPT_HEADERDATA, s);
	rc |= curl_easy_setopt(s->easy, CURLOPT_ERRORBUFFER, r->error);
	rc |= curl_easy_setopt(s->easy, CURLOPT_NOSIGNAL, 1L);
	rc |= curl_easy_setopt(s->easy, CURLOPT_TCP_NODELAY, 1L);
	rc |= curl_easy_setopt(s->easy, CURLOPT_BUFFERSIZE, RECEIVE_BUFFER);
	/* No Accept-Encoding: the bytes as stored, never re-encoded. */
	return rc == CURLE_OK ? 0 : -1;
}

/* The engine's memory, its HTTP loop and each request: 0, or -1. */
static int init_engine(struct vn_ce_engine *e)
{
	size_t nparts = (size_t)e->nslots * (size_t)e->max_parts;

	pthread_mutex_init(&e->lock, NULL);
	pthread_cond_init(&e->work, NULL);
	e->reqs = calloc((size_t)e->nslots, sizeof(*e->reqs));
	e->slots = calloc((size_t)e->nslots, sizeof(*e->slots));
	e->parts = calloc(nparts, sizeof(*e->parts));
	e->queue = calloc((size_t)e->nslots, sizeof(int));
	e->jobs = calloc((size_t)e->nslots, sizeof(int));
	e->done = calloc((size_t)e->nslots, sizeof(int));
	e->workers = calloc((size_t)e->nworkers + 1, sizeof(*e->workers));
	e->multi = curl_multi_init();
	if (e->reqs == NULL || e->slots == NULL || e->parts == NULL || e->queue == NULL ||
	    e->jobs == NULL || e->done == NULL || e->workers == NULL || e->multi == NULL ||
	    init_finisher(&e->fin) != 0 || init_loop(e) != 0)
		return -1;
	for (int i = 0; i < e->nslots; i++)
		if (init_slot(e, i) != 0)
			return -1;
	for (int i = 0; i < e->nworkers; i++) {
		e->workers[i].engine = e;
		if (init_finisher(&e->workers[i].fin) != 0)
			return -1;
	}
	return 0;
}

/* The HTTP thread, then the workers: 0, or an errno value. */
static int start_threads(struct vn_ce_engine *e)
{
	char name[16];
	int err = pthread_create(&e->thread, NULL, run, e);

	if (err != 0)
		return err;
	e->started = 1;
	pthread_setname_np(e->thread, "chunk-engine"); /* for top -H, py-spy */
	for (int i = 0; i < e->nworkers; i++) {
		struct worker *w = &e->workers[i];

		err = pthread_create(&w->thread, NULL, work, w);
		if (err != 0)
			return err;
		w->started = 1;
		snprintf(name, sizeof(name), "chunk-read-%d", i);
		pthread_setname_np(w->thread, name);
	}
	return 0;
}

int vn_ce_open(int nslots, size_t max_body, int max_parts, int workers, const void *chunk_key,
    int notify_fd, struct vn_ce_engine **out)
{
	struct vn_ce_engine *e;
	int err;

	*out = NULL;
	if (nslots <= 0 || max_body < VN_CE_BLOB_MAX || max_body > VN_CE_PACK_MAX || max_parts <= 0 ||
	    max_parts > VN_CE_PARTS_MAX || workers < 0 || workers > VN_CE_WORKERS_MAX)
		return EINVAL;
	pthread_once(&global_once, global_init);
	if (global_status != CURLE_OK)
		return EIO;
	e = calloc(1, sizeof(*e));
	if (e == NULL)
		return ENOMEM;
	e->nslots = nslots;
	e->max_body = max_body;
	e->max_parts = max_parts;
	e->nworkers = workers;
	e->notify_fd = notify_fd;
	e->epoll_fd = e->wake_fd = -1;
	vn_umash_params_derive(&e->params, 0, chunk_key);
	if (init_engine(e) != 0) {
		vn_ce_free(e);
		return ENOMEM;
	}
	err = start_threads(e);
	if (err != 0) {
		vn_ce_free(e);
		return err;
	}
	*out = e;
	return 0;
}

struct vn_ce_request *vn_ce_request(struct vn_ce_engine *e, int i)
{
	return i >= 0 && i < e->nslots ? &e->reqs[i] : NULL;
}

/* A request the engine takes: its kind, path, range and parts. */
static int well_formed(const struct vn_ce_engine *e, const struct vn_ce_request *r)
{
	const struct vn_ce_part *p = r->parts;
	int64_t len = r->end - r->start;

	if ((r->kind != VN_CE_GET && !(r->kind == VN_CE_READ && e->nworkers > 0)) ||
	    r->nparts < 1 || r->nparts > e->max_parts || memchr(r->url, '\0', sizeof(r->url)) == NULL ||
	    r->parts != e->parts + (r - e->reqs) * e->max_parts)
		return 0;
	for (int i = 0; i < r->nparts; i++)
		if (p[i].keep && p[i].dest == NULL)
			return 0;
	if (r->end < 0)
		return r->end == -1 && r->start == 0 && r->nparts == 1 && p->lo == 0 && p->hi == 0;
	if (r->start < 0 || len <= 0 || r->end > VN_CE_PACK_MAX || (size_t)len > e->max_body)
		return 0;
	for (int i = 0; i < r->nparts; i++)
		if (p[i].lo >= p[i].hi || p[i].hi > (uint64_t)len)
			return 0;
	return 1;
}

int vn_ce_submit(struct vn_ce_engine *e, const int *indices, int n)
{
	int err = 0, gets = 0, reads = 0;

	for (int i = 0; i < n; i++)
		if (indices[i] < 0 || indices[i] >= e->nslots || !well_formed(e, &e->reqs[indices[i]]))
			return EINVAL;
	pthread_mutex_lock(&e->lock);
	if (e->stop || e->nqueue + e->njobs + n > e->nslots)
		err = e->stop ? ESHUTDOWN : EBUSY;
	for (int i = 0; err == 0 && i < n; i++) {
		if (e->reqs[indices[i]].kind == VN_CE_GET) {
			e->queue[e->nqueue++] = indices[i];
			gets++;
		} else {
			e->jobs[(e->jobs_head + e->njobs++) % e->nslots] = indices[i];
			reads++;
		}
	}
	pthread_mutex_unlock(&e->lock);
	if (gets > 0)
		wake(e);
	/* A worker per read, at most every one: none woken for nothing. */
	for (int i = 0; i < reads && i < e->nworkers; i++)
		pthread_cond_signal(&e->work);
	return err;
}

int vn_ce_take(struct vn_ce_engine *e, int *out, int cap)
{
	int n;

	pthread_mutex_lock(&e->lock);
	n = e->ndone < cap ? e->ndone : cap;
	memcpy(out, e->done, (size_t)n * sizeof(*out));
	memmove(e->done, e->done + n, (size_t)(e->ndone - n) * sizeof(*out));
	e->ndone -= n;
	pthread_mutex_unlock(&e->lock);
	return n;
}

void vn_ce_close(struct vn_ce_engine *e)
{
	int join;

	pthread_mutex_lock(&e->lock);
	e->stop = 1;
	join = !e->closed;
	e->closed = 1;
	pthread_mutex_unlock(&e->lock);
	if (!join)
		return;
	pthread_cond_broadcast(&e->work);
	if (e->started) {
		wake(e);
		pthread_join(e->thread, NULL);
	}
	for (int i = 0; e->workers != NULL && i < e->nworkers; i++)
		if (e->workers[i].started)
			pthread_join(e->workers[i].thread, NULL);
	if (e->jobs != NULL)
		abort_jobs(e);
}

void vn_ce_free(struct vn_ce_engine *e)
{
	if (e == NULL)
		return;
	vn_ce_close(e);
	for (int i = 0; e->slots != NULL && i < e->nslots; i++) {
		struct slot *s = &e->slots[i];

		if (s->easy != NULL)
			curl_easy_cleanup(s->easy);
		auth_release(e, s->applied);
	}
	for (int i = 0; e->reqs != NULL && i < e->nslots; i++)
		free(e->reqs[i].body);
	for (int i = 0; e->workers != NULL && i < e->nworkers; i++)
		free_finisher(&e->workers[i].fin);
	free_finisher(&e->fin);
	auth_release(e, e->auth);
	if (e->multi != NULL)
		curl_multi_cleanup(e->multi);
	if (e->epoll_fd >= 0)
		close(e->epoll_fd);
	if (e->wake_fd >= 0)
		close(e->wake_fd);
	pthread_cond_destroy(&e->work);
	pthread_mutex_destroy(&e->lock);
	free(e->reqs);
	free(e->slots);
	free(e->parts);
	free(e->queue);
	free(e->jobs);
	free(e->done);
	free(e->workers);
	free(e);
}
