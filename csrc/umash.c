/*
 * UMASH hashes and fingerprints; see umash.h for the interface and
 * docs/FORMAT.md ("Fingerprints: UMASH") for why every output bit matters.
 *
 * This is an independent implementation of the public UMASH algorithm
 * (backtrace-labs/umash).  A quick tour of what is computed:
 *
 *   - Inputs of at most 8 bytes are packed into one 64-bit word and mixed
 *     with a SplitMix64-style xor-shift-multiply sequence, into which a
 *     key word chosen by the input length (plus the seed) is xored.
 *
 *   - Longer inputs are cut into 256-byte blocks of sixteen 16-byte chunks
 *     (the last block may be shorter, always a whole number of chunks: the
 *     final chunk is simply the last 16 bytes of the input, which may
 *     overlap the previous chunk).  Each block is compressed to 128 bits by
 *     "OH": every chunk but the last is xored with its 16 key bytes and its
 *     two 64-bit halves are multiplied without carries ("PH"); the last
 *     chunk is added to its key words and its halves multiplied as integers
 *     ("NH"), the block's tag (seed ^ byte size mod 256) being added to the
 *     high half of that product ("ENH").  All the products are xored.
 *
 *   - The two 64-bit halves of every compressed block feed a polynomial
 *     hash modulo 2^64 - 8 (= 8 * (2^61 - 1)), whose multiplier f is a
 *     random element of Z/(2^61 - 1); two Horner steps are fused into one
 *     by precomputing f^2.  A xor-rotate finaliser scrambles the result.
 *
 *   - The secondary hash (the fingerprint's second half) reuses all the
 *     PH/ENH products of a block, but xors them after per-lane left shifts
 *     that depend on the chunk's position, plus the PH of a checksum chunk:
 *     the xor of every (chunk ^ key) with two extra "twisting" key words.
 *     That sum goes to a second, independent polynomial hash.
 *
 * Two implementations of the PH product (and of the block loops around it)
 * exist: plain C, and x86-64 PCLMULQDQ.  They compute exactly the same
 * values; the CLMUL one is picked at run time when the CPU supports it.
 *
 * Data may have any alignment; it is read with unaligned little-endian
 * loads.  Every function is reentrant: the only global is the pointer to
 * the selected implementation, which is accessed atomically.
 */
#include "umash.h"

#include <assert.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Build with -DVN_UMASH_HAVE_CLMUL=0 to leave only the portable code. */
#ifndef VN_UMASH_HAVE_CLMUL
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VN_UMASH_HAVE_CLMUL 1
#else
#define VN_UMASH_HAVE_CLMUL 0
#endif
#endif

#if VN_UMASH_HAVE_CLMUL
#include <immintrin.h>
#endif

/*
 * Layout assumptions.  The key schedule writes the Salsa20 keystream into
 * the parameters word by word, in declaration order, exactly like the
 * reference library fills its own struct: 4 polynomial words, then 34 OH
 * words.
 */
static_assert(VN_UMASH_OH_PARAM_COUNT == 32, "a block is 16 chunks of 16 bytes");
static_assert(VN_UMASH_OH_TWISTING_COUNT == 2, "one extra chunk of key for the checksum");
static_assert(offsetof(struct vn_umash_params, poly) == 0, "poly comes first");
static_assert(offsetof(struct vn_umash_params, oh) == 4 * sizeof(uint64_t),
    "oh follows poly");
static_assert(sizeof(struct vn_umash_params) == 38 * sizeof(uint64_t),
    "params are 38 packed u64 words (304 bytes)");
static_assert(sizeof(struct vn_umash_fp) == 2 * sizeof(uint64_t), "fp is two u64");

#define CHUNK_BYTES 16
#define CHUNKS_PER_BLOCK (VN_UMASH_OH_PARAM_COUNT / 2)
#define BLOCK_BYTES (CHUNK_BYTES * CHUNKS_PER_BLOCK)
/* A full block has 15 PH chunks followed by the ENH chunk. */
#define PH_PER_BLOCK (CHUNKS_PER_BLOCK - 1)
/* Key words for the checksum ("twisting") chunk of the secondary hash. */
#define TWIST_KEY VN_UMASH_OH_PARAM_COUNT
/* The secondary short hash uses the OH key words four positions later. */
#define SHORT_SECONDARY_SHIFT 4

static_assert(BLOCK_BYTES == 256, "UMASH blocks are 256 bytes");

#ifdef __GNUC__
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

/* ------------------------------------------------------------------ */
/* Little-endian loads (the reference reads words natively on x86-64). */

static inline uint64_t
load_le64(const void *p)
{
	uint64_t v;

	memcpy(&v, p, sizeof(v));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
	v = __builtin_bswap64(v);
#endif
	return v;
}

static inline uint32_t
load_le32(const void *p)
{
	const uint8_t *b = p;

	return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
	    (uint32_t)b[3] << 24;
}

/* ------------------------------------------------------------------ */
/* 64 x 64 -> 128 bit integer multiplication. */

#ifdef __SIZEOF_INT128__
__extension__ typedef unsigned __int128 vn_u128;

static inline uint64_t
mul_full(uint64_t a, uint64_t b, uint64_t *hi)
{
	vn_u128 p = (vn_u128)a * b;

	*hi = (uint64_t)(p >> 64);
	return (uint64_t)p;
}
#else
static inline uint64_t
mul_full(uint64_t a, uint64_t b, uint64_t *hi)
{
	/* Schoolbook on 32-bit digits. */
	uint64_t a0 = (uint32_t)a, a1 = a >> 32, b0 = (uint32_t)b, b1 = b >> 32;
	uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
	uint64_t mid = (p00 >> 32) + (uint32_t)p01 + (uint32_t)p10;

	*hi = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
	return (mid << 32) | (uint32_t)p00;
}
#endif

/* ------------------------------------------------------------------ */
/*
 * Arithmetic modulo P = 2^64 - 8.
 *
 * 2^64 is congruent to 8 modulo P, so a carry out of bit 63 is worth 8, and
 * the high word h of a 128-bit product is worth 8 * h.  Polynomial
 * multipliers are below 2^61, so 8 * h always fits in 64 bits.  Between
 * Horner steps the accumulator is kept canonical (in [0, P)): the hash
 * value depends on the exact representative, and the canonical one is what
 * the reference library produces.
 */

#define MOD_P_NEG ((uint64_t)8) /* 2^64 mod P */

/* x mod P for any 64-bit x: only [P, 2^64) needs folding. */
static inline uint64_t
mod_p_canonical(uint64_t x)
{
	return (x >= (uint64_t)0 - MOD_P_NEG) ? x + MOD_P_NEG : x;
}

/*
 * x + y modulo P, not necessarily canonical.  Only valid when the sum's
 * carry-adjusted value cannot overflow again, i.e. when x + y < 2^65 - 8;
 * that holds whenever one operand is canonical or below 2^64 - 8.
 */
static inline uint64_t
add_mod_p_lazy(uint64_t x, uint64_t y)
{
	uint64_t sum;

	if (__builtin_add_overflow(x, y, &sum))
		sum += MOD_P_NEG;
	return sum;
}

/* x + y modulo P for arbitrary x and y; the result is canonical. */
static inline uint64_t
add_mod_p(uint64_t x, uint64_t y)
{
	uint64_t sum;
	uint64_t carry = __builtin_add_overflow(x, y, &sum);

	/* Fold the sum below P first, so that adding the carry's 8 cannot wrap. */
	sum = mod_p_canonical(sum) + carry * MOD_P_NEG;
	return mod_p_canonical(sum);
}

/* m * x modulo P, for m < 2^61; not necessarily canonical. */
static inline uint64_t
mul_mod_p(uint64_t m, uint64_t x)
{
	uint64_t hi, lo = mul_full(m, x, &hi);

	/* hi < 2^61, so 8 * hi <= P and lo + 8 * hi < 2^65 - 8. */
	return add_mod_p_lazy(lo, hi << 3);
}

/*
 * Two Horner steps at once: ((acc + a) * f + b) * f, rearranged as
 * (acc + a) * f^2 + b * f with f^2 precomputed (and reduced mod 2^61 - 1,
 * which keeps it a fast multiplier and changes nothing modulo 2^61 - 1).
 * `acc` must be canonical; so is the result.
 */
static inline uint64_t
horner2(uint64_t acc, uint64_t f_sq, uint64_t f, uint64_t a, uint64_t b)
{
	uint64_t t = add_mod_p_lazy(acc, a);

	return add_mod_p(mul_mod_p(f_sq, t), mul_mod_p(f, b));
}

static inline uint64_t
rotl64(uint64_t x, unsigned n)
{
	return (x << n) | (x >> (64 - n));
}

/* Invertible xor-rotate finaliser applied to every long hash. */
static inline uint64_t
finalize(uint64_t x)
{
	return x ^ rotl64(x, 8) ^ rotl64(x, 33);
}

/* ------------------------------------------------------------------ */
/* Key schedule: Salsa20/20 keystream, then rejection of weak values. */

static inline uint32_t
rotl32(uint32_t x, unsigned n)
{
	return (x << n) | (x >> (32 - n));
}

/* One Salsa20 quarter-round on state words a, b, c, d. */
#define SALSA_QR(s, a, b, c, d)                             \
	do {                                                \
		s[b] ^= rotl32(s[a] + s[d], 7);             \
		s[c] ^= rotl32(s[b] + s[a], 9);             \
		s[d] ^= rotl32(s[c] + s[b], 13);            \
		s[a] ^= rotl32(s[d] + s[c], 18);            \
	} while (0)

/* The Salsa20/20 core: 64 output bytes (as 16 words) from the input state. */
static void
salsa20_core(uint32_t out[16], const uint32_t in[16])
{
	uint32_t s[16];

	memcpy(s, in, sizeof(s));
	for (int round = 0; round < 20; round += 2) {
		/* Column round: each quarter-round walks down one column. */
		SALSA_QR(s, 0, 4, 8, 12);
		SALSA_QR(s, 5, 9, 13, 1);
		SALSA_QR(s, 10, 14, 2, 6);
		SALSA_QR(s, 15, 3, 7, 11);
		/* Row round: the same along each row. */
		SALSA_QR(s, 0, 1, 2, 3);
		SALSA_QR(s, 5, 6, 7, 4);
		SALSA_QR(s, 10, 11, 8, 9);
		SALSA_QR(s, 15, 12, 13, 14);
	}

	for (int i = 0; i < 16; i++)
		out[i] = s[i] + in[i];
}

#undef SALSA_QR

/*
 * Fills `dst` with `n_words` little-endian 64-bit words of the Salsa20
 * keystream for a 32-byte key and a 64-bit nonce, with the block counter
 * starting at zero.
 */
static void
salsa20_words(uint64_t *dst, size_t n_words, const uint8_t key[32], uint64_t nonce)
{
	/* "expand 32-byte k", as four little-endian words. */
	static const uint32_t sigma[4] = { 0x61707865, 0x3320646e, 0x79622d32,
		0x6b206574 };
	uint32_t state[16];
	uint64_t counter = 0;

	state[0] = sigma[0];
	state[5] = sigma[1];
	state[10] = sigma[2];
	state[15] = sigma[3];
	for (int i = 0; i < 4; i++) {
		state[1 + i] = load_le32(key + 4 * i);
		state[11 + i] = load_le32(key + 16 + 4 * i);
	}
	state[6] = (uint32_t)nonce;
	state[7] = (uint32_t)(nonce >> 32);

	while (n_words > 0) {
		uint32_t block[16];
		size_t take = n_words < 8 ? n_words : 8;

		state[8] = (uint32_t)counter;
		state[9] = (uint32_t)(counter >> 32);
		salsa20_core(block, state);
		counter++;

		/* Word pairs combine as low then high: the stream is little-endian. */
		for (size_t i = 0; i < take; i++)
			dst[i] = (uint64_t)block[2 * i] | (uint64_t)block[2 * i + 1] << 32;
		dst += take;
		n_words -= take;
	}
}

static bool
value_seen(const uint64_t *values, size_t n, uint64_t needle)
{
	for (size_t i = 0; i < n; i++) {
		if (values[i] == needle)
			return true;
	}

	return false;
}

/*
 * Turns raw keystream words into usable parameters, in place:
 *
 *  - each polynomial multiplier f (the second word of poly[i]) is cut to
 *    61 bits and must be a nonzero element of Z/(2^61 - 1), i.e. neither 0
 *    nor 2^61 - 1; the first word of poly[i] is then overwritten with
 *    f^2 mod 2^61 - 1;
 *  - the 34 OH words must be pairwise distinct.
 *
 * Rejected values are replaced with the raw (pre-overwrite) first words of
 * poly[0] and poly[1], in that order.  If those two spares run out, the
 * keystream is unusable and we return false.
 */
static bool
params_prepare(struct vn_umash_params *params)
{
	const uint64_t m61 = ((uint64_t)1 << 61) - 1;
	const uint64_t spares[2] = { params->poly[0][0], params->poly[1][0] };
	size_t next_spare = 0;

	for (size_t i = 0; i < 2; i++) {
		uint64_t f = params->poly[i][1] & m61;
		uint64_t hi, lo;

		while (f == 0 || f == m61) {
			if (next_spare >= 2)
				return false;
			f = spares[next_spare++] & m61;
		}

		/* f^2 < 2^122; reduce mod 2^61 - 1 by folding at bit 61. */
		lo = mul_full(f, f, &hi);
		{
			uint64_t low61 = lo & m61;
			uint64_t rest = (lo >> 61) | (hi << 3); /* < 2^61 */
			uint64_t sq = low61 + rest;		/* < 2^62 */

			sq = (sq & m61) + (sq >> 61);
			if (sq >= m61)
				sq -= m61;
			params->poly[i][0] = sq;
		}
		params->poly[i][1] = f;
	}

	for (size_t i = 0; i < VN_UMASH_OH_PARAM_COUNT + VN_UMASH_OH_TWISTING_COUNT; i++) {
		while (value_seen(params->oh, i, params->oh[i])) {
			if (next_spare >= 2)
				return false;
			params->oh[i] = spares[next_spare++];
		}
	}

	return true;
}

void
vn_umash_params_derive(struct vn_umash_params *params, uint64_t bits, const void *key)
{
	/* The reference library's built-in key (exactly 32 bytes, no NUL). */
	static const char default_key[] = "Do not use UMASH VS adversaries.";
	uint8_t key_bytes[32];

	static_assert(sizeof(default_key) == sizeof(key_bytes) + 1, "32-byte key");
	memcpy(key_bytes, key != NULL ? key : (const void *)default_key, sizeof(key_bytes));

	for (;;) {
		uint64_t words[sizeof(*params) / sizeof(uint64_t)];

		salsa20_words(words, sizeof(words) / sizeof(words[0]), key_bytes, bits);
		memcpy(params, words, sizeof(*params));
		if (params_prepare(params))
			return;
		/* Astronomically unlikely: try the next nonce. */
		bits++;
	}
}

/* ------------------------------------------------------------------ */
/* Inputs of 0 to 8 bytes. */

/*
 * Packs up to 8 bytes into a word, injectively for each length (different
 * lengths may collide; the length-dependent key word separates them).
 * Four or more bytes: the first and last 4 (overlapping if needed).  Fewer:
 * the first byte if the length is odd, the last two if it is 2 or 3.
 */
static inline uint64_t
short_pack(const uint8_t *data, size_t n)
{
	uint32_t lo = 0, hi = 0;

	if (n >= 4) {
		lo = load_le32(data);
		hi = load_le32(data + n - 4);
	} else {
		if (n & 1)
			lo = data[0];
		if (n & 2)
			hi = (uint32_t)data[n - 2] | (uint32_t)data[n - 1] << 8;
	}

	/* Spread the high half into the low bits as well (32-bit add). */
	return (uint64_t)hi << 32 | (uint32_t)(lo + hi);
}

/* First half of SplitMix64's output function. */
static inline uint64_t
short_mix_head(uint64_t h)
{
	h ^= h >> 30;
	h *= 0xbf58476d1ce4e5b9ULL;
	h ^= h >> 27;
	return h;
}

/* Second half, after xoring in the (seed + length-selected key) noise. */
static inline uint64_t
short_mix_tail(uint64_t h, uint64_t noise)
{
	h ^= noise;
	h *= 0x94d049bb133111ebULL;
	h ^= h >> 31;
	return h;
}

/* ------------------------------------------------------------------ */
/* OH block compression: pieces shared by both implementations. */

struct oh128 {
	uint64_t lo, hi;
};

/*
 * ENH of the final chunk of a block: (x + k0) * (y + k1) as a 128-bit
 * integer, plus tag * 2^64.  The compressed value then gets its low half
 * xored into its high half.  Returns that mixed pair.
 */
static ALWAYS_INLINE struct oh128
enh_mix(const uint64_t *k, uint64_t tag, const uint8_t *chunk)
{
	uint64_t x = load_le64(chunk) + k[0];
	uint64_t y = load_le64(chunk + 8) + k[1];
	uint64_t hi, lo = mul_full(x, y, &hi);

	hi += tag;
	return (struct oh128) { .lo = lo, .hi = hi ^ lo };
}

/*
 * Layout of the compressor entry points.  A block is `n_ph` PH chunks read
 * consecutively from `ph` (keyed by k[0 .. 2 n_ph - 1]) followed by the ENH
 * chunk at `last` (keyed by k[2 n_ph], k[2 n_ph + 1]); `last` may overlap
 * the PH chunks.  The fingerprint variants return { primary, secondary }.
 *
 * The "blocks" functions run full 256-byte blocks (tag = seed) through the
 * polynomial hash(es), starting from and returning canonical accumulators.
 */
struct oh_impl {
	int id;
	struct oh128 (*tail)(const uint64_t *k, uint64_t tag, const uint8_t *ph,
	    size_t n_ph, const uint8_t *last);
	void (*tail_fp)(struct oh128 out[2], const uint64_t *k, uint64_t tag,
	    const uint8_t *ph, size_t n_ph, const uint8_t *last);
	uint64_t (*blocks)(uint64_t acc, const struct vn_umash_params *params,
	    uint64_t seed, const uint8_t *data, size_t n_blocks);
	void (*blocks_fp)(uint64_t acc[2], const struct vn_umash_params *params,
	    uint64_t seed, const uint8_t *data, size_t n_blocks);
};

/* ------------------------------------------------------------------ */
/* Portable implementation. */

/*
 * Carry-less (GF(2)[x]) product of two 64-bit polynomials, 128-bit result.
 * Four bits of `a` at a time: precompute b times every polynomial of degree
 * < 4 (up to 67 bits, so as lo/hi pairs), then shift-and-xor in a table row
 * per nibble of `a`, from the top nibble down.
 */
static inline struct oh128
clmul64_portable(uint64_t a, uint64_t b)
{
	uint64_t tab_lo[16], tab_hi[16];
	uint64_t lo = 0, hi = 0;

	tab_lo[0] = 0;
	tab_hi[0] = 0;
	tab_lo[1] = b;
	tab_hi[1] = 0;
	for (int i = 2; i < 16; i += 2) {
		/* b * (2j) = (b * j) << 1; b * (2j + 1) = that ^ b. */
		tab_lo[i] = tab_lo[i / 2] << 1;
		tab_hi[i] = (tab_hi[i / 2] << 1) | (tab_lo[i / 2] >> 63);
		tab_lo[i + 1] = tab_lo[i] ^ b;
		tab_hi[i + 1] = tab_hi[i];
	}

	for (int shift = 60; shift >= 0; shift -= 4) {
		unsigned nibble = (unsigned)(a >> shift) & 15;

		hi = (hi << 4) | (lo >> 60);
		lo <<= 4;
		lo ^= tab_lo[nibble];
		hi ^= tab_hi[nibble];
	}

	return (struct oh128) { .lo = lo, .hi = hi };
}

/* Primary OH: xor of the PH products, then of the mixed ENH. */
static ALWAYS_INLINE struct oh128
oh_portable_inline(const uint64_t *k, uint64_t tag, const uint8_t *ph, size_t n_ph,
    const uint8_t *last)
{
	struct oh128 acc = { 0, 0 }, enh;

	for (size_t i = 0; i < n_ph; i++) {
		uint64_t a = load_le64(ph + CHUNK_BYTES * i) ^ k[2 * i];
		uint64_t b = load_le64(ph + CHUNK_BYTES * i + 8) ^ k[2 * i + 1];
		struct oh128 p = clmul64_portable(a, b);

		acc.lo ^= p.lo;
		acc.hi ^= p.hi;
	}

	enh = enh_mix(k + 2 * n_ph, tag, last);
	acc.lo ^= enh.lo;
	acc.hi ^= enh.hi;
	return acc;
}

/*
 * Both OH values.  Besides the primary xor, we build:
 *
 *   twist: the PH product of chunk i (0-based, n PH chunks) enters shifted
 *          left by n - i and by 1, each shift done separately on the two
 *          64-bit lanes; the last PH product (i = n - 1) only by 1.  This
 *          is evaluated Horner-style: `twist = (twist ^ prev) << 1` every
 *          chunk, then one final `(twist ^ primary) << 1`.
 *   lrc:   xor of every (chunk ^ key), ENH chunk included, plus the two
 *          twisting key words; its PH product is xored into the twist.
 *
 * The mixed ENH value goes into both.
 */
static ALWAYS_INLINE void
oh_fp_portable_inline(struct oh128 out[2], const uint64_t *k, uint64_t tag,
    const uint8_t *ph, size_t n_ph, const uint8_t *last)
{
	struct oh128 acc = { 0, 0 }, twist = { 0, 0 }, prev = { 0, 0 }, enh, lrc_mixed;
	uint64_t lrc0 = k[TWIST_KEY], lrc1 = k[TWIST_KEY + 1];
	const uint64_t *kl = k + 2 * n_ph;

	for (size_t i = 0; i < n_ph; i++) {
		uint64_t a = load_le64(ph + CHUNK_BYTES * i) ^ k[2 * i];
		uint64_t b = load_le64(ph + CHUNK_BYTES * i + 8) ^ k[2 * i + 1];
		struct oh128 p = clmul64_portable(a, b);

		lrc0 ^= a;
		lrc1 ^= b;
		acc.lo ^= p.lo;
		acc.hi ^= p.hi;
		twist.lo = (twist.lo ^ prev.lo) << 1;
		twist.hi = (twist.hi ^ prev.hi) << 1;
		prev = p;
	}

	lrc0 ^= load_le64(last) ^ kl[0];
	lrc1 ^= load_le64(last + 8) ^ kl[1];
	lrc_mixed = clmul64_portable(lrc0, lrc1);
	twist.lo = ((twist.lo ^ acc.lo) << 1) ^ lrc_mixed.lo;
	twist.hi = ((twist.hi ^ acc.hi) << 1) ^ lrc_mixed.hi;

	enh = enh_mix(kl, tag, last);
	out[0] = (struct oh128) { acc.lo ^ enh.lo, acc.hi ^ enh.hi };
	out[1] = (struct oh128) { twist.lo ^ enh.lo, twist.hi ^ enh.hi };
}

static struct oh128
tail_portable(const uint64_t *k, uint64_t tag, const uint8_t *ph, size_t n_ph,
    const uint8_t *last)
{
	return oh_portable_inline(k, tag, ph, n_ph, last);
}

static void
tail_fp_portable(struct oh128 out[2], const uint64_t *k, uint64_t tag,
    const uint8_t *ph, size_t n_ph, const uint8_t *last)
{
	oh_fp_portable_inline(out, k, tag, ph, n_ph, last);
}

static uint64_t
blocks_portable(uint64_t acc, const struct vn_umash_params *params, uint64_t seed,
    const uint8_t *data, size_t n_blocks)
{
	for (; n_blocks > 0; n_blocks--, data += BLOCK_BYTES) {
		struct oh128 h = oh_portable_inline(params->oh, seed, data, PH_PER_BLOCK,
		    data + BLOCK_BYTES - CHUNK_BYTES);

		acc = horner2(acc, params->poly[0][0], params->poly[0][1], h.lo, h.hi);
	}

	return acc;
}

static void
blocks_fp_portable(uint64_t acc[2], const struct vn_umash_params *params, uint64_t seed,
    const uint8_t *data, size_t n_blocks)
{
	for (; n_blocks > 0; n_blocks--, data += BLOCK_BYTES) {
		struct oh128 h[2];

		oh_fp_portable_inline(h, params->oh, seed, data, PH_PER_BLOCK,
		    data + BLOCK_BYTES - CHUNK_BYTES);
		for (int i = 0; i < 2; i++) {
			acc[i] = horner2(acc[i], params->poly[i][0], params->poly[i][1],
			    h[i].lo, h[i].hi);
		}
	}
}

static const struct oh_impl impl_portable = {
	.id = VN_UMASH_IMPL_PORTABLE,
	.tail = tail_portable,
	.tail_fp = tail_fp_portable,
	.blocks = blocks_portable,
	.blocks_fp = blocks_fp_portable,
};

/* ------------------------------------------------------------------ */
/* PCLMULQDQ implementation (x86-64). */

#if VN_UMASH_HAVE_CLMUL
/*
 * Only these functions may use PCLMULQDQ; the rest of the file is built
 * for the baseline ISA, so no -m flag is needed.
 */
#define CLMUL_TARGET __attribute__((target("pclmul,sse2")))

/*
 * PH of one chunk: xor the 16 data bytes with 16 key bytes, then multiply
 * the high 64-bit lane by the low one without carries (immediate 0x01
 * selects the first operand's high lane and the second's low lane).
 */
static CLMUL_TARGET ALWAYS_INLINE __m128i
ph_clmul(const uint8_t *chunk, const uint64_t *k, __m128i *keyed)
{
	__m128i x = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)chunk),
	    _mm_loadu_si128((const __m128i *)(const void *)k));

	*keyed = x;
	return _mm_clmulepi64_si128(x, x, 0x01);
}

static CLMUL_TARGET ALWAYS_INLINE struct oh128
oh128_from_vec(__m128i v)
{
	struct oh128 r;

	_mm_storeu_si128((__m128i *)(void *)&r, v);
	return r;
}

/* Same as oh_portable_inline. */
static CLMUL_TARGET ALWAYS_INLINE struct oh128
oh_clmul_inline(const uint64_t *k, uint64_t tag, const uint8_t *ph, size_t n_ph,
    const uint8_t *last)
{
	__m128i acc = _mm_setzero_si128();
	struct oh128 r, enh;

#ifdef __GNUC__
#pragma GCC unroll 16
#endif
	for (size_t i = 0; i < n_ph; i++) {
		__m128i keyed;

		acc = _mm_xor_si128(acc, ph_clmul(ph + CHUNK_BYTES * i, k + 2 * i, &keyed));
	}

	r = oh128_from_vec(acc);
	enh = enh_mix(k + 2 * n_ph, tag, last);
	r.lo ^= enh.lo;
	r.hi ^= enh.hi;
	return r;
}

/*
 * Same as oh_fp_portable_inline.  The per-lane shift left by one is an
 * add of the vector to itself.
 */
static CLMUL_TARGET ALWAYS_INLINE void
oh_fp_clmul_inline(struct oh128 out[2], const uint64_t *k, uint64_t tag,
    const uint8_t *ph, size_t n_ph, const uint8_t *last)
{
	__m128i acc = _mm_setzero_si128();
	__m128i twist = _mm_setzero_si128();
	__m128i prev = _mm_setzero_si128();
	__m128i lrc = _mm_loadu_si128((const __m128i *)(const void *)(k + TWIST_KEY));
	const uint64_t *kl = k + 2 * n_ph;
	struct oh128 enh, primary, secondary;

#ifdef __GNUC__
#pragma GCC unroll 16
#endif
	for (size_t i = 0; i < n_ph; i++) {
		__m128i keyed, p;

		p = ph_clmul(ph + CHUNK_BYTES * i, k + 2 * i, &keyed);
		lrc = _mm_xor_si128(lrc, keyed);
		acc = _mm_xor_si128(acc, p);
		twist = _mm_xor_si128(twist, prev);
		twist = _mm_add_epi64(twist, twist);
		prev = p;
	}

	lrc = _mm_xor_si128(lrc,
	    _mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)last),
		_mm_loadu_si128((const __m128i *)(const void *)kl)));
	twist = _mm_xor_si128(twist, acc);
	twist = _mm_add_epi64(twist, twist);
	twist = _mm_xor_si128(twist, _mm_clmulepi64_si128(lrc, lrc, 0x01));

	primary = oh128_from_vec(acc);
	secondary = oh128_from_vec(twist);
	enh = enh_mix(kl, tag, last);
	out[0] = (struct oh128) { primary.lo ^ enh.lo, primary.hi ^ enh.hi };
	out[1] = (struct oh128) { secondary.lo ^ enh.lo, secondary.hi ^ enh.hi };
}

static CLMUL_TARGET struct oh128
tail_clmul(const uint64_t *k, uint64_t tag, const uint8_t *ph, size_t n_ph,
    const uint8_t *last)
{
	return oh_clmul_inline(k, tag, ph, n_ph, last);
}

static CLMUL_TARGET void
tail_fp_clmul(struct oh128 out[2], const uint64_t *k, uint64_t tag, const uint8_t *ph,
    size_t n_ph, const uint8_t *last)
{
	oh_fp_clmul_inline(out, k, tag, ph, n_ph, last);
}

static CLMUL_TARGET uint64_t
blocks_clmul(uint64_t acc, const struct vn_umash_params *params, uint64_t seed,
    const uint8_t *data, size_t n_blocks)
{
	const uint64_t f_sq = params->poly[0][0], f = params->poly[0][1];

	for (; n_blocks > 0; n_blocks--, data += BLOCK_BYTES) {
		struct oh128 h = oh_clmul_inline(params->oh, seed, data, PH_PER_BLOCK,
		    data + BLOCK_BYTES - CHUNK_BYTES);

		acc = horner2(acc, f_sq, f, h.lo, h.hi);
	}

	return acc;
}

static CLMUL_TARGET void
blocks_fp_clmul(uint64_t acc[2], const struct vn_umash_params *params, uint64_t seed,
    const uint8_t *data, size_t n_blocks)
{
	uint64_t acc0 = acc[0], acc1 = acc[1];

	for (; n_blocks > 0; n_blocks--, data += BLOCK_BYTES) {
		struct oh128 h[2];

		oh_fp_clmul_inline(h, params->oh, seed, data, PH_PER_BLOCK,
		    data + BLOCK_BYTES - CHUNK_BYTES);
		acc0 = horner2(acc0, params->poly[0][0], params->poly[0][1], h[0].lo, h[0].hi);
		acc1 = horner2(acc1, params->poly[1][0], params->poly[1][1], h[1].lo, h[1].hi);
	}

	acc[0] = acc0;
	acc[1] = acc1;
}

static const struct oh_impl impl_clmul = {
	.id = VN_UMASH_IMPL_CLMUL,
	.tail = tail_clmul,
	.tail_fp = tail_fp_clmul,
	.blocks = blocks_clmul,
	.blocks_fp = blocks_fp_clmul,
};

static bool
cpu_has_clmul(void)
{
	__builtin_cpu_init();
	return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse2");
}
#endif /* VN_UMASH_HAVE_CLMUL */

/* ------------------------------------------------------------------ */
/* Implementation selection: the only global state in this file. */

static const struct oh_impl *_Atomic selected_impl = NULL;

static const struct oh_impl *
best_impl(void)
{
#if VN_UMASH_HAVE_CLMUL
	if (cpu_has_clmul())
		return &impl_clmul;
#endif
	return &impl_portable;
}

static inline const struct oh_impl *
current_impl(void)
{
	const struct oh_impl *impl =
	    atomic_load_explicit(&selected_impl, memory_order_relaxed);

	if (impl == NULL) {
		/* Racing first callers all compute and store the same pointer. */
		impl = best_impl();
		atomic_store_explicit(&selected_impl, impl, memory_order_relaxed);
	}

	return impl;
}

int
vn_umash_select_impl(int impl)
{
	const struct oh_impl *chosen;

	switch (impl) {
	case VN_UMASH_IMPL_PORTABLE:
		chosen = &impl_portable;
		break;
	case VN_UMASH_IMPL_CLMUL:
		/* Without CLMUL hardware, fall back to (and report) portable. */
		chosen = best_impl();
		break;
	default:
		chosen = best_impl();
		break;
	}

	atomic_store_explicit(&selected_impl, chosen, memory_order_relaxed);
	return chosen->id;
}

int
vn_umash_active_impl(void)
{
	return current_impl()->id;
}

/* ------------------------------------------------------------------ */
/* Hash drivers. */

/*
 * Inputs of 9 to 16 bytes form a single chunk: the first 8 bytes followed
 * by the last 8 (overlapping when n < 16), hashed as a one-chunk block with
 * tag seed ^ n.
 */
static inline void
medium_chunk(uint8_t chunk[CHUNK_BYTES], const uint8_t *data, size_t n)
{
	memcpy(chunk, data, 8);
	memcpy(chunk + 8, data + n - 8, 8);
}

/*
 * Inputs over 16 bytes: all 256-byte blocks except the last, then the last
 * block (1 to 256 bytes).  Its whole 16-byte chunks are PH-mixed and its
 * final chunk is the input's last 16 bytes; the tag carries its byte size
 * mod 256, which is what prevents extension attacks.
 */
struct long_split {
	size_t n_full;	       /* blocks before the last one */
	const uint8_t *tail;   /* start of the last block */
	size_t n_ph;	       /* PH chunks in the last block */
	const uint8_t *last;   /* the final (ENH) chunk */
	uint64_t size_tag;     /* last block size mod 256 */
};

static inline struct long_split
long_split(const uint8_t *data, size_t n)
{
	struct long_split s;
	size_t rem;

	s.n_full = (n - 1) / BLOCK_BYTES;
	s.tail = data + s.n_full * BLOCK_BYTES;
	rem = n - s.n_full * BLOCK_BYTES; /* 1 .. 256 */
	s.n_ph = (rem - 1) / CHUNK_BYTES;
	s.last = data + n - CHUNK_BYTES;
	s.size_tag = rem & (BLOCK_BYTES - 1);
	return s;
}

static uint64_t
umash_primary(const struct vn_umash_params *params, uint64_t seed, const uint8_t *data,
    size_t n)
{
	const struct oh_impl *impl;
	struct long_split s;
	struct oh128 h;
	uint64_t acc = 0;

	if (n <= 8) {
		uint64_t noise = seed + params->oh[n];

		return short_mix_tail(short_mix_head(short_pack(data, n)), noise);
	}

	impl = current_impl();
	if (n <= CHUNK_BYTES) {
		uint8_t chunk[CHUNK_BYTES];

		medium_chunk(chunk, data, n);
		h = impl->tail(params->oh, seed ^ n, NULL, 0, chunk);
	} else {
		s = long_split(data, n);
		if (s.n_full > 0)
			acc = impl->blocks(acc, params, seed, data, s.n_full);
		h = impl->tail(params->oh, seed ^ s.size_tag, s.tail, s.n_ph, s.last);
	}

	acc = horner2(acc, params->poly[0][0], params->poly[0][1], h.lo, h.hi);
	return finalize(acc);
}

struct vn_umash_fp
vn_umash_fprint(const struct vn_umash_params *params, uint64_t seed, const void *data,
    size_t n_bytes)
{
	const uint8_t *bytes = data;
	const struct oh_impl *impl;
	struct vn_umash_fp ret;
	struct oh128 h[2];
	uint64_t acc[2] = { 0, 0 };

	if (n_bytes <= 8) {
		uint64_t mixed = short_mix_head(short_pack(bytes, n_bytes));

		ret.hash[0] = short_mix_tail(mixed, seed + params->oh[n_bytes]);
		ret.hash[1] = short_mix_tail(
		    mixed, seed + params->oh[n_bytes + SHORT_SECONDARY_SHIFT]);
		return ret;
	}

	impl = current_impl();
	if (n_bytes <= CHUNK_BYTES) {
		uint8_t chunk[CHUNK_BYTES];

		medium_chunk(chunk, bytes, n_bytes);
		impl->tail_fp(h, params->oh, seed ^ n_bytes, NULL, 0, chunk);
	} else {
		struct long_split s = long_split(bytes, n_bytes);

		if (s.n_full > 0)
			impl->blocks_fp(acc, params, seed, bytes, s.n_full);
		impl->tail_fp(h, params->oh, seed ^ s.size_tag, s.tail, s.n_ph, s.last);
	}

	for (int i = 0; i < 2; i++) {
		acc[i] = horner2(acc[i], params->poly[i][0], params->poly[i][1], h[i].lo,
		    h[i].hi);
		ret.hash[i] = finalize(acc[i]);
	}

	return ret;
}

uint64_t
vn_umash_full(const struct vn_umash_params *params, uint64_t seed, int which,
    const void *data, size_t n_bytes)
{
	/* The secondary hash shares all its work with the fingerprint. */
	if (which != 0)
		return vn_umash_fprint(params, seed, data, n_bytes).hash[1];

	return umash_primary(params, seed, data, n_bytes);
}
