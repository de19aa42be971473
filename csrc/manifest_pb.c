/*
 * Protobuf encoding of the Manifest (see manifest_pb.h and docs/FORMAT.md).
 */
#include "manifest_pb.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

static_assert(sizeof(uint64_t) == 8, "fixed64 words are 8 bytes");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the chunk words are hashed and written as little-endian in memory order"
#endif

/* Wire types. */
enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_I32 = 5 };

/* docs/FORMAT.md: chunk i starts at byte i * 65536 (its chunk_offset). */
#define VN_CHUNK_BYTES ((uint64_t)65536)

#define TAG(field, wt) (((uint64_t)(field) << 3) | (wt))

/* ---- sizes -------------------------------------------------------------- */

static size_t varint_size(uint64_t v)
{
	size_t n = 1;

	while (v >= 0x80) {
		v >>= 7;
		n++;
	}
	return n;
}

static size_t fprint_body_size(const struct vn_umash_fp *fp)
{
	return (fp->hash[0] != 0 ? 9 : 0) + (fp->hash[1] != 0 ? 9 : 0);
}

static size_t len_field_size(uint64_t field, size_t body)
{
	return varint_size(TAG(field, WT_LEN)) + varint_size(body) + body;
}

/* BundledChunk for chunk `index` of `len` bytes. */
static size_t bundled_body_size(const struct vn_manifest *m, uint64_t index,
    size_t len)
{
	struct vn_umash_fp fp = { { m->chunks[2 * index],
	    m->chunks[2 * index + 1] } };
	size_t n = 0;

	/* chunk_index = 0 and chunk_offset = 0 are proto3 defaults: omitted. */
	if (index != 0)
		n += varint_size(TAG(1, WT_VARINT)) + varint_size(index) +
		    varint_size(TAG(2, WT_VARINT)) +
		    varint_size(index * VN_CHUNK_BYTES);
	return n + len_field_size(3, fprint_body_size(&fp)) +
	    len_field_size(15, len);
}

static size_t v1_body_size(const struct vn_manifest *m)
{
	size_t n = 0;
	size_t gen = strlen(VN_GENERATED_BY);

	n += len_field_size(1, fprint_body_size(&m->header_fprint));
	if (m->version_id_len > 0)
		n += len_field_size(2, m->version_id_len);
	n += len_field_size(3, fprint_body_size(&m->contents_fprint));
	if (m->len != 0)
		n += varint_size(TAG(5, WT_VARINT)) + varint_size(m->len);
	if (m->ctime != 0)
		n += varint_size(TAG(6, WT_VARINT)) +
		    varint_size((uint64_t)m->ctime);
	if (m->ctime_ns != 0)
		n += varint_size(TAG(7, WT_I32)) + 4;
	n += len_field_size(9, gen);
	if (m->n_words > 0)
		n += len_field_size(15, 8 * m->n_words);
	if (m->has_bundled0)
		n += len_field_size(16, bundled_body_size(m, 0,
		    m->bundled0_len));
	for (size_t k = 0; k < m->n_extra; k++)
		n += len_field_size(16, bundled_body_size(m, m->extra[k].index,
		    m->extra[k].len));
	return n;
}

/* ---- writers ------------------------------------------------------------ */

static uint8_t *put_varint(uint8_t *p, uint64_t v)
{
	while (v >= 0x80) {
		*p++ = (uint8_t)(v | 0x80);
		v >>= 7;
	}
	*p++ = (uint8_t)v;
	return p;
}

static uint8_t *put_fixed64(uint8_t *p, uint64_t v)
{
	memcpy(p, &v, 8); /* little-endian host (checked above) */
	return p + 8;
}

static uint8_t *put_len_header(uint8_t *p, uint64_t field, size_t body)
{
	p = put_varint(p, TAG(field, WT_LEN));
	return put_varint(p, body);
}

static uint8_t *put_fprint(uint8_t *p, uint64_t field,
    const struct vn_umash_fp *fp)
{
	p = put_len_header(p, field, fprint_body_size(fp));
	if (fp->hash[0] != 0) {
		p = put_varint(p, TAG(1, WT_I64));
		p = put_fixed64(p, fp->hash[0]);
	}
	if (fp->hash[1] != 0) {
		p = put_varint(p, TAG(2, WT_I64));
		p = put_fixed64(p, fp->hash[1]);
	}
	return p;
}

/* Bounds of VN_MANIFEST_HEAD_MAX and VN_MANIFEST_MID_MAX (manifest_pb.h). */
static_assert(1 + 10 + 2 + 18 + 2 + VN_MAX_VERSION_ID + 2 + 18 + 1 + 10 +
    1 + 10 + 1 + 4 + 2 + sizeof(VN_GENERATED_BY) - 1 + 1 + 10 + 1 <=
    VN_MANIFEST_HEAD_MAX, "the fields before `chunks` fit in the head");
static_assert(2 + 10 + 1 + 10 + 1 + 10 + 2 + 18 + 1 + 10 <= VN_MANIFEST_MID_MAX,
    "a bundled chunk's keys and fingerprint fit in a mid piece");
static_assert(sizeof(VN_GENERATED_BY) - 1 < 128,
    "generated_by's length is a one-byte varint");

/* Appends one BundledChunk (its key, index, offset, fingerprint and bytes
 * key in `mid`, then its bytes) to parts->iov. */
static void put_bundled(const struct vn_manifest *m,
    struct vn_manifest_parts *parts, uint64_t index, const uint8_t *data,
    size_t len, uint8_t *mid)
{
	struct vn_umash_fp fp = { { m->chunks[2 * index],
	    m->chunks[2 * index + 1] } };
	uint8_t *p;

	p = put_len_header(mid, 16, bundled_body_size(m, index, len));
	if (index != 0) {
		p = put_varint(p, TAG(1, WT_VARINT));
		p = put_varint(p, index);
		p = put_varint(p, TAG(2, WT_VARINT));
		p = put_varint(p, index * VN_CHUNK_BYTES);
	}
	p = put_fprint(p, 3, &fp);
	p = put_len_header(p, 15, len);
	assert((size_t)(p - mid) <= VN_MANIFEST_MID_MAX);
	parts->iov[parts->iovcnt].iov_base = mid;
	parts->iov[parts->iovcnt++].iov_len = (size_t)(p - mid);
	if (len > 0) {
		parts->iov[parts->iovcnt].iov_base = (void *)data;
		parts->iov[parts->iovcnt++].iov_len = len;
	}
}

int vn_manifest_encode_parts(const struct vn_manifest *m,
    struct vn_manifest_parts *parts)
{
	size_t body, total;
	size_t gen = strlen(VN_GENERATED_BY);
	uint8_t *p;

	if (m->has_bundled0 && m->n_words < 2)
		return -1;
	if (m->n_extra > VN_MANIFEST_MAX_EXTRA ||
	    (m->n_extra > 0 && !m->has_bundled0))
		return -1;
	for (size_t k = 0; k < m->n_extra; k++)
		if (m->extra[k].index == 0 ||
		    m->extra[k].index >= m->n_words / 2 ||
		    (k > 0 && m->extra[k].index <= m->extra[k - 1].index))
			return -1;
	if (m->version_id_len > VN_MAX_VERSION_ID)
		return -1;
	body = v1_body_size(m);
	total = len_field_size(1, body);
	if (total > VN_MAX_MANIFEST_BYTES)
		return -1;
	parts->iovcnt = 0;
	parts->total = total;

	p = put_len_header(parts->head, 1, body);
	p = put_fprint(p, 1, &m->header_fprint);
	if (m->version_id_len > 0) {
		p = put_len_header(p, 2, m->version_id_len);
		memcpy(p, m->version_id, m->version_id_len);
		p += m->version_id_len;
	}
	p = put_fprint(p, 3, &m->contents_fprint);
	if (m->len != 0) {
		p = put_varint(p, TAG(5, WT_VARINT));
		p = put_varint(p, m->len);
	}
	if (m->ctime != 0) {
		p = put_varint(p, TAG(6, WT_VARINT));
		p = put_varint(p, (uint64_t)m->ctime);
	}
	if (m->ctime_ns != 0) {
		uint32_t ns = (uint32_t)m->ctime_ns;

		p = put_varint(p, TAG(7, WT_I32));
		memcpy(p, &ns, 4);
		p += 4;
	}
	p = put_len_header(p, 9, gen);
	memcpy(p, VN_GENERATED_BY, gen);
	p += gen;
	if (m->n_words > 0)
		p = put_len_header(p, 15, 8 * m->n_words);
	assert((size_t)(p - parts->head) <= VN_MANIFEST_HEAD_MAX);
	parts->iov[parts->iovcnt].iov_base = parts->head;
	parts->iov[parts->iovcnt++].iov_len = (size_t)(p - parts->head);
	if (m->n_words > 0) {
		/* little-endian host (checked above): the words are the bytes */
		parts->iov[parts->iovcnt].iov_base = m->chunks;
		parts->iov[parts->iovcnt++].iov_len = 8 * m->n_words;
	}
	if (m->has_bundled0)
		put_bundled(m, parts, 0, m->bundled0, m->bundled0_len,
		    parts->mid[0]);
	for (size_t k = 0; k < m->n_extra; k++)
		put_bundled(m, parts, m->extra[k].index, m->extra[k].data,
		    m->extra[k].len, parts->mid[1 + k]);
	return 0;
}

int vn_manifest_encode(const struct vn_manifest *m, uint8_t **out,
    size_t *out_len)
{
	struct vn_manifest_parts parts;
	uint8_t *buf, *p;

	if (vn_manifest_encode_parts(m, &parts) != 0)
		return -1;
	buf = malloc(parts.total);
	if (buf == NULL)
		return -1;
	p = buf;
	for (int i = 0; i < parts.iovcnt; i++) {
		memcpy(p, parts.iov[i].iov_base, parts.iov[i].iov_len);
		p += parts.iov[i].iov_len;
	}
	assert((size_t)(p - buf) == parts.total);
	*out = buf;
	*out_len = parts.total;
	return 0;
}

/* ---- reader ------------------------------------------------------------- */

struct cursor {
	const uint8_t *p;
	const uint8_t *end;
};

static int get_varint(struct cursor *c, uint64_t *v)
{
	uint64_t r = 0;

	for (int shift = 0; shift < 64; shift += 7) {
		uint8_t b;

		if (c->p >= c->end)
			return -1;
		b = *c->p++;
		r |= (uint64_t)(b & 0x7f) << shift;
		if ((b & 0x80) == 0) {
			*v = r;
			return 0;
		}
	}
	return -1;
}

static int get_fixed64(struct cursor *c, uint64_t *v)
{
	if (c->end - c->p < 8)
		return -1;
	memcpy(v, c->p, 8);
	c->p += 8;
	return 0;
}

/* Reads a field key; *len_body receives the LEN payload for WT_LEN. */
static int get_field(struct cursor *c, uint64_t *field, int *wt,
    struct cursor *len_body)
{
	uint64_t key, n;

	if (get_varint(c, &key) != 0)
		return -1;
	*field = key >> 3;
	*wt = (int)(key & 7);
	switch (*wt) {
	case WT_VARINT:
	case WT_I64:
	case WT_I32:
		return 0;
	case WT_LEN:
		if (get_varint(c, &n) != 0 || n > (uint64_t)(c->end - c->p))
			return -1;
		len_body->p = c->p;
		len_body->end = c->p + n;
		c->p += n;
		return 0;
	default:
		return -1; /* groups are not used by this schema */
	}
}

static int skip_scalar(struct cursor *c, int wt)
{
	uint64_t ignored;

	switch (wt) {
	case WT_VARINT:
		return get_varint(c, &ignored);
	case WT_I64:
		return get_fixed64(c, &ignored);
	case WT_I32:
		if (c->end - c->p < 4)
			return -1;
		c->p += 4;
		return 0;
	default:
		return 0; /* LEN bodies were consumed by get_field */
	}
}

static int decode_fprint(struct cursor c, struct vn_umash_fp *fp)
{
	fp->hash[0] = fp->hash[1] = 0;
	while (c.p < c.end) {
		uint64_t field;
		int wt;
		struct cursor body;

		if (get_field(&c, &field, &wt, &body) != 0)
			return -1;
		if ((field == 1 || field == 2) && wt == WT_I64) {
			if (get_fixed64(&c, &fp->hash[field - 1]) != 0)
				return -1;
		} else if (skip_scalar(&c, wt) != 0) {
			return -1;
		}
	}
	return 0;
}

static int push_words(struct vn_manifest *m, size_t *cap, const uint8_t *src,
    size_t n)
{
	if (m->n_words + n > *cap) {
		size_t want = *cap ? *cap : 64;
		uint64_t *grown;

		while (want < m->n_words + n)
			want *= 2;
		grown = realloc(m->chunks, want * sizeof(uint64_t));
		if (grown == NULL)
			return -1;
		m->chunks = grown;
		*cap = want;
	}
	memcpy(m->chunks + m->n_words, src, 8 * n);
	m->n_words += n;
	return 0;
}

static int decode_bundled(struct cursor c, struct vn_manifest *m)
{
	uint64_t index = 0, offset = 0;
	const uint8_t *data = NULL;
	size_t data_len = 0;

	while (c.p < c.end) {
		uint64_t field;
		int wt;
		struct cursor body;

		if (get_field(&c, &field, &wt, &body) != 0)
			return -1;
		if (field == 1 && wt == WT_VARINT) {
			if (get_varint(&c, &index) != 0)
				return -1;
		} else if (field == 2 && wt == WT_VARINT) {
			if (get_varint(&c, &offset) != 0)
				return -1;
		} else if (field == 15 && wt == WT_LEN) {
			data = body.p;
			data_len = (size_t)(body.end - body.p);
		} else if (skip_scalar(&c, wt) != 0) {
			return -1;
		}
	}
	if (data == NULL)
		return 0;
	if (index == 0 && offset == 0) {
		m->bundled0 = data;
		m->bundled0_len = data_len;
		m->has_bundled0 = 1;
	} else if (index != 0 && m->n_extra < VN_MANIFEST_MAX_EXTRA) {
		m->extra[m->n_extra].index = index;
		m->extra[m->n_extra].data = data;
		m->extra[m->n_extra].len = data_len;
		m->n_extra++;
	}
	return 0;
}

static int decode_v1(struct cursor c, struct vn_manifest *m)
{
	size_t cap = 0;

	while (c.p < c.end) {
		uint64_t field, v;
		int wt;
		struct cursor body;

		if (get_field(&c, &field, &wt, &body) != 0)
			return -1;
		if (field == 1 && wt == WT_LEN) {
			if (decode_fprint(body, &m->header_fprint) != 0)
				return -1;
			m->has_header_fprint = 1;
		} else if (field == 2 && wt == WT_LEN) {
			size_t n = (size_t)(body.end - body.p);

			if (n > VN_MAX_VERSION_ID)
				n = 0; /* not ours: never matches anything */
			memcpy(m->version_id, body.p, n);
			m->version_id_len = n;
		} else if (field == 3 && wt == WT_LEN) {
			if (decode_fprint(body, &m->contents_fprint) != 0)
				return -1;
			m->has_contents_fprint = 1;
		} else if (field == 5 && wt == WT_VARINT) {
			if (get_varint(&c, &m->len) != 0)
				return -1;
		} else if (field == 6 && wt == WT_VARINT) {
			if (get_varint(&c, &v) != 0)
				return -1;
			m->ctime = (int64_t)v;
		} else if (field == 7 && wt == WT_I32) {
			uint32_t ns;

			if (c.end - c.p < 4)
				return -1;
			memcpy(&ns, c.p, 4);
			c.p += 4;
			m->ctime_ns = (int32_t)ns;
		} else if (field == 8 && wt == WT_LEN) {
			m->has_base_chunks_fprint = 1;
		} else if (field == 15 && wt == WT_LEN) {
			size_t n = (size_t)(body.end - body.p);

			if (n % 8 != 0 || push_words(m, &cap, body.p, n / 8) != 0)
				return -1;
		} else if (field == 15 && wt == WT_I64) {
			if (c.end - c.p < 8 || push_words(m, &cap, c.p, 1) != 0)
				return -1;
			c.p += 8;
		} else if (field == 16 && wt == WT_LEN) {
			if (decode_bundled(body, m) != 0)
				return -1;
		} else if (skip_scalar(&c, wt) != 0) {
			return -1;
		}
	}
	return 0;
}

int vn_manifest_decode(const uint8_t *buf, size_t len, struct vn_manifest *m)
{
	struct cursor c = { buf, buf + len };
	int have_v1 = 0;

	memset(m, 0, sizeof(*m));
	while (c.p < c.end) {
		uint64_t field;
		int wt;
		struct cursor body;

		if (get_field(&c, &field, &wt, &body) != 0)
			goto fail;
		if (field == 1 && wt == WT_LEN) {
			if (decode_v1(body, m) != 0)
				goto fail;
			have_v1 = 1;
		} else if (skip_scalar(&c, wt) != 0) {
			goto fail;
		}
	}
	if (!have_v1)
		goto fail;
	return 0;

fail:
	vn_manifest_release(m);
	return -1;
}

void vn_manifest_release(struct vn_manifest *m)
{
	free(m->chunks);
	m->chunks = NULL;
	m->n_words = 0;
}
