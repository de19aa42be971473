/*
 * The writer's reading of VERNEUIL_CONFIG (a JSON object, or "@file"):
 * replication_spooling_dir, make_default and warn_stderr; every other key
 * belongs to the copier and the reader and is skipped.
 */
#ifndef VN_CONFIG_H
#define VN_CONFIG_H

#include <stddef.h>

struct vn_env_config {
	char *spool;      /* replication_spooling_dir, malloc'ed; NULL: none */
	int make_default; /* "make_default": true */
	int warn_stderr;  /* "warn_stderr": 0 or 1; -1 when absent */
};

/* Parses the object in text[0, len); 0, or -1 when it is not a JSON object
 * (out->spool may then hold a string to free). */
int vn_config_parse(const char *text, size_t len, struct vn_env_config *out);

/* The first VN_CONFIG_MAX bytes of `path`, NUL-terminated and malloc'ed, and
 * their length in *len; NULL (errno set) when it cannot be read. */
char *vn_config_read_file(const char *path, size_t *len);

#endif /* VN_CONFIG_H */
