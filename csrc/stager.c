/*
 * WAL commits staged off the commit path: see stager.h.  The pin is
 * SQLite's reader protocol (src/wal.c, walTryBeginRead) on the wal-index's
 * read marks, through a side file of our own.
 */
#define _GNU_SOURCE
#include "stager.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

/* SQLite's shared-memory lock slots (src/wal.c): the write lock, the
 * checkpointer's, recovery's, then one per reader: WAL_READ_LOCK(i). */
#define VN_SHM_WRITE_LOCK 0
#define VN_SHM_CKPT_LOCK 1
#define VN_SHM_READ_LOCK(i) (3 + (i))
/* Readers' slots: 0 (reads the file alone) and 1..4, each with a mark. */
#define VN_WAL_NREADER 5
/* The wal-index's checkpoint info follows the header's two copies:
 * nBackfill (u32), then aReadMark[VN_WAL_NREADER] (u32 each). */
#define VN_CKPT_INFO_OFFSET (2 * VN_WALINDEX_HEADER_BYTES)
#define VN_NBACKFILL_OFFSET VN_CKPT_INFO_OFFSET
#define VN_READMARK_OFFSET (VN_CKPT_INFO_OFFSET + 4)

static_assert(VN_SHM_READ_LOCK(VN_WAL_NREADER - 1) < SQLITE_SHM_NLOCK,
    "the readers' slots are SQLite's shm locks 3..7");
static_assert(VN_SHM_WRITE_LOCK == 0 && VN_SHM_CKPT_LOCK == 1,
    "the write and checkpoint locks are slots 0 and 1 (vfs.c hooks them)");
static_assert(VN_CKPT_INFO_OFFSET == 96 && VN_READMARK_OFFSET == 100,
    "WalCkptInfo starts at byte 96 of region 0, aReadMark at 100");
static_assert(VN_READMARK_OFFSET + 4 * VN_WAL_NREADER <=
    VN_WALINDEX_REGION_BYTES, "the read marks lie in region 0");

/* Tries at pinning before giving up: SQLite's readers give up after 100
 * (walTryBeginRead, SQLITE_PROTOCOL); the same backoff bounds it to about a
 * second. */
#define VN_PIN_TRIES 100
/* The first tries only yield (a writer updating the header, a checkpointer
 * holding a slot for a moment); later ones sleep tries^2 * this, at most
 * VN_PIN_MAX_SLEEP_US. */
#define VN_PIN_YIELD_TRIES 5
#define VN_PIN_SLEEP_UNIT_US 20
#define VN_PIN_MAX_SLEEP_US 10000

/*
 * Checkpoint starvation: a pin held most of the time (a writer that commits
 * as fast as the thread stages) leaves the checkpoint short of the newest
 * frame and keeps the WAL from being reset.  Once the pinned WAL is this
 * many frames long -- SQLite's default wal_autocheckpoint, where SQLite
 * itself wants the WAL copied back and reset -- the thread pins nothing
 * more until the WAL's generation changes (it was reset) or
 * VN_STAGER_GAP_MS passed: a checkpoint then completes, and the next write
 * transaction resets the WAL.  100 ms is several commits even with
 * synchronous=FULL on a disk, and the most a burst that ends inside the gap
 * waits to be staged.
 */
#define VN_STAGER_GAP_FRAMES 1000
#define VN_STAGER_GAP_MS 100

/* vn_stager_stage_now() runs under the WAL write lock: it waits at most
 * this long for the thread (one staging; a full scan of a large database
 * takes longer, and then the WAL reset that follows costs one more). */
#define VN_STAGE_NOW_MS 10000

/* A drain without a bound says so in the log this often. */
#define VN_DRAIN_WARN_SECONDS 10

struct vn_stager {
	sqlite3_vfs *base;
	sqlite3_file *side;         /* the database, opened with base */
	const volatile uint8_t *shm0; /* region 0 through side */
	const struct vn_stage_ops *ops;
	void *arg;
	const char *canon;          /* the database's canonical path */
	pthread_t thread;
	pid_t pid;                  /* the process that started the thread */
	pthread_mutex_t mu;         /* guards everything below */
	pthread_cond_t work;        /* to the thread */
	pthread_cond_t idle;        /* from the thread: a staging ended */
	uint64_t handed;            /* handovers not picked up yet */
	int want_now;               /* vn_stager_stage_now() waits */
	int urgent;                 /* someone waits: no gap */
	int busy, stop, failed;
	struct vn_wal_pos newest;   /* the last position handed over */
	int reset_ok;               /* a WAL reset by this writer: its start */
	struct vn_wal_pos reset_from;
	uint8_t reset_salt[8];
	int last_ok;                /* the thread's last staged state */
	struct vn_wal_pos last;
	int gap_on;                 /* no pin before gap_until (ms) unless the
				     * generation leaves gap_salt */
	int64_t gap_until;
	uint8_t gap_salt[8];
	struct vn_stager_stats stats;
	struct vn_stager *next;     /* the process's list */
};

/* Every stager of the process, for vn_stagers_drain_all(). */
static pthread_mutex_t stagers_mu = PTHREAD_MUTEX_INITIALIZER;
static struct vn_stager *stagers;
static pthread_once_t stagers_once = PTHREAD_ONCE_INIT;

/* fork(): the child has no stager thread; the parent's stagers are not its
 * own (their pid says so), and the list starts empty. */
static void fork_prepare(void) { pthread_mutex_lock(&stagers_mu); }
static void fork_parent(void) { pthread_mutex_unlock(&stagers_mu); }
static void fork_child(void)
{
	pthread_mutex_init(&stagers_mu, NULL);
	stagers = NULL;
}

static void stagers_setup(void)
{
	pthread_atfork(fork_prepare, fork_parent, fork_child);
}

static int64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A CLOCK_MONOTONIC deadline for pthread_cond_timedwait (the conds use
 * that clock). */
static struct timespec deadline_of(int64_t ms)
{
	struct timespec ts = { .tv_sec = ms / 1000,
	    .tv_nsec = (ms % 1000) * 1000000 };

	return ts;
}

static int same_state(const struct vn_wal_pos *a, const struct vn_wal_pos *b)
{
	return vn_wal_pos_equal(a, b) && a->npage == b->npage &&
	    a->pgsz == b->pgsz;
}

static int ours(const struct vn_stager *s)
{
	return s != NULL && s->pid == getpid();
}

int vn_walindex_backfilled(const volatile void *region0,
    const struct vn_wal_pos *pos)
{
	const volatile uint32_t *backfill;

	if (region0 == NULL || pos->mx == 0)
		return 0;
	backfill = (const volatile uint32_t *)((const volatile uint8_t *)
	    region0 + VN_NBACKFILL_OFFSET);
	return __atomic_load_n(backfill, __ATOMIC_ACQUIRE) == pos->mx;
}

/* ---- the pin ------------------------------------------------------------- */

static int shm_lock(struct vn_stager *s, int slot, int flags)
{
	return s->side->pMethods->xShmLock(s->side, slot, 1, flags);
}

static volatile uint32_t *read_mark(struct vn_stager *s, int i)
{
	return (volatile uint32_t *)(s->shm0 + VN_READMARK_OFFSET + 4 * i);
}

/* A slot whose mark is the newest at or below pos->mx (SQLite readers do
 * the same: a checkpoint copies no frame past the smallest mark of a held
 * slot, so pages with no frame up to that mark stay as they were); moved
 * to pos->mx when a slot can be taken exclusively.  The slot, or 0. */
static int choose_slot(struct vn_stager *s, const struct vn_wal_pos *pos,
    uint32_t *mark)
{
	uint32_t best = 0;
	int slot = 0;

	for (int i = 1; i < VN_WAL_NREADER; i++) {
		uint32_t m = __atomic_load_n(read_mark(s, i), __ATOMIC_ACQUIRE);

		if (best <= m && m <= pos->mx) {
			best = m;
			slot = i;
		}
	}
	if (slot != 0 && best == pos->mx) {
		*mark = best;
		return slot;
	}
	for (int i = 1; i < VN_WAL_NREADER; i++) {
		if (shm_lock(s, VN_SHM_READ_LOCK(i),
		    SQLITE_SHM_LOCK | SQLITE_SHM_EXCLUSIVE) != SQLITE_OK)
			continue;
		__atomic_store_n(read_mark(s, i), pos->mx, __ATOMIC_RELEASE);
		s->side->pMethods->xShmBarrier(s->side);
		shm_lock(s, VN_SHM_READ_LOCK(i),
		    SQLITE_SHM_UNLOCK | SQLITE_SHM_EXCLUSIVE);
		*mark = pos->mx;
		return i;
	}
	*mark = best;
	return slot;
}

/* One try: the newest committed state in *pos, its slot held shared (and
 * the side file's SHARED lock, which keeps any connection from closing the
 * WAL under us).  0, or -1 (nothing held). */
static int try_pin(struct vn_stager *s, struct vn_wal_pos *pos, int *slot)
{
	struct vn_wal_pos again;
	uint32_t mark;
	int i;

	if (s->side->pMethods->xLock(s->side, SQLITE_LOCK_SHARED) != SQLITE_OK)
		return -1;
	if (vn_walindex_read(s->shm0, pos) != 0)
		goto fail;
	i = choose_slot(s, pos, &mark);
	if (i == 0 || shm_lock(s, VN_SHM_READ_LOCK(i),
	    SQLITE_SHM_LOCK | SQLITE_SHM_SHARED) != SQLITE_OK)
		goto fail;
	s->side->pMethods->xShmBarrier(s->side);
	if (__atomic_load_n(read_mark(s, i), __ATOMIC_ACQUIRE) != mark ||
	    vn_walindex_read(s->shm0, &again) != 0 || !same_state(pos, &again)) {
		shm_lock(s, VN_SHM_READ_LOCK(i),
		    SQLITE_SHM_UNLOCK | SQLITE_SHM_SHARED);
		goto fail;
	}
	*slot = i;
	return 0;
fail:
	s->side->pMethods->xUnlock(s->side, SQLITE_LOCK_NONE);
	return -1;
}

static void backoff(int tries)
{
	long us;
	struct timespec ts;

	if (tries < VN_PIN_YIELD_TRIES) {
		sched_yield();
		return;
	}
	us = (long)tries * tries * VN_PIN_SLEEP_UNIT_US;
	if (us > VN_PIN_MAX_SLEEP_US)
		us = VN_PIN_MAX_SLEEP_US;
	ts.tv_sec = 0;
	ts.tv_nsec = us * 1000;
	nanosleep(&ts, NULL);
}

static int pin(struct vn_stager *s, struct vn_wal_pos *pos, int *slot)
{
	for (int tries = 0; tries < VN_PIN_TRIES; tries++) {
		if (tries > 0)
			backoff(tries);
		if (try_pin(s, pos, slot) == 0)
			return 0;
	}
	return -1;
}

static void unpin(struct vn_stager *s, int slot)
{
	shm_lock(s, VN_SHM_READ_LOCK(slot), SQLITE_SHM_UNLOCK | SQLITE_SHM_SHARED);
	s->side->pMethods->xUnlock(s->side, SQLITE_LOCK_NONE);
}

/* ---- the thread ---------------------------------------------------------- */

/* Called with s->mu held: whether the thread waits before its next pin. */
static int in_gap(struct vn_stager *s)
{
	if (!s->gap_on || s->urgent || s->stop || s->want_now)
		return 0;
	if (memcmp(s->newest.salt, s->gap_salt, sizeof(s->gap_salt)) != 0 ||
	    now_ms() >= s->gap_until) {
		s->gap_on = 0;
		return 0;
	}
	return 1;
}

/* Locks, pins, stages, unpins, unlocks (res->ok -1: no pin).  Called
 * without s->mu; `c` holds the reset seen by the commit path. */
static void stage_one(struct vn_stager *s, struct vn_wal_commit *c,
    const uint8_t reset_salt[8], struct vn_stage_result *res)
{
	int slot;

	res->ok = 0;
	if (s->ops->lock(s->arg) != 0)
		return;
	if (pin(s, &c->end, &slot) != 0) {
		s->ops->unlock(s->arg);
		res->ok = -1;
		return;
	}
	/* The reset's start holds for the generation it began only: a later
	 * reset copied that generation's frames into the file too. */
	c->have_start = c->have_start &&
	    memcmp(reset_salt, c->end.salt, sizeof(c->end.salt)) == 0;
	/* A state staged already costs the tracker a look at its record. */
	s->ops->stage(s->arg, s->side, c, res);
	unpin(s, slot);
	s->ops->unlock(s->arg);
}

/* Called with s->mu held, after a staging. */
static void staged(struct vn_stager *s, const struct vn_wal_pos *pinned,
    const struct vn_stage_result *res)
{
	if (res->ok < 0) {
		s->failed = 1;
		s->stats.pin_failed++;
		vn_log(SQLITE_NOTICE, "verneuil: no WAL read mark obtained in "
		    "%d tries; staging WAL commits on the commit path from "
		    "now on", VN_PIN_TRIES);
		return;
	}
	s->stats.async++;
	s->last_ok = res->ok != 0;
	s->last = res->done;
	s->gap_on = pinned->mx >= VN_STAGER_GAP_FRAMES;
	if (s->gap_on) {
		s->gap_until = now_ms() + VN_STAGER_GAP_MS;
		memcpy(s->gap_salt, pinned->salt, sizeof(s->gap_salt));
	}
}

/* Called with s->mu held: takes the pending work; returns the commit to
 * pin, with the last WAL reset seen (its generation's salts in reset_salt). */
static struct vn_wal_commit pick(struct vn_stager *s, uint8_t reset_salt[8])
{
	struct vn_wal_commit c = { .have_end = 1 };

	if (s->handed > 1)
		s->stats.coalesced += s->handed - 1;
	s->handed = 0;
	s->want_now = 0;
	c.have_start = s->reset_ok;
	c.start = s->reset_from;
	memcpy(reset_salt, s->reset_salt, 8);
	return c;
}

static void *stager_main(void *arg)
{
	struct vn_stager *s = arg;

	pthread_setname_np(pthread_self(), "vn-stager");
	pthread_mutex_lock(&s->mu);
	for (;;) {
		struct vn_stage_result res;
		struct vn_wal_commit c;
		uint8_t reset_salt[8];

		if (s->failed || (s->handed == 0 && !s->want_now)) {
			s->urgent = 0;
			pthread_cond_broadcast(&s->idle);
			if (s->stop)
				break;
			pthread_cond_wait(&s->work, &s->mu);
			continue;
		}
		if (in_gap(s)) {
			struct timespec ts = deadline_of(s->gap_until);

			pthread_cond_timedwait(&s->work, &s->mu, &ts);
			continue;
		}
		c = pick(s, reset_salt);
		s->busy = 1;
		pthread_mutex_unlock(&s->mu);
		stage_one(s, &c, reset_salt, &res);
		pthread_mutex_lock(&s->mu);
		s->busy = 0;
		staged(s, &c.end, &res);
		pthread_cond_broadcast(&s->idle);
	}
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

/* ---- the connection's side ----------------------------------------------- */

static void close_side(struct vn_stager *s)
{
	if (s->side->pMethods != NULL) {
		if (s->shm0 != NULL)
			s->side->pMethods->xShmUnmap(s->side, 0);
		s->side->pMethods->xClose(s->side);
	}
	free(s->side);
}

/* The database opened again with the underlying VFS (never open/close: a
 * close drops the process's POSIX locks, which the VFS knows to avoid),
 * without mmap (the connection's thread may remap its own file, never
 * this one), and the wal-index's region 0 mapped through it. */
static int open_side(struct vn_stager *s, const char *db_name)
{
	sqlite3_int64 no_mmap = 0;
	void volatile *region = NULL;
	int out = 0;

	s->side = calloc(1, (size_t)s->base->szOsFile);
	if (s->side == NULL)
		return -1;
	if (s->base->xOpen(s->base, db_name, s->side, SQLITE_OPEN_MAIN_DB |
	    SQLITE_OPEN_READWRITE, &out) != SQLITE_OK ||
	    (out & SQLITE_OPEN_READONLY) != 0 || s->side->pMethods == NULL ||
	    s->side->pMethods->iVersion < 2)
		return -1;
	s->side->pMethods->xFileControl(s->side, SQLITE_FCNTL_MMAP_SIZE,
	    &no_mmap);
	if (s->side->pMethods->xShmMap(s->side, 0, VN_WALINDEX_REGION_BYTES, 0,
	    &region) != SQLITE_OK || region == NULL)
		return -1;
	s->shm0 = (const volatile uint8_t *)region;
	return 0;
}

static int init_sync(struct vn_stager *s)
{
	pthread_condattr_t attr;
	int rc;

	if (pthread_condattr_init(&attr) != 0)
		return -1;
	rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0 ||
	    pthread_mutex_init(&s->mu, NULL) != 0;
	if (rc == 0 && pthread_cond_init(&s->work, &attr) != 0)
		rc = 1;
	if (rc == 0 && pthread_cond_init(&s->idle, &attr) != 0)
		rc = 1;
	pthread_condattr_destroy(&attr);
	return rc ? -1 : 0;
}

/* The thread blocks every signal: they are the application's. */
static int start_thread(struct vn_stager *s)
{
	sigset_t all, old;
	int rc;

	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	rc = pthread_create(&s->thread, NULL, stager_main, s);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	return rc == 0 ? 0 : -1;
}

struct vn_stager *vn_stager_start(sqlite3_vfs *base, const char *db_name,
    const char *canon, const struct vn_stage_ops *ops, void *arg)
{
	struct vn_stager *s = calloc(1, sizeof(*s));

	if (s == NULL)
		return NULL;
	s->base = base;
	s->ops = ops;
	s->canon = canon;
	s->arg = arg;
	s->pid = getpid();
	pthread_once(&stagers_once, stagers_setup);
	if (open_side(s, db_name) != 0 || init_sync(s) != 0 ||
	    start_thread(s) != 0) {
		if (s->side != NULL)
			close_side(s);
		free(s);
		return NULL;
	}
	pthread_mutex_lock(&stagers_mu);
	s->next = stagers;
	stagers = s;
	pthread_mutex_unlock(&stagers_mu);
	return s;
}

int vn_stager_hand(struct vn_stager *s, const struct vn_wal_pos *end,
    const struct vn_wal_pos *reset_from)
{
	int rc = -1;

	if (!ours(s))
		return -1;
	pthread_mutex_lock(&s->mu);
	if (!s->failed && !s->stop) {
		s->newest = *end;
		if (reset_from != NULL) {
			s->reset_ok = 1;
			s->reset_from = *reset_from;
			memcpy(s->reset_salt, end->salt, sizeof(s->reset_salt));
		}
		s->handed++;
		pthread_cond_signal(&s->work);
		rc = 0;
	}
	pthread_mutex_unlock(&s->mu);
	return rc;
}

/* Called with s->mu held: waits for the thread to be idle, until the
 * deadline (ms; < 0: none). */
static int wait_idle(struct vn_stager *s, int64_t until)
{
	int64_t warn_at = now_ms() + VN_DRAIN_WARN_SECONDS * 1000;

	s->urgent = 1;
	pthread_cond_signal(&s->work);
	while (!s->failed && (s->busy || s->handed > 0 || s->want_now)) {
		int64_t t = now_ms();
		int64_t wake = until >= 0 && until < warn_at ? until : warn_at;
		struct timespec ts = deadline_of(wake);

		if (until >= 0 && t >= until)
			return -1;
		if (t >= warn_at) {
			vn_log(SQLITE_WARNING, "verneuil: still waiting for a "
			    "WAL snapshot being staged (%d s)",
			    VN_DRAIN_WARN_SECONDS);
			warn_at = t + VN_DRAIN_WARN_SECONDS * 1000;
			continue;
		}
		pthread_cond_timedwait(&s->idle, &s->mu, &ts);
	}
	return 0;
}

int vn_stager_drain(struct vn_stager *s, int64_t timeout_ms)
{
	int rc;

	if (!ours(s))
		return 0;
	pthread_mutex_lock(&s->mu);
	rc = wait_idle(s, timeout_ms < 0 ? -1 : now_ms() + timeout_ms);
	pthread_mutex_unlock(&s->mu);
	return rc;
}

int vn_stager_stage_now(struct vn_stager *s, const struct vn_wal_pos *now)
{
	int rc = -1;

	if (!ours(s))
		return -1;
	pthread_mutex_lock(&s->mu);
	if (!s->failed && !(s->last_ok && !s->busy && s->handed == 0 &&
	    same_state(&s->last, now))) {
		s->newest = *now;
		s->want_now = 1;
		wait_idle(s, now_ms() + VN_STAGE_NOW_MS);
	}
	if (!s->failed && !s->busy && s->last_ok && same_state(&s->last, now))
		rc = 0;
	pthread_mutex_unlock(&s->mu);
	return rc;
}

void vn_stager_stop(struct vn_stager *s)
{
	struct vn_stager **p;

	if (s == NULL)
		return;
	if (!ours(s))
		return; /* a forked child: the thread is the parent's */
	pthread_mutex_lock(&s->mu);
	s->stop = 1;
	s->urgent = 1;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->mu);
	/* The thread stages what was handed over, then ends. */
	pthread_join(s->thread, NULL);
	pthread_mutex_lock(&stagers_mu);
	for (p = &stagers; *p != NULL; p = &(*p)->next) {
		if (*p == s) {
			*p = s->next;
			break;
		}
	}
	pthread_mutex_unlock(&stagers_mu);
	close_side(s);
	pthread_cond_destroy(&s->work);
	pthread_cond_destroy(&s->idle);
	pthread_mutex_destroy(&s->mu);
	free(s);
}

void vn_stager_stats(struct vn_stager *s, struct vn_stager_stats *out)
{
	memset(out, 0, sizeof(*out));
	if (!ours(s))
		return;
	pthread_mutex_lock(&s->mu);
	*out = s->stats;
	pthread_mutex_unlock(&s->mu);
}

int vn_stagers_drain_all(int64_t timeout_ms)
{
	int64_t until = now_ms() + timeout_ms;
	struct timespec ts;
	int rc = 0;

	/* The list's lock with a deadline too: this runs at process exit. */
	ts = (struct timespec){ 0 };
	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += timeout_ms / 1000 + 1;
	if (pthread_mutex_timedlock(&stagers_mu, &ts) != 0)
		return -1;
	for (struct vn_stager *s = stagers; s != NULL; s = s->next) {
		int64_t left = until - now_ms();

		if (!ours(s))
			continue;
		if (left < 0 || vn_stager_drain(s, left) != 0)
			rc = -1;
	}
	pthread_mutex_unlock(&stagers_mu);
	return rc;
}

void vn_stagers_drain_file(const char *canon)
{
	pthread_mutex_lock(&stagers_mu);
	for (struct vn_stager *s = stagers; s != NULL; s = s->next) {
		if (ours(s) && strcmp(s->canon, canon) == 0)
			vn_stager_drain(s, -1);
	}
	pthread_mutex_unlock(&stagers_mu);
}

/* Process exit without closing the connections: what was committed is
 * staged (with a bound: a stuck file system must not keep the process). */
#define VN_EXIT_DRAIN_MS 5000

__attribute__((destructor)) static void drain_at_exit(void)
{
	vn_stagers_drain_all(VN_EXIT_DRAIN_MS);
}
