/*
 * The chunks holding the upper levels of a database's b-trees: see
 * btree_tops.h.
 *
 * SQLite's file format (https://www.sqlite.org/fileformat2.html), the parts
 * used here:
 * - header (first 100 bytes of page 1): magic, page size (big-endian u16 at
 *   16, 1 meaning 65536), bytes reserved at the end of each page (byte 20);
 * - a b-tree page's header starts at offset 100 on page 1, 0 elsewhere; its
 *   first byte is the type (2 interior index, 5 interior table, 10 leaf
 *   index, 13 leaf table) and bytes 3..5 the number of cells; interior pages
 *   have a 12-byte header ending with the right-most child (u32 at 8), leaf
 *   pages an 8-byte one; the cell pointer array (big-endian u16 offsets)
 *   follows; an interior cell starts with its left child's page number (u32);
 * - a table leaf cell is varint payload size, varint rowid, then the payload
 *   (a record), of which only a prefix may be on the page;
 * - a record is varint header size, one varint serial type per column, then
 *   the values; sqlite_schema's columns are type, name, tbl_name, rootpage,
 *   sql.
 */
#include "btree_tops.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

/* SQLite's page sizes are powers of two from 512 to 65536, so pages never
 * straddle chunks and a page fits in the caller's scratch buffer. */
static_assert(VN_CHUNK_SIZE == 65536, "a page never straddles two chunks");
static_assert(VN_TOPS_MAX_FRONTIER >= VN_TOPS_MAX_CHUNKS * (VN_CHUNK_SIZE / 512),
    "a level that fits the largest budget fits the frontier");

/* Pages read one by one (outside chunk 0 and the chunks taken) per walk:
 * the schema's pages and one page per tree and level, to learn whether a
 * level is interior.  Bounds the cost of a commit of a database with very
 * many trees to 128 page reads from the OS's page cache (~0.1 ms); trees
 * past that are not looked at. */
#define VN_TOPS_MAX_PAGE_READS 128

/* Deepest level looked at: a b-tree of 4 KiB pages with 2^64 rows is about
 * 10 levels deep; the bound only guards against cycles in damaged files. */
#define VN_TOPS_MAX_DEPTH 32

#define TYPE_INTERIOR_INDEX 2
#define TYPE_INTERIOR_TABLE 5
#define TYPE_LEAF_TABLE 13

struct level {
	uint32_t page[VN_TOPS_MAX_FRONTIER];
	size_t n_pages;
	/* tree g's pages are page[start[g] .. start[g + 1]) */
	size_t start[VN_TOPS_MAX_TREES + 1];
	size_t n_trees;
};

struct walk {
	const uint8_t *chunk0;
	size_t len0;
	uint64_t size;
	uint32_t page_size;
	uint32_t usable;    /* page size minus the reserved bytes */
	uint64_t n_pages;
	size_t budget;
	vn_tops_read_fn read;
	void *ctx;
	uint8_t **bufs;
	uint8_t *page;      /* scratch: the last page read that is not in hand */
	struct vn_tops *out;
	int failed;         /* a read failed */
	size_t reads_left;  /* pages we may still read one by one */
	size_t order[VN_TOPS_MAX_TREES]; /* walk_level's scratch */
	size_t cost[VN_TOPS_MAX_TREES];
	struct level a, b;
};

static uint32_t be16(const uint8_t *p)
{
	return (uint32_t)p[0] << 8 | p[1];
}

static uint32_t be32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 |
	    (uint32_t)p[2] << 8 | p[3];
}

/* SQLite's varint (1 to 9 bytes, big-endian groups of 7 bits, the 9th byte
 * whole): bytes used, or 0 if it runs past end. */
static size_t get_varint(const uint8_t *p, const uint8_t *end, uint64_t *v)
{
	uint64_t r = 0;

	for (size_t i = 0; i < 9; i++) {
		if (p + i >= end)
			return 0;
		if (i == 8) {
			*v = (r << 8) | p[i];
			return 9;
		}
		r = (r << 7) | (p[i] & 0x7f);
		if ((p[i] & 0x80) == 0) {
			*v = r;
			return i + 1;
		}
	}
	return 0;
}

static size_t header_offset(uint32_t pgno)
{
	return pgno == 1 ? 100 : 0;
}

static uint64_t chunk_of(const struct walk *w, uint32_t pgno)
{
	return (uint64_t)(pgno - 1) * w->page_size / VN_CHUNK_SIZE;
}

static int chosen(const struct walk *w, uint64_t chunk, size_t *slot)
{
	for (size_t i = 0; i < w->out->n; i++)
		if (w->out->index[i] == chunk) {
			if (slot != NULL)
				*slot = i;
			return 1;
		}
	return 0;
}

/* Page pgno (1-based): in chunk 0, in a chosen chunk, or read into the
 * scratch buffer (valid until the next call).  NULL if out of range or
 * unreadable. */
static const uint8_t *get_page(struct walk *w, uint32_t pgno)
{
	uint64_t off, chunk;
	size_t in_chunk, slot;

	if (pgno == 0 || pgno > w->n_pages || w->failed)
		return NULL;
	off = (uint64_t)(pgno - 1) * w->page_size;
	chunk = off / VN_CHUNK_SIZE;
	in_chunk = (size_t)(off % VN_CHUNK_SIZE);
	if (chunk == 0)
		return in_chunk + w->page_size <= w->len0 ?
		    w->chunk0 + in_chunk : NULL;
	if (chosen(w, chunk, &slot))
		return in_chunk + w->page_size <= w->out->len[slot] ?
		    w->out->data[slot] + in_chunk : NULL;
	if (w->reads_left == 0)
		return NULL;
	w->reads_left--;
	if (w->read(w->ctx, w->page, w->page_size, off) != 0) {
		w->failed = 1;
		return NULL;
	}
	return w->page;
}

/* The page's type byte if it is an interior b-tree page whose cell pointer
 * array fits, else 0; *ncells receives its cell count. */
static int interior(const struct walk *w, const uint8_t *pg, uint32_t pgno,
    size_t *ncells)
{
	size_t h = header_offset(pgno);
	uint8_t type;

	if (pg == NULL)
		return 0;
	type = pg[h];
	if (type != TYPE_INTERIOR_INDEX && type != TYPE_INTERIOR_TABLE)
		return 0;
	*ncells = be16(pg + h + 3);
	if (h + 12 + 2 * *ncells > w->usable)
		return 0;
	return type;
}

/* Child i (0 <= i <= ncells, the last being the right-most) of interior
 * page pg, or 0 if its pointer is out of bounds. */
static uint32_t child_at(const struct walk *w, const uint8_t *pg,
    uint32_t pgno, size_t ncells, size_t i)
{
	size_t h = header_offset(pgno);
	uint32_t child;

	if (i < ncells) {
		size_t cp = be16(pg + h + 12 + 2 * i);

		if (cp < h + 12 + 2 * ncells || cp + 4 > w->usable)
			return 0;
		child = be32(pg + cp);
	} else {
		child = be32(pg + h + 8);
	}
	return child <= w->n_pages ? child : 0;
}

/* Appends the children of interior page pg (ncells cells) to lv; -1 if
 * they do not fit. */
static int push_children(const struct walk *w, const uint8_t *pg,
    uint32_t pgno, size_t ncells, struct level *lv)
{
	for (size_t i = 0; i <= ncells; i++) {
		uint32_t child = child_at(w, pg, pgno, ncells, i);

		if (child == 0)
			continue;
		if (lv->n_pages == VN_TOPS_MAX_FRONTIER)
			return -1;
		lv->page[lv->n_pages++] = child;
	}
	return 0;
}

/* Bytes of a record value of serial type t, or -1 for reserved types. */
static int64_t serial_size(uint64_t t)
{
	static const int8_t small[12] = { 0, 1, 2, 3, 4, 6, 8, 8, 0, 0, -1, -1 };

	if (t < 12)
		return small[t];
	return (int64_t)((t - 12) / 2);
}

/* The rootpage column of the sqlite_schema record in cell `cell` of table
 * leaf page pg, or 0 if it is not an integer on this page. */
static uint32_t schema_rootpage(const struct walk *w, const uint8_t *pg,
    size_t cell)
{
	const uint8_t *end = pg + w->usable;
	const uint8_t *p = pg + cell, *rec, *rec_end, *q, *hdr_end;
	uint64_t payload, rowid, hsize, t, v = 0;
	uint64_t x = w->usable - 35, local;
	int64_t skip = 0, n;
	size_t k;

	if ((k = get_varint(p, end, &payload)) == 0)
		return 0;
	p += k;
	if ((k = get_varint(p, end, &rowid)) == 0)
		return 0;
	p += k;
	/* How much of the payload is on this page (fileformat2, "Cell
	 * Payload Overflow Pages", for table leaves). */
	if (payload <= x) {
		local = payload;
	} else {
		uint64_t m = ((uint64_t)(w->usable - 12) * 32 / 255) - 23;
		uint64_t kk = m + (payload - m) % (w->usable - 4);

		local = kk <= x ? kk : m;
	}
	if (local > (uint64_t)(end - p))
		return 0;
	rec = p;
	rec_end = p + local;
	if ((k = get_varint(rec, rec_end, &hsize)) == 0 ||
	    hsize > (uint64_t)(rec_end - rec))
		return 0;
	q = rec + k;
	hdr_end = rec + hsize;
	for (int col = 0; col < 4; col++) {
		if ((k = get_varint(q, hdr_end, &t)) == 0)
			return 0;
		q += k;
		/* A value longer than the page cannot leave the rootpage on
		 * it (and keeps the sums below small). */
		if ((n = serial_size(t)) < 0 || n > (int64_t)w->usable)
			return 0;
		if (col < 3) {
			skip += n;
			continue;
		}
		/* rootpage: an integer (types 1-6), or the constants 0/1. */
		if (t == 9)
			return 1;
		if (t < 1 || t > 6)
			return 0;
		if (skip + n > rec_end - hdr_end)
			return 0;
		q = hdr_end + skip;
		for (int64_t i = 0; i < n; i++)
			v = (v << 8) | q[i];
		if (q[0] & 0x80)
			return 0; /* negative */
		return v <= w->n_pages ? (uint32_t)v : 0;
	}
	return 0;
}

/* The root pages of sqlite_schema's tree (page 1) and of every tree it
 * names, into lv as one tree each. */
static void find_trees(struct walk *w, struct level *lv)
{
	uint32_t stack[VN_TOPS_MAX_SCHEMA_PAGES];
	size_t depth = 0, visited = 0;

	lv->n_pages = lv->n_trees = 0;
	lv->start[0] = 0;
	lv->page[lv->n_pages++] = 1;
	lv->start[++lv->n_trees] = lv->n_pages;
	stack[depth++] = 1;
	while (depth > 0 && visited < VN_TOPS_MAX_SCHEMA_PAGES) {
		uint32_t pgno = stack[--depth];
		const uint8_t *pg = get_page(w, pgno);
		size_t h = header_offset(pgno), ncells;

		visited++;
		if (pg == NULL)
			continue;
		if (pg[h] == TYPE_INTERIOR_TABLE &&
		    interior(w, pg, pgno, &ncells)) {
			for (size_t i = 0; i <= ncells; i++) {
				uint32_t child = child_at(w, pg, pgno, ncells, i);

				if (child > 1 && depth < VN_TOPS_MAX_SCHEMA_PAGES)
					stack[depth++] = child;
			}
		} else if (pg[h] == TYPE_LEAF_TABLE) {
			size_t n = be16(pg + h + 3);

			if (h + 8 + 2 * n > w->usable)
				continue;
			for (size_t i = 0; i < n; i++) {
				size_t cp = be16(pg + h + 8 + 2 * i);
				uint32_t root;

				if (cp < h + 8 + 2 * n || cp >= w->usable)
					continue;
				root = schema_rootpage(w, pg, cp);
				if (root <= 1 || lv->n_trees == VN_TOPS_MAX_TREES)
					continue;
				lv->page[lv->n_pages++] = root;
				lv->start[++lv->n_trees] = lv->n_pages;
			}
		}
	}
}

/* Reads chunk c into the next free buffer (allocated on first use). */
static int take_chunk(struct walk *w, uint64_t c)
{
	struct vn_tops *out = w->out;
	uint64_t off = c * VN_CHUNK_SIZE;
	size_t len = w->size - off < VN_CHUNK_SIZE ?
	    (size_t)(w->size - off) : VN_CHUNK_SIZE;

	if (w->bufs[out->n] == NULL)
		w->bufs[out->n] = malloc(VN_CHUNK_SIZE);
	if (w->bufs[out->n] == NULL) {
		w->failed = 1;
		return -1;
	}
	if (w->read(w->ctx, w->bufs[out->n], len, off) != 0) {
		w->failed = 1;
		return -1;
	}
	out->index[out->n] = c;
	out->len[out->n] = len;
	out->data[out->n] = w->bufs[out->n];
	out->n++;
	return 0;
}

/* The chunks of pages[0..n) not yet taken, into fresh[]; their count, or
 * room + 1 if there are more than `room`. */
static size_t fresh_chunks(const struct walk *w, const uint32_t *pages,
    size_t n, uint64_t fresh[VN_TOPS_MAX_CHUNKS], size_t room)
{
	size_t n_fresh = 0;

	for (size_t i = 0; i < n; i++) {
		uint64_t c = chunk_of(w, pages[i]);
		size_t j;

		if (c == 0 || chosen(w, c, NULL))
			continue;
		for (j = 0; j < n_fresh && fresh[j] != c; j++)
			;
		if (j < n_fresh)
			continue;
		if (n_fresh == room)
			return room + 1;
		fresh[n_fresh++] = c;
	}
	return n_fresh;
}

/*
 * Level `cur` of every tree still walked: take the trees whose level is
 * interior and fits what is left of the budget, cheapest first (so that a
 * tight budget serves as many trees as it can), and put their next levels
 * in `next`.
 */
static void walk_level(struct walk *w, const struct level *cur,
    struct level *next)
{
	size_t *order = w->order, *cost = w->cost, n_order = 0;

	next->n_pages = next->n_trees = 0;
	next->start[0] = 0;
	/* B-trees are balanced: one page tells whether a whole level is
	 * interior.  Leaf levels and levels too wide are left. */
	for (size_t g = 0; g < cur->n_trees && !w->failed; g++) {
		const uint32_t *pages = cur->page + cur->start[g];
		size_t n = cur->start[g + 1] - cur->start[g], ncells, k;
		uint64_t fresh[VN_TOPS_MAX_CHUNKS];

		if (n == 0 || !interior(w, get_page(w, pages[0]), pages[0],
		    &ncells))
			continue;
		cost[g] = fresh_chunks(w, pages, n, fresh, w->budget - w->out->n);
		if (cost[g] > w->budget - w->out->n)
			continue;
		/* insertion by cost, stable */
		for (k = n_order; k > 0 && cost[order[k - 1]] > cost[g]; k--)
			order[k] = order[k - 1];
		order[k] = g;
		n_order++;
	}
	for (size_t k = 0; k < n_order && !w->failed; k++) {
		size_t g = order[k], ncells, mark = next->n_pages, n_fresh;
		const uint32_t *pages = cur->page + cur->start[g];
		size_t n = cur->start[g + 1] - cur->start[g];
		uint64_t fresh[VN_TOPS_MAX_CHUNKS];

		/* Again: trees taken before may share chunks with this one. */
		n_fresh = fresh_chunks(w, pages, n, fresh, w->budget - w->out->n);
		if (n_fresh > w->budget - w->out->n)
			continue;
		for (size_t j = 0; j < n_fresh; j++)
			if (take_chunk(w, fresh[j]) != 0)
				return;
		for (size_t i = 0; i < n; i++) {
			const uint8_t *pg = get_page(w, pages[i]);

			if (!interior(w, pg, pages[i], &ncells))
				continue;
			if (push_children(w, pg, pages[i], ncells, next) != 0) {
				next->n_pages = mark; /* too wide: stop here */
				break;
			}
		}
		if (next->n_pages > mark)
			next->start[++next->n_trees] = next->n_pages;
	}
}

int vn_btree_tops(const uint8_t *chunk0, size_t len0, uint64_t size,
    size_t budget, vn_tops_read_fn read, void *ctx, uint8_t **bufs,
    uint8_t *page, struct vn_tops *out)
{
	static const uint8_t magic[16] = "SQLite format 3";
	struct walk *w;
	struct level *cur, *next, *t;
	uint32_t ps;
	int rc;

	out->n = 0;
	if (budget == 0 || len0 < 100 || memcmp(chunk0, magic, 16) != 0)
		return 0;
	ps = be16(chunk0 + 16);
	if (ps == 1)
		ps = 65536;
	if (ps < 512 || ps > 65536 || (ps & (ps - 1)) != 0 ||
	    chunk0[20] > ps - 480)
		return 0;
	w = malloc(sizeof(*w));
	if (w == NULL)
		return 0; /* only a hint: go without */
	memset(w, 0, offsetof(struct walk, a));
	w->chunk0 = chunk0;
	w->len0 = len0;
	w->size = size;
	w->page_size = ps;
	w->usable = ps - chunk0[20];
	w->n_pages = size / ps;
	w->reads_left = VN_TOPS_MAX_PAGE_READS;
	w->budget = budget < VN_TOPS_MAX_CHUNKS ? budget : VN_TOPS_MAX_CHUNKS;
	w->read = read;
	w->ctx = ctx;
	w->bufs = bufs;
	w->page = page;
	w->out = out;
	cur = &w->a;
	next = &w->b;
	find_trees(w, cur);
	for (int depth = 0; depth < VN_TOPS_MAX_DEPTH && cur->n_trees > 0 &&
	    !w->failed; depth++) {
		walk_level(w, cur, next);
		t = cur;
		cur = next;
		next = t;
	}
	rc = w->failed ? -1 : 0;
	if (w->failed)
		out->n = 0;
	free(w);
	/* Ascending chunk order (insertion sort of at most 16). */
	for (size_t i = 1; i < out->n; i++)
		for (size_t j = i; j > 0 && out->index[j - 1] > out->index[j]; j--) {
			uint64_t ix = out->index[j];
			size_t ln = out->len[j];
			uint8_t *d = out->data[j];

			out->index[j] = out->index[j - 1];
			out->len[j] = out->len[j - 1];
			out->data[j] = out->data[j - 1];
			out->index[j - 1] = ix;
			out->len[j - 1] = ln;
			out->data[j - 1] = d;
		}
	return rc;
}
