/*
 * Which chunks a manifest bundles besides chunk 0: those that hold the upper
 * levels of the database's b-trees (docs/WRITER.md, "Bundled b-tree tops").
 *
 * A reader that starts cold looks a row up by walking a b-tree from its root
 * page down to a leaf, one page per level, each page found only once its
 * parent is read: every level outside the manifest costs one GET in series.
 * The roots usually sit in chunk 0 (always bundled); the levels just below
 * them are few pages in few chunks, read by every lookup.  Bundling those
 * chunks saves every cold lookup one round trip per tree level, for a fixed
 * number of chunk bytes in each manifest.
 *
 * The walk goes level by level over all the trees named in sqlite_schema
 * (and the schema's own tree), shallowest first, and takes a tree's next
 * level only if all the chunks of that level fit in what is left of the
 * budget; leaf levels are never taken.  It reads pages through a callback,
 * trusts nothing it reads (a damaged or unusual file only gives fewer
 * chunks), and is bounded: at most VN_TOPS_MAX_SCHEMA_PAGES schema pages,
 * VN_TOPS_MAX_TREES trees and VN_TOPS_MAX_FRONTIER pages per level.
 *
 * No SQLite, no I/O of its own: testable on bytes.
 */
#ifndef VN_BTREE_TOPS_H
#define VN_BTREE_TOPS_H

#include <stddef.h>
#include <stdint.h>

#include "names.h" /* VN_CHUNK_SIZE */

/* Most chunks besides chunk 0 a manifest may bundle: the array sizes below
 * and the manifest encoder's pieces (manifest_pb.h) are sized by it.  16
 * chunks are 1 MiB per manifest; the writer's default budget is lower
 * (vfs.c, VN_BUNDLE_CHUNKS_DEFAULT). */
#define VN_TOPS_MAX_CHUNKS 16

/* Pages of the sqlite_schema tree read to find the trees' root pages: a
 * schema of a few hundred tables and indexes fits in 64 pages of 4 KiB;
 * beyond, the trees found so far are used. */
#define VN_TOPS_MAX_SCHEMA_PAGES 64

/* Trees looked at (the schema's own, then one per table or index, in
 * sqlite_schema order): plenty for one budget of VN_TOPS_MAX_CHUNKS. */
#define VN_TOPS_MAX_TREES 512

/* Page numbers kept for one level of all trees.  A level worth taking fits
 * in VN_TOPS_MAX_CHUNKS chunks, i.e. at most 16 * 128 pages of 512 bytes
 * (SQLite's smallest); a tree whose next level has more pages than room is
 * left at the levels already taken. */
#define VN_TOPS_MAX_FRONTIER 2048

/* Reads len bytes at file offset off into buf; 0 on success.  A short file
 * is an error (the caller passes offsets below the size it gives). */
typedef int (*vn_tops_read_fn)(void *ctx, uint8_t *buf, size_t len,
    uint64_t off);

struct vn_tops {
	size_t n;                            /* chunks chosen, ascending */
	uint64_t index[VN_TOPS_MAX_CHUNKS];
	size_t len[VN_TOPS_MAX_CHUNKS];      /* bytes (the last chunk is short) */
	uint8_t *data[VN_TOPS_MAX_CHUNKS];   /* the chunks' bytes, as read */
};

/*
 * Chooses at most `budget` (<= VN_TOPS_MAX_CHUNKS) chunks other than chunk 0
 * of a database of `size` bytes whose chunk 0 is chunk0[0..len0), and reads
 * them into bufs[0..budget): buffers of VN_CHUNK_SIZE bytes owned by the
 * caller, malloc'ed here where NULL (so a database that needs none costs no
 * memory); the caller frees them.  out->data[i] points into them, in
 * ascending chunk order.
 * `page` is a scratch buffer of VN_CHUNK_SIZE bytes.  Returns 0, or -1 if
 * `read` failed (out->n is then 0).  Anything the walk does not understand
 * just ends it early.
 */
int vn_btree_tops(const uint8_t *chunk0, size_t len0, uint64_t size,
    size_t budget, vn_tops_read_fn read, void *ctx, uint8_t **bufs,
    uint8_t *page, struct vn_tops *out);

#endif /* VN_BTREE_TOPS_H */
