/*
 * The writer's log (log.h): a sink and two stderr switches, read by any
 * thread that logs, set at registration or from Python at any time.
 */
#include "log.h"

#include <sqlite3.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>

static _Atomic(vn_log_sink) sink;
static atomic_int log_stderr;
static atomic_int warn_stderr = 1;

void vn_log_set_sink(vn_log_sink s)
{
	atomic_store(&sink, s);
}

void vn_log_set_stderr(int on)
{
	atomic_store(&log_stderr, on != 0);
}

void vn_log_set_warn_stderr(int on)
{
	atomic_store(&warn_stderr, on != 0);
}

static void emit(int code, int is_warning, const char *fmt, va_list ap)
{
	char msg[VN_LOG_MAX];
	vn_log_sink s = atomic_load(&sink);

	vsnprintf(msg, sizeof(msg), fmt, ap);
	if (s != NULL)
		s(code, "%s", msg);
	if (atomic_load(&log_stderr) || (is_warning && atomic_load(&warn_stderr)))
		fprintf(stderr, "%s\n", msg);
}

void vn_log(int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	emit(code, 0, fmt, ap);
	va_end(ap);
}

void vn_warn(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	emit(SQLITE_WARNING, 1, fmt, ap);
	va_end(ap);
}
