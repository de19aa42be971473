/*
 * Store object names as docs/FORMAT.md defines them: see names.h.
 */
#define _GNU_SOURCE
#include "names.h"

#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static_assert(2 * VN_MANGLE_KEEP + 32 < VN_MANGLE_THRESHOLD + 32,
    "a mangled name is shorter than the threshold plus a fingerprint");
static_assert(2 * VN_MANGLE_KEEP + 32 >= VN_MANGLE_THRESHOLD,
    "a mangled name is never as short as an unmangled one");
static_assert(VN_CHUNK_NAME_LEN == 16 + 3 + 16,
    "a chunk name is two 64-bit hex words around \"%2F\"");

/* docs/FORMAT.md: each key is an ASCII string zero-padded to the 32 bytes
 * vn_umash_params_derive() takes. */
#define VN_KEY_BYTES 32

static_assert(sizeof("verneuil path mangling params") <= VN_KEY_BYTES + 1,
    "the longest key fits its padding");

static void derive(struct vn_umash_params *p, const char *key)
{
	unsigned char padded[VN_KEY_BYTES] = { 0 };

	assert(strlen(key) <= sizeof(padded));
	memcpy(padded, key, strlen(key));
	vn_umash_params_derive(p, 0, padded);
}

void vn_keys_derive(struct vn_keys *keys)
{
	static const unsigned char zeros[VN_CHUNK_SIZE];

	derive(&keys->chunk, "verneuil db chunk params");
	derive(&keys->directory, "verneuil db directory params");
	derive(&keys->header, "verneuil sqlite header params");
	derive(&keys->path, "verneuil path params");
	derive(&keys->hostname, "verneuil hostname params");
	derive(&keys->mangling, "verneuil path mangling params");
	keys->zero_chunk = vn_umash_fprint(&keys->chunk, 0, zeros, sizeof(zeros));
	keys->primary_is_full = vn_umash_full(&keys->chunk, 0, 0, zeros,
	    sizeof(zeros)) == keys->zero_chunk.hash[0];
}

static const char hex_digits[] = "0123456789abcdef";

static void put_hex64(char *out, uint64_t v)
{
	for (int i = 15; i >= 0; i--) {
		out[i] = hex_digits[v & 15];
		v >>= 4;
	}
}

/* Hand-rolled: this runs for every chunk of every snapshot. */
void vn_chunk_name(uint64_t major, uint64_t minor,
    char out[VN_CHUNK_NAME_LEN + 1])
{
	put_hex64(out, major);
	memcpy(out + 16, "%2F", 3);
	put_hex64(out + 19, minor);
	out[VN_CHUNK_NAME_LEN] = 0;
}

int vn_parse_chunk_name(const char *name, uint64_t *major, uint64_t *minor)
{
	char hex[17];
	char *end;

	if (strlen(name) != VN_CHUNK_NAME_LEN || memcmp(name + 16, "%2F", 3) != 0)
		return -1;
	for (int i = 0; i < VN_CHUNK_NAME_LEN; i++) {
		if (i >= 16 && i < 19)
			continue;
		if (!isxdigit((unsigned char)name[i]) || isupper((unsigned char)name[i]))
			return -1;
	}
	memcpy(hex, name, 16);
	hex[16] = 0;
	*major = strtoull(hex, &end, 16);
	memcpy(hex, name + 19, 16);
	*minor = strtoull(hex, &end, 16);
	return 0;
}

/* First line of /etc/hostname, trimmed; gethostname() if missing or empty
 * (as verneuil_fuse.format.local_hostname). */
static void local_hostname(char *out, size_t cap)
{
	FILE *f = fopen("/etc/hostname", "re");
	size_t n, start = 0;

	out[0] = 0;
	if (f != NULL) {
		if (fgets(out, (int)cap, f) == NULL)
			out[0] = 0;
		fclose(f);
	}
	n = strcspn(out, "\n");
	out[n] = 0;
	while (n > 0 && isspace((unsigned char)out[n - 1]))
		out[--n] = 0;
	while (isspace((unsigned char)out[start]))
		start++;
	memmove(out, out + start, n - start + 1);
	if (out[0] == 0 && gethostname(out, cap) != 0)
		out[0] = 0;
	out[cap - 1] = 0;
}

static int unreserved(unsigned char c)
{
	return isalnum(c) || strchr("!-_.*'()", c) != NULL;
}

int vn_manifest_name(const struct vn_keys *keys, const char *canon,
    char out[VN_MANIFEST_NAME_MAX])
{
	char host[256];
	char *raw, *enc;
	size_t raw_len, n = 0;
	uint64_t hh, ph;

	local_hostname(host, sizeof(host));
	hh = vn_umash_full(&keys->hostname, 0, 0, host, strlen(host)) % 65536;
	ph = vn_umash_full(&keys->path, 0, 0, canon, strlen(canon)) % 65536;
	raw_len = strlen(host) + strlen(canon) + 32;
	raw = malloc(raw_len);
	enc = malloc(3 * raw_len + 1);
	if (raw == NULL || enc == NULL) {
		free(raw);
		free(enc);
		return ENOMEM;
	}
	snprintf(raw, raw_len, "%04llx-verneuil:%s:%04llx/%s",
	    (unsigned long long)hh, host, (unsigned long long)ph, canon);
	for (const unsigned char *p = (const unsigned char *)raw; *p; p++) {
		if (unreserved(*p)) {
			enc[n++] = (char)*p;
		} else {
			snprintf(enc + n, 4, "%%%02X", *p);
			n += 3;
		}
	}
	enc[n] = 0;
	if (n >= VN_MANGLE_THRESHOLD) {
		struct vn_umash_fp fp =
		    vn_umash_fprint(&keys->mangling, 0, enc, n);

		memcpy(out, enc, VN_MANGLE_KEEP);
		snprintf(out + VN_MANGLE_KEEP, 33, "%016llx%016llx",
		    (unsigned long long)fp.hash[0],
		    (unsigned long long)fp.hash[1]);
		memcpy(out + VN_MANGLE_KEEP + 32, enc + n - VN_MANGLE_KEEP,
		    VN_MANGLE_KEEP);
		out[2 * VN_MANGLE_KEEP + 32] = 0;
	} else {
		memcpy(out, enc, n + 1);
	}
	free(raw);
	free(enc);
	return 0;
}
