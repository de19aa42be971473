/*
 * The reader's chunk path in C (see chunk_engine.h): one thread runs
 * libcurl's multi loop over a fixed pool of requests, and finishes each
 * answer where it lands: zstd-decodes the chunk (one frame, at most 64 KiB,
 * any bytes after it ignored; or the raw bytes), checks its full 128-bit
 * fingerprint, and writes it with its index record into the disk cache's
 * segment (the record format of verneuil_fuse/reader/cache.py).
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include "chunk_engine.h"
#include "umash.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <zlib.h>
#include <zstd.h>

static_assert(sizeof(int64_t) == sizeof(off_t), "pwrite offsets are 64-bit");
static_assert(CURL_ERROR_SIZE <= VN_CE_ERROR_MAX, "libcurl's messages fit");

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

static const unsigned char zstd_magic[4] = { 0x28, 0xb5, 0x2f, 0xfd };

struct auth {
	int refs; /* the engine's, and each handle's that was set up with it */
	struct curl_slist *headers;
	char *sigv4;
	char *userpwd;
	long connect_ms;
	long idle_s;
};

struct slot {
	struct vn_ce_engine *engine;
	struct vn_ce_request *req;
	CURL *easy;
	struct auth *applied; /* what the handle was last set up with */
	int stale;            /* setting `applied` up failed: again next time */
	int too_large;
};

struct vn_ce_engine {
	int nslots;
	size_t max_body;
	struct vn_ce_request *reqs;
	struct slot *slots;
	struct vn_umash_params params;
	ZSTD_DCtx *dctx;
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

	pthread_mutex_t lock; /* guards what follows */
	int stop;
	int closed;
	struct auth *auth;
	int *queue; /* submitted, not yet started */
	int nqueue;
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

/* ---------------------------------------------------------- a request */

static size_t on_body(char *data, size_t size, size_t nmemb, void *arg)
{
	struct slot *s = arg;
	struct vn_ce_request *r = s->req;
	size_t n = size * nmemb, room = s->engine->max_body - r->body_len;
	long status = 0;

	if (n > room) {
		curl_easy_getinfo(s->easy, CURLINFO_RESPONSE_CODE, &status);
		if (status / 100 == 2) {
			s->too_large = 1;
			return 0; /* ends the transfer */
		}
		n = room; /* an error's body: its start is enough */
	}
	memcpy(r->body + r->body_len, data, n);
	r->body_len += (uint32_t)n;
	return size * nmemb;
}

static int set_up(struct slot *s, struct auth *a)
{
	CURL *h = s->easy;
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
	rc |= curl_easy_setopt(h, CURLOPT_URL, s->req->url);
	rc |= curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)s->req->timeout_ms);
	return rc == CURLE_OK ? 0 : -1;
}

static void reset_outcome(struct vn_ce_request *r)
{
	r->result = VN_CE_TRANSPORT;
	r->status = 0;
	r->curl_code = 0;
	r->write_errno = 0;
	r->body_len = 0;
	r->length = 0;
	r->declared = -1;
	r->error[0] = '\0';
}

static int matches(const struct vn_ce_engine *e, const struct vn_ce_request *r,
    const void *data, size_t len)
{
	struct vn_umash_fp fp = vn_umash_fprint(&e->params, 0, data, len);

	return fp.hash[0] == r->fp[0] && fp.hash[1] == r->fp[1];
}

/* The chunk's verified bytes into `out`: VN_CE_CHUNK, or VN_CE_MISMATCH. */
static int decode(struct vn_ce_engine *e, struct vn_ce_request *r)
{
	size_t n = r->body_len;

	if (n >= sizeof(zstd_magic) && memcmp(r->body, zstd_magic, sizeof(zstd_magic)) == 0) {
		size_t frame = ZSTD_findFrameCompressedSize(r->body, n);

		if (!ZSTD_isError(frame)) {
			/* At most a chunk's size: a longer frame fails here. */
			size_t len = ZSTD_decompressDCtx(e->dctx, r->chunk, VN_CE_CHUNK_SIZE, r->body, frame);

			if (!ZSTD_isError(len) && matches(e, r, r->chunk, len)) {
				r->length = (uint32_t)len;
				return VN_CE_CHUNK;
			}
		}
	}
	if (n <= VN_CE_CHUNK_SIZE && matches(e, r, r->body, n)) {
		memcpy(r->chunk, r->body, n);
		r->length = (uint32_t)n;
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

/* The chunk into its place in the cache, then its index record. */
static void write_to_cache(struct vn_ce_request *r)
{
	unsigned char record[RECORD_BYTES];
	size_t done = 0;
	ssize_t n;

	while (done < r->length) {
		n = pwrite(r->data_fd, r->chunk + done, r->length - done, r->offset + (off_t)done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			r->write_errno = n < 0 ? errno : EIO;
			return;
		}
		done += (size_t)n;
	}
	put_le64(record, r->fp[0]);
	put_le64(record + 8, r->fp[1]);
	put_le64(record + 16, (uint64_t)r->offset);
	put_le32(record + 24, r->length);
	put_le32(record + 28, (uint32_t)crc32(0L, record, 28) ^ RECORD_SALT);
	do
		n = write(r->idx_fd, record, sizeof(record));
	while (n < 0 && errno == EINTR);
	if (n != (ssize_t)sizeof(record))
		r->write_errno = n < 0 ? errno : EIO;
}

static void finish(struct vn_ce_engine *e, struct slot *s, CURLcode code)
{
	struct vn_ce_request *r = s->req;
	long status = 0;
	curl_off_t declared = -1;

	curl_easy_getinfo(s->easy, CURLINFO_RESPONSE_CODE, &status);
	r->status = (int32_t)status;
	if (s->too_large) {
		r->result = VN_CE_TOO_LARGE;
		if (curl_easy_getinfo(s->easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &declared) == CURLE_OK)
			r->declared = declared;
	} else if (code != CURLE_OK) {
		r->result = VN_CE_TRANSPORT;
		r->curl_code = (int32_t)code;
		if (r->error[0] == '\0')
			snprintf(r->error, sizeof(r->error), "%s", curl_easy_strerror(code));
	} else if (status / 100 != 2) {
		r->result = VN_CE_HTTP;
	} else {
		r->result = decode(e, r);
		if (r->result == VN_CE_CHUNK && r->data_fd >= 0 && r->length > 0)
			write_to_cache(r);
	}
}

/* ------------------------------------------------------------ the loop */

static void hand_back(struct vn_ce_engine *e, const int *ended, int n)
{
	uint64_t one = 1;
	ssize_t w;

	if (n == 0)
		return;
	pthread_mutex_lock(&e->lock);
	memcpy(e->done + e->ndone, ended, (size_t)n * sizeof(*ended));
	e->ndone += n;
	pthread_mutex_unlock(&e->lock);
	do
		w = write(e->notify_fd, &one, sizeof(one));
	while (w < 0 && errno == EINTR);
	/* EAGAIN: the counter is full, the caller is woken anyway. */
}

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
		s->too_large = 0;
		if (a == NULL || set_up(s, a) != 0 || curl_multi_add_handle(e->multi, s->easy) != CURLM_OK) {
			snprintf(s->req->error, sizeof(s->req->error), "%s",
			    a == NULL ? "no credentials set" : "cannot set the request up");
			s->req->curl_code = CURLE_FAILED_INIT;
			ended[nended++] = started[i];
			continue;
		}
		active[started[i]] = 1;
	}
	return nended;
}

/* Finish the transfers libcurl ended, appending them to `ended`. */
static int collect_ended(struct vn_ce_engine *e, char *active, int *ended, int nended)
{
	CURLMsg *msg;
	int left;

	while ((msg = curl_multi_info_read(e->multi, &left)) != NULL) {
		struct slot *s;

		if (msg->msg != CURLMSG_DONE)
			continue;
		curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&s);
		curl_multi_remove_handle(e->multi, s->easy);
		finish(e, s, msg->data.result);
		active[s - e->slots] = 0;
		ended[nended++] = (int)(s - e->slots);
	}
	return nended;
}

/* Closed: what is in flight or queued ends now, unanswered. */
static void abort_all(struct vn_ce_engine *e, const char *active, int *ended)
{
	int nended = 0;

	for (int i = 0; i < e->nslots; i++) {
		if (!active[i])
			continue;
		curl_multi_remove_handle(e->multi, e->slots[i].easy);
		e->reqs[i].result = VN_CE_SHUTDOWN;
		ended[nended++] = i;
	}
	pthread_mutex_lock(&e->lock);
	for (int i = 0; i < e->nqueue; i++) {
		e->reqs[e->queue[i]].result = VN_CE_SHUTDOWN;
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

/* The engine's thread: a turn starts, moves and finishes transfers. */
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

/* ----------------------------------------------------------- the caller */

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

/* Request `i`'s buffers and easy handle, set up for what never changes. */
static int init_slot(struct vn_ce_engine *e, int i)
{
	struct slot *s = &e->slots[i];
	struct vn_ce_request *r = &e->reqs[i];
	int rc = CURLE_OK;

	r->data_fd = r->idx_fd = -1;
	r->body = malloc(e->max_body);
	r->chunk = malloc(VN_CE_CHUNK_SIZE);
	s->engine = e;
	s->req = r;
	s->easy = curl_easy_init();
	if (r->body == NULL || r->chunk == NULL || s->easy == NULL)
		return -1;
	rc |= curl_easy_setopt(s->easy, CURLOPT_PRIVATE, (char *)s);
	rc |= curl_easy_setopt(s->easy, CURLOPT_WRITEFUNCTION, on_body);
	rc |= curl_easy_setopt(s->easy, CURLOPT_WRITEDATA, s);
	rc |= curl_easy_setopt(s->easy, CURLOPT_ERRORBUFFER, r->error);
	rc |= curl_easy_setopt(s->easy, CURLOPT_NOSIGNAL, 1L);
	rc |= curl_easy_setopt(s->easy, CURLOPT_TCP_NODELAY, 1L);
	rc |= curl_easy_setopt(s->easy, CURLOPT_BUFFERSIZE, RECEIVE_BUFFER);
	/* No Accept-Encoding: the bytes as stored, never re-encoded. */
	return rc == CURLE_OK ? 0 : -1;
}

int vn_ce_open(int nslots, size_t max_body, const void *chunk_key, int notify_fd,
    struct vn_ce_engine **out)
{
	struct vn_ce_engine *e;
	int err;

	*out = NULL;
	if (nslots <= 0 || max_body < VN_CE_CHUNK_SIZE || max_body > UINT32_MAX)
		return EINVAL;
	pthread_once(&global_once, global_init);
	if (global_status != CURLE_OK)
		return EIO;
	e = calloc(1, sizeof(*e));
	if (e == NULL)
		return ENOMEM;
	e->nslots = nslots;
	e->max_body = max_body;
	e->notify_fd = notify_fd;
	e->epoll_fd = e->wake_fd = -1;
	pthread_mutex_init(&e->lock, NULL);
	vn_umash_params_derive(&e->params, 0, chunk_key);
	e->reqs = calloc((size_t)nslots, sizeof(*e->reqs));
	e->slots = calloc((size_t)nslots, sizeof(*e->slots));
	e->queue = calloc((size_t)nslots, sizeof(int));
	e->done = calloc((size_t)nslots, sizeof(int));
	e->dctx = ZSTD_createDCtx();
	e->multi = curl_multi_init();
	if (e->reqs == NULL || e->slots == NULL || e->queue == NULL || e->done == NULL ||
	    e->dctx == NULL || e->multi == NULL || init_loop(e) != 0)
		goto nomem;
	for (int i = 0; i < nslots; i++)
		if (init_slot(e, i) != 0)
			goto nomem;
	err = pthread_create(&e->thread, NULL, run, e);
	if (err != 0) {
		vn_ce_free(e);
		return err;
	}
	e->started = 1;
	pthread_setname_np(e->thread, "chunk-engine"); /* for top -H, py-spy */
	*out = e;
	return 0;
nomem:
	vn_ce_free(e);
	return ENOMEM;
}

struct vn_ce_request *vn_ce_request(struct vn_ce_engine *e, int i)
{
	return i >= 0 && i < e->nslots ? &e->reqs[i] : NULL;
}

int vn_ce_submit(struct vn_ce_engine *e, const int *indices, int n)
{
	pthread_mutex_lock(&e->lock);
	if (e->stop || e->nqueue + n > e->nslots) {
		int err = e->stop ? ESHUTDOWN : EBUSY;

		pthread_mutex_unlock(&e->lock);
		return err;
	}
	memcpy(e->queue + e->nqueue, indices, (size_t)n * sizeof(*indices));
	e->nqueue += n;
	pthread_mutex_unlock(&e->lock);
	wake(e);
	return 0;
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
	join = e->started && !e->closed;
	e->closed = 1;
	pthread_mutex_unlock(&e->lock);
	if (join) {
		wake(e);
		pthread_join(e->thread, NULL);
	}
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
	for (int i = 0; e->reqs != NULL && i < e->nslots; i++) {
		free(e->reqs[i].body);
		free(e->reqs[i].chunk);
	}
	auth_release(e, e->auth);
	if (e->multi != NULL)
		curl_multi_cleanup(e->multi);
	ZSTD_freeDCtx(e->dctx);
	if (e->epoll_fd >= 0)
		close(e->epoll_fd);
	if (e->wake_fd >= 0)
		close(e->wake_fd);
	pthread_mutex_destroy(&e->lock);
	free(e->reqs);
	free(e->slots);
	free(e->queue);
	free(e->done);
	free(e);
}
