/*
 * The writer's log: every message goes to a sink (vfs.c sets sqlite3_log,
 * reached through the loadable extension's API table when it is one), and
 * to stderr as configured: all messages with "log_stderr", the warnings that
 * a database is not replicated with "warn_stderr" (on by default, since
 * neither Python nor the sqlite3 shell listens to sqlite3_log).
 */
#ifndef VN_LOG_H
#define VN_LOG_H

#include <limits.h>

/* Longest message; longer ones are cut (paths are at most PATH_MAX). */
#define VN_LOG_MAX (PATH_MAX + 512)

typedef void (*vn_log_sink)(int code, const char *fmt, ...);

/* Where messages go besides stderr (NULL: nowhere). */
void vn_log_set_sink(vn_log_sink sink);
void vn_log_set_stderr(int on);
void vn_log_set_warn_stderr(int on);

/* One message with an SQLite result code (SQLITE_NOTICE, SQLITE_WARNING...). */
void vn_log(int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* A database that is not replicated (SQLITE_WARNING). Callers say it once
 * per database and reason, or rate-limit it. */
void vn_warn(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

#endif /* VN_LOG_H */
