/*
 * The record of what a staged WAL snapshot stands for: see walrec.h.
 *
 * Layout (little-endian):
 *     0  magic "VNWALREC"              8
 *     8  kind                          4
 *    12  version_id length             4
 *    16  version_id                   64
 *    80  salts                         8
 *    88  mx, npage, pgsz, cksum[2]    20
 *   108  dev, ino, size               24
 *   132  mtime s/ns, ctime s/ns       32
 *   164  header fingerprint           16
 *   180  zeros                         4
 *   184  primary UMASH of [0, 184)     8
 */
#define _GNU_SOURCE
#include "walrec.h"

#include <assert.h>
#include <string.h>
#include <sys/stat.h>

#include "tracker.h" /* VN_HEADER_BYTES */

static const uint8_t magic[8] = { 'V', 'N', 'W', 'A', 'L', 'R', 'E', 'C' };

#define OFF_KIND 8
#define OFF_VID_LEN 12
#define OFF_VID 16
#define OFF_SALT 80
#define OFF_POS 88
#define OFF_PROOF 108
#define OFF_HEADER 164
#define OFF_HASH 184

static_assert(OFF_VID + VN_MAX_VERSION_ID == OFF_SALT, "version id fits");
static_assert(OFF_POS + 5 * 4 == OFF_PROOF, "position fits");
static_assert(OFF_PROOF + 7 * 8 == OFF_HEADER, "proof fits");
static_assert(OFF_HEADER + 16 <= OFF_HASH, "header fingerprint fits");
static_assert(OFF_HASH + 8 == VN_WALREC_BYTES, "hash ends the record");

static void put64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get64(const uint8_t *p)
{
	uint64_t v = 0;

	for (int i = 7; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static void put32(uint8_t *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
	    (uint32_t)p[3] << 24;
}

void vn_walrec_encode(const struct vn_walrec *r, const struct vn_keys *keys,
    uint8_t out[VN_WALREC_BYTES])
{
	const struct vn_file_proof *p = &r->proof;
	const uint32_t pos[5] = { r->pos.mx, r->pos.npage, r->pos.pgsz,
	    r->pos.cksum[0], r->pos.cksum[1] };
	const uint64_t proof[7] = { p->dev, p->ino, p->size,
	    (uint64_t)p->mtime_sec, (uint64_t)p->mtime_nsec,
	    (uint64_t)p->ctime_sec, (uint64_t)p->ctime_nsec };

	memset(out, 0, VN_WALREC_BYTES);
	memcpy(out, magic, sizeof(magic));
	put32(out + OFF_KIND, (uint32_t)r->kind);
	put32(out + OFF_VID_LEN, (uint32_t)r->version_id_len);
	memcpy(out + OFF_VID, r->version_id, r->version_id_len);
	memcpy(out + OFF_SALT, r->pos.salt, sizeof(r->pos.salt));
	for (int i = 0; i < 5; i++)
		put32(out + OFF_POS + 4 * i, pos[i]);
	for (int i = 0; i < 7; i++)
		put64(out + OFF_PROOF + 8 * i, proof[i]);
	put64(out + OFF_HEADER, p->header[0]);
	put64(out + OFF_HEADER + 8, p->header[1]);
	put64(out + OFF_HASH, vn_umash_full(&keys->chunk, 0, 0, out, OFF_HASH));
}

int vn_walrec_decode(const uint8_t *buf, size_t len,
    const struct vn_keys *keys, struct vn_walrec *r)
{
	struct vn_file_proof *p = &r->proof;
	uint64_t proof[7];

	if (len != VN_WALREC_BYTES || memcmp(buf, magic, sizeof(magic)) != 0 ||
	    get64(buf + OFF_HASH) != vn_umash_full(&keys->chunk, 0, 0, buf,
	    OFF_HASH))
		return -1;
	memset(r, 0, sizeof(*r));
	r->kind = (int)get32(buf + OFF_KIND);
	r->version_id_len = get32(buf + OFF_VID_LEN);
	if ((r->kind != VN_WALREC_POS && r->kind != VN_WALREC_FILE) ||
	    r->version_id_len > VN_MAX_VERSION_ID)
		return -1;
	memcpy(r->version_id, buf + OFF_VID, r->version_id_len);
	memcpy(r->pos.salt, buf + OFF_SALT, sizeof(r->pos.salt));
	r->pos.mx = get32(buf + OFF_POS);
	r->pos.npage = get32(buf + OFF_POS + 4);
	r->pos.pgsz = get32(buf + OFF_POS + 8);
	r->pos.cksum[0] = get32(buf + OFF_POS + 12);
	r->pos.cksum[1] = get32(buf + OFF_POS + 16);
	for (int i = 0; i < 7; i++)
		proof[i] = get64(buf + OFF_PROOF + 8 * i);
	p->dev = proof[0];
	p->ino = proof[1];
	p->size = proof[2];
	p->mtime_sec = (int64_t)proof[3];
	p->mtime_nsec = (int64_t)proof[4];
	p->ctime_sec = (int64_t)proof[5];
	p->ctime_nsec = (int64_t)proof[6];
	p->header[0] = get64(buf + OFF_HEADER);
	p->header[1] = get64(buf + OFF_HEADER + 8);
	return 0;
}

int vn_file_prove(const char *path, sqlite3_file *db,
    const struct vn_keys *keys, struct vn_file_proof *p)
{
	uint8_t hdr[VN_HEADER_BYTES];
	struct vn_umash_fp fp;
	struct stat st;
	size_t n;

	if (stat(path, &st) != 0)
		return -1;
	n = st.st_size < VN_HEADER_BYTES ? (size_t)st.st_size : VN_HEADER_BYTES;
	if (n > 0 && db->pMethods->xRead(db, hdr, (int)n, 0) != SQLITE_OK)
		return -1;
	fp = vn_umash_fprint(&keys->header, 0, hdr, n);
	memset(p, 0, sizeof(*p));
	p->dev = (uint64_t)st.st_dev;
	p->ino = (uint64_t)st.st_ino;
	p->size = (uint64_t)st.st_size;
	p->mtime_sec = (int64_t)st.st_mtim.tv_sec;
	p->mtime_nsec = (int64_t)st.st_mtim.tv_nsec;
	p->ctime_sec = (int64_t)st.st_ctim.tv_sec;
	p->ctime_nsec = (int64_t)st.st_ctim.tv_nsec;
	p->header[0] = fp.hash[0];
	p->header[1] = fp.hash[1];
	return 0;
}

int vn_file_proof_equal(const struct vn_file_proof *a,
    const struct vn_file_proof *b)
{
	return memcmp(a, b, sizeof(*a)) == 0;
}
