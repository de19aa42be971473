/*
 * The writer's reading of VERNEUIL_CONFIG (a JSON object, or "@file"):
 * replication_spooling_dir, make_default, warn_stderr and max_db_size; every other key
 * belongs to the copier and the reader and is skipped.  The one reader of
 * it for the writer: the loadable extension (vfs.c) and writer_vfs (through
 * verneuil_vfs_config_from_env) both use vn_config_from_env().
 */
#ifndef VN_CONFIG_H
#define VN_CONFIG_H

#include <stddef.h>

/* The environment variable. */
#define VN_CONFIG_ENV "VERNEUIL_CONFIG"

/* Room for the sentence about an unusable config (vn_config_from_env's
 * `why`): a path of a few hundred bytes, a strerror(3) text and the words
 * around them; longer ones are cut. */
#define VN_CONFIG_WHY_MAX 1024

struct vn_env_config {
	char *spool;      /* replication_spooling_dir, malloc'ed; NULL: none */
	/* replication_spooling_dir's JSON text when it is neither a string nor
	 * null, malloc'ed; NULL otherwise. */
	char *spool_bad;
	int make_default; /* "make_default": true */
	int warn_stderr;  /* "warn_stderr": 0 or 1; -1 when absent */
	/* "max_db_size": a non-negative JSON integer (bytes); 0 when absent
	 * or not such a number. */
	unsigned long long max_db_size;
};

/*
 * Reads VERNEUIL_CONFIG: the variable's text, or with "@path" that file's.
 * Returns 0 with *out filled (no spool when the variable is unset or
 * empty); -1 when the config is unusable (the file cannot be read, or it is
 * not a JSON object), *out then holding no spool and no other key; 1 when
 * only replication_spooling_dir is unusable (not a string): no spool, the
 * other keys apply.  When not 0, why[0, cap) holds the sentence to log
 * ("VERNEUIL_CONFIG is unusable (...): the verneuil VFS replicates
 * nothing").  Free *out with vn_config_free() in every case.
 */
int vn_config_from_env(struct vn_env_config *out, char *why, size_t cap);

void vn_config_free(struct vn_env_config *config);

#endif /* VN_CONFIG_H */
