/*
 * The `verneuil` SQLite VFS: a shim over the default (unix) VFS that stages
 * a content-addressed snapshot of every main database file in a local spool
 * after each commit, with a rollback journal or in WAL mode (docs/SPOOL.md,
 * docs/WRITER.md).
 *
 * This is the one public header (used by the cffi build, writer_vfs/).
 * Replication never fails or blocks SQLite: errors are reported through
 * sqlite3_log and the commit stands.
 *
 * Pragmas understood on a connection opened with vfs=verneuil:
 *   PRAGMA verneuil_full_snapshot;  next write transaction rebuilds the
 *                                   snapshot from a full scan
 *   PRAGMA verneuil_stats;          counters of this connection's file
 *   PRAGMA verneuil_spool_dir;      this database's spool directory
 *   PRAGMA verneuil_no_xattr;       test hook: act as if the file system
 *                                   had no user xattrs (always rebuild)
 *   PRAGMA verneuil_wait_staged[=ms]; waits until this connection's WAL
 *                                   commits are staged: "ok" or "timeout"
 *                                   (at most a minute)
 */
#ifndef VERNEUIL_VFS_H
#define VERNEUIL_VFS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define VERNEUIL_VFS_NAME "verneuil"

/*
 * sqlite3_file_control(db, "main", VERNEUIL_FCNTL_WAL_UNREPLICATED, &on)
 * (int on) sets `on` to 1 when the file's WAL commits are not replicated
 * through this connection (its WAL's shared memory, or part of the
 * database, is handled by another VFS above `verneuil`), else 0.  An opcode
 * of our own, above SQLite's.
 */
#define VERNEUIL_FCNTL_WAL_UNREPLICATED 0x76650001

/*
 * Registers the VFS (first call) or updates its configuration (later
 * calls; files already open keep the spool they opened with).  spool_dir
 * NULL or "" disables replication (the VFS then passes everything through).
 * Returns an SQLite result code.
 */
int verneuil_vfs_register(const char *spool_dir, int make_default);

/*
 * Same, configured from the VERNEUIL_CONFIG environment variable (JSON, or
 * "@/path/to/file.json"): keys `replication_spooling_dir`, `make_default`,
 * `warn_stderr` and `max_db_size` (see verneuil_vfs_set_max_db_size).  Without the variable, replication is disabled; an
 * unusable one is logged and replicates nothing.
 */
int verneuil_vfs_register_from_env(void);

/*
 * VERNEUIL_CONFIG as verneuil_vfs_register_from_env() reads it, for a host
 * that registers the VFS itself (writer_vfs): replication_spooling_dir into
 * spool[0, spool_cap) ("" for none) and its length into *spool_len (when
 * that is spool_cap or more it was cut: call again with more room);
 * make_default (0 or 1), warn_stderr (0 or 1; -1 when absent) and
 * max_db_size (0 when absent).  Returns
 * 0; -1 when the config is unusable (nothing replicates, no key applies);
 * 1 when only replication_spooling_dir is (nothing replicates, the other
 * keys apply).  Then why[0, why_cap) holds the sentence to log, the same
 * as verneuil_vfs_register_from_env() logs.
 */
int verneuil_vfs_config_from_env(char *spool, size_t spool_cap,
    size_t *spool_len, int *make_default, int *warn_stderr,
    unsigned long long *max_db_size, char *why, size_t why_cap);

/*
 * The largest database replicated: a file past it is not snapshotted (its
 * staged snapshot and the store's copy stay at the last state under the
 * bound), said once on stderr and in the log, and counted as too_large.
 * The default and the most allowed is verneuil_vfs_max_db_size_limit()
 * (about 1.5 TiB: the largest whose manifest fits Verneuil's 384 MiB cap);
 * copiers and `verneuilctl lag` apply the same bound (VERNEUIL_CONFIG's
 * max_db_size).  Returns the previous bound, or 0 (and changes nothing)
 * for 0 or a bound past the limit.
 */
unsigned long long verneuil_vfs_set_max_db_size(unsigned long long n);
unsigned long long verneuil_vfs_max_db_size_limit(void);

/*
 * GC runs after a snapshot with probability weight * (chunks staged by that
 * snapshot) / (chunks in the database).  0 disables GC; a huge value forces
 * it after every snapshot that staged something.  For tests and tools.
 */
void verneuil_vfs_set_gc_weight(double weight);

/*
 * Most chunks besides chunk 0 bundled in each manifest: those holding the
 * upper levels of the database's b-trees, so that a cold reader's lookups
 * need fewer GETs (docs/WRITER.md).  0 bundles chunk 0 only; at most 16;
 * the default is 4.  Returns the previous count, or -1 (and changes
 * nothing) for a count out of range.
 */
int verneuil_vfs_set_bundle_chunks(int n);

/*
 * WAL commits (shared memory) are staged by a thread of the connection, off
 * the commit path (docs/WRITER.md, "The stager"): on by default.  Off, they
 * are snapshotted on the commit path, before the WAL write lock is released
 * (connections whose stager started keep it).  Returns the previous setting.
 */
int verneuil_vfs_set_wal_async(int on);

/*
 * Waits until every commit handed to a stager thread of this process is
 * staged: 0, or -1 after timeout_ms milliseconds.  Tools and tests that read
 * the spool right after a commit call it (a connection's own: PRAGMA
 * verneuil_wait_staged).  At process exit the library waits the same way,
 * for at most 5 s.
 */
int verneuil_vfs_wait_staged(int timeout_ms);

/* Also copy every log message to stderr (for debugging). */
void verneuil_vfs_set_log_stderr(int on);

/* Print "not replicated" warnings on stderr too (a spool that keeps failing,
 * a WAL database whose shared memory a VFS above us implements): on by
 * default; VERNEUIL_CONFIG's "warn_stderr": false turns it off. */
void verneuil_vfs_set_warn_stderr(int on);

/*
 * Writes the spool directory of the database at db_path (which must exist)
 * for the spool root spool_dir into out.  Returns 0 or an errno value.
 */
int verneuil_vfs_db_spool_dir(const char *spool_dir, const char *db_path,
    char *out, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* VERNEUIL_VFS_H */
