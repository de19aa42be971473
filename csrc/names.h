/*
 * Store object names as docs/FORMAT.md defines them: chunk names
 * ("%016x%2F%016x" of a chunk's fingerprint), manifest names (hostname and
 * canonical path, percent-encoded, mangled when long), and the six UMASH
 * parameter sets they and the manifest's fingerprints are computed with.
 *
 * The same names are the spool's file names (docs/SPOOL.md); the spool's
 * own file operations are in spool.c.  The Python side of the same format
 * is verneuil_fuse/format/names.py.
 */
#ifndef VN_NAMES_H
#define VN_NAMES_H

#include <stddef.h>
#include <stdint.h>

#include "umash.h"

/* docs/FORMAT.md: chunks are 64 KiB (SQLite's largest page), aligned on file
 * offsets; the last one may be short. */
#define VN_CHUNK_SIZE 65536

/* docs/FORMAT.md: chunk names are "%016x%%2F%016x": 35 characters. */
#define VN_CHUNK_NAME_LEN 35

/* docs/FORMAT.md: a percent-encoded manifest name of this many bytes or more is
 * shortened to its first and last VN_MANGLE_KEEP bytes around a fingerprint;
 * so a name never exceeds 2 * 104 + 32 = 240 bytes (NAME_MAX is 255). */
#define VN_MANGLE_THRESHOLD 230
#define VN_MANGLE_KEEP 104
#define VN_MANIFEST_NAME_MAX (2 * VN_MANGLE_KEEP + 32 + 1)

/* The six parameter sets of docs/FORMAT.md, derived once at registration. */
struct vn_keys {
	struct vn_umash_params chunk;
	struct vn_umash_params directory;
	struct vn_umash_params header;
	struct vn_umash_params path;
	struct vn_umash_params hostname;
	struct vn_umash_params mangling;
	struct vn_umash_fp zero_chunk; /* fingerprint of 64 KiB of zeros */
	/* UMASH's fingerprint is the pair (primary hash, secondary hash), so
	 * the primary alone (vn_umash_full(which = 0), half the work) checks a
	 * chunk against its name; checked once here, on 64 KiB of zeros. */
	int primary_is_full;
};

void vn_keys_derive(struct vn_keys *keys);

/* The manifest name of docs/FORMAT.md for `canon` on this host: 0, or
 * ENOMEM. */
int vn_manifest_name(const struct vn_keys *keys, const char *canon,
    char out[VN_MANIFEST_NAME_MAX]);

/* "%016x%2F%016x" */
void vn_chunk_name(uint64_t major, uint64_t minor,
    char out[VN_CHUNK_NAME_LEN + 1]);

/* The fingerprint a chunk name stands for: 0, or -1 if `name` is not
 * exactly a chunk name as vn_chunk_name() writes them (lowercase hex). */
int vn_parse_chunk_name(const char *name, uint64_t *major, uint64_t *minor);

#endif /* VN_NAMES_H */
