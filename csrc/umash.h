/*
 * UMASH: 64-bit hashes and 128-bit fingerprints (the public algorithm of
 * backtrace-labs/umash, implemented afresh for this project).
 *
 * The bytes of every hash are part of the wire format (docs/FORMAT.md): chunk
 * names, manifest names and manifest checksums are UMASH values, so this
 * implementation must agree bit for bit with the reference library.  The
 * test vectors in tests/data/umash_verneuil.json pin that down.
 *
 * No hidden state: the only global is the selected implementation (CLMUL or
 * portable), chosen once from CPUID and overridable for tests.
 */
#ifndef VN_UMASH_H
#define VN_UMASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Number of OH (compression) key words: 32 for the block, 2 for twisting. */
#define VN_UMASH_OH_PARAM_COUNT 32
#define VN_UMASH_OH_TWISTING_COUNT 2

struct vn_umash_params {
	/* poly[i] = { f^2 mod 2^61-1, f } for the two polynomial hashes. */
	uint64_t poly[2][2];
	uint64_t oh[VN_UMASH_OH_PARAM_COUNT + VN_UMASH_OH_TWISTING_COUNT];
};

struct vn_umash_fp {
	uint64_t hash[2]; /* hash[0] = major (primary), hash[1] = minor */
};

/*
 * Derives parameters from a 32-byte key (Salsa20 keystream with `bits` as
 * the nonce, then rejection sampling), like umash_params_derive.
 * `key` may be NULL for the library's default key.
 */
void vn_umash_params_derive(struct vn_umash_params *params, uint64_t bits,
    const void *key);

/* 64-bit hash; which = 0 for the primary, 1 for the secondary hash. */
uint64_t vn_umash_full(const struct vn_umash_params *params, uint64_t seed,
    int which, const void *data, size_t n_bytes);

/* 128-bit fingerprint: both hashes at once (one pass over the data). */
struct vn_umash_fp vn_umash_fprint(const struct vn_umash_params *params,
    uint64_t seed, const void *data, size_t n_bytes);

/* Implementations, for tests and benchmarks. */
enum vn_umash_impl {
	VN_UMASH_IMPL_AUTO = 0,     /* CLMUL if the CPU has it, else portable */
	VN_UMASH_IMPL_PORTABLE = 1, /* plain C carry-less multiply */
	VN_UMASH_IMPL_CLMUL = 2,    /* PCLMULQDQ (x86-64) */
};

/*
 * Selects the implementation; returns the one now active (AUTO resolves to
 * the best available; asking for CLMUL on a CPU without it keeps portable).
 */
int vn_umash_select_impl(int impl);

/* The implementation now active (never AUTO). */
int vn_umash_active_impl(void);

#ifdef __cplusplus
}
#endif

#endif /* VN_UMASH_H */
