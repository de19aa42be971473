/*
 * A small protobuf encoder/decoder for the Manifest of docs/FORMAT.md
 * (proto/manifest.proto), just what the writer needs.
 *
 * The encoder writes fields in field-number order and omits proto3 default
 * scalars, like prost (Verneuil) and the Python protobuf runtime, so that
 * equal manifests have equal bytes.  The decoder accepts any valid encoding
 * (packed or unpacked `chunks`, unknown fields skipped).
 *
 * No I/O, no SQLite: plain bytes in, bytes out.
 */
#ifndef VN_MANIFEST_PB_H
#define VN_MANIFEST_PB_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "umash.h"

/* The producer tag this project writes in `generated_by` (docs/FORMAT.md). */
#define VN_GENERATED_BY "verneuil_fuse-v0.1.0"

/* Verneuil's cap on a decompressed manifest (docs/FORMAT.md): 384 MiB. */
#define VN_MAX_MANIFEST_BYTES ((size_t)3 << 27)

/* Longest version_id we produce or accept for incremental reuse: 16 bytes of
 * UUID (the xattr) + 16 bytes of header fingerprint, with room to spare for
 * another writer's xattr format. */
#define VN_MAX_VERSION_ID 64

/* Most bundled chunks besides chunk 0 that the encoder writes (sized for
 * btree_tops.h's VN_TOPS_MAX_CHUNKS). */
#define VN_MANIFEST_MAX_EXTRA 16

/* A bundled chunk other than chunk 0: its fingerprint is
 * chunks[2 * index .. 2 * index + 2). */
struct vn_bundled {
	uint64_t index;
	const uint8_t *data;
	size_t len;
};

struct vn_manifest {
	struct vn_umash_fp header_fprint;
	struct vn_umash_fp contents_fprint;
	int has_header_fprint;
	int has_contents_fprint;
	int has_base_chunks_fprint; /* the decoder reports it; we never write it */
	uint8_t version_id[VN_MAX_VERSION_ID];
	size_t version_id_len;
	uint64_t len;
	int64_t ctime;
	int32_t ctime_ns;
	/* 2 words per chunk: major, minor.  Decoder: malloc'ed, caller frees. */
	uint64_t *chunks;
	size_t n_words;
	/* Bundled chunk 0. */
	const uint8_t *bundled0;
	size_t bundled0_len;
	int has_bundled0;
	/* More bundled chunks, ascending index > 0 (b-tree tops): written
	 * after chunk 0, which must then be bundled too.  The decoder reports
	 * the first VN_MANIFEST_MAX_EXTRA, in the order found, with data
	 * pointing into its input. */
	struct vn_bundled extra[VN_MANIFEST_MAX_EXTRA];
	size_t n_extra;
};

/*
 * Encodes `m` (with chunk 0's bytes in bundled0/bundled0_len when
 * has_bundled0; its fingerprint is chunks[0..2]).  On success returns 0 and a
 * malloc'ed buffer in *out; -1 on allocation failure or oversize.
 */
int vn_manifest_encode(const struct vn_manifest *m, uint8_t **out,
    size_t *out_len);

/*
 * The encoding of `m` as pieces for one writev(2), so that the big arrays
 * (the chunk words and the bundled chunks) are written from where they are
 * instead of being copied into one buffer:
 *   iov[0] = head: every field before `chunks`, and the `chunks` key
 *   iov[1] = m->chunks (8 * n_words bytes, little-endian in memory)
 *   iov[2] = mid[0]: bundled chunk 0's key, fingerprint and bytes key
 *   iov[3] = m->bundled0
 *   then mid[k], m->extra[k - 1].data for each extra bundled chunk
 * (empty pieces are left out; iovcnt says how many there are).  The pieces
 * point into `parts` and into `m`'s arrays: keep both alive while writing.
 * The bytes are exactly those of vn_manifest_encode().
 */

/* Largest head: outer key and length (1 + 10), header fingerprint (2 + 18),
 * version_id (2 + VN_MAX_VERSION_ID), contents fingerprint (2 + 18), len
 * (1 + 10), ctime (1 + 10), ctime_ns (1 + 4), generated_by (2 + 20), chunks
 * key and length (1 + 10 + 1 spare); rounded up. */
#define VN_MANIFEST_HEAD_MAX 256

/* Largest mid: bundled key and length (2 + 10), chunk_index and
 * chunk_offset (1 + 10 each), fingerprint (2 + 18), bytes key and length
 * (1 + 10); rounded up. */
#define VN_MANIFEST_MID_MAX 80

/* Pieces of an encoding (see above). */
#define VN_MANIFEST_IOV (2 + 2 * (1 + VN_MANIFEST_MAX_EXTRA))

struct vn_manifest_parts {
	uint8_t head[VN_MANIFEST_HEAD_MAX];
	uint8_t mid[1 + VN_MANIFEST_MAX_EXTRA][VN_MANIFEST_MID_MAX];
	struct iovec iov[VN_MANIFEST_IOV];
	int iovcnt;
	size_t total; /* bytes in all pieces */
};

/* Fills *parts; 0, or -1 if `m` cannot be encoded (oversize, a bundled
 * chunk without its fingerprint, extra bundles out of order or without
 * chunk 0). */
int vn_manifest_encode_parts(const struct vn_manifest *m,
    struct vn_manifest_parts *parts);

/*
 * Decodes `buf` into *m.  On success returns 0; m->chunks is malloc'ed (free
 * it with vn_manifest_release) and the bundled chunks point into `buf`.  Returns -1 on
 * malformed input or allocation failure (then nothing needs freeing).
 */
int vn_manifest_decode(const uint8_t *buf, size_t len, struct vn_manifest *m);

void vn_manifest_release(struct vn_manifest *m);

#endif /* VN_MANIFEST_PB_H */
