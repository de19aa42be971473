/*
 * VERNEUIL_CONFIG for the writer (config.h): just the keys the VFS needs from
 * a JSON object, every other value skipped whatever it holds, with bounds on
 * the file's size and on nesting.
 */
#define _GNU_SOURCE
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Largest VERNEUIL_CONFIG file we read: configs are a few hundred bytes. */
#define VN_CONFIG_MAX (1 << 20)

/* What an unusable config leads to, said at the end of every complaint. */
#define VN_CONFIG_NOTHING "the verneuil VFS replicates nothing"

/* Deepest JSON nesting we skip over in VERNEUIL_CONFIG: real configs nest
 * 3 levels; the bound keeps the recursive skipper's stack small. */
#define VN_JSON_MAX_DEPTH 64


struct json {
	const char *p;
	const char *end;
};

static void json_ws(struct json *j)
{
	while (j->p < j->end && isspace((unsigned char)*j->p))
		j->p++;
}

/* Whether the value at j->p is the literal `word` (then skipped). */
static int json_literal(struct json *j, const char *word)
{
	size_t n = strlen(word);

	if ((size_t)(j->end - j->p) < n || memcmp(j->p, word, n) != 0)
		return 0;
	j->p += n;
	return 1;
}

/* The four hex digits of a \u escape: their value, or -1. */
static long json_hex4(struct json *j)
{
	long v = 0;

	if (j->end - j->p < 4)
		return -1;
	for (int k = 0; k < 4; k++) {
		char h = *j->p++;

		if (!isxdigit((unsigned char)h))
			return -1;
		v = v * 16 + (isdigit((unsigned char)h) ? h - '0' :
		    tolower((unsigned char)h) - 'a' + 10);
	}
	return v;
}

/* The code point of a \u escape (j->p after the "\u"), a surrogate pair
 * written as two escapes (as JSON writes characters above U+FFFF) joined
 * into one; a lone surrogate stands for itself.  -1 on bad hex digits. */
static long json_escape_u(struct json *j)
{
	long hi = json_hex4(j), lo;
	const char *after_hi = j->p;

	if (hi < 0xd800 || hi > 0xdbff)
		return hi;
	if (j->end - j->p >= 2 && j->p[0] == '\\' && j->p[1] == 'u') {
		j->p += 2;
		lo = json_hex4(j);
		if (lo >= 0xdc00 && lo <= 0xdfff)
			return 0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00);
	}
	j->p = after_hi;
	return hi;
}

/* Writes code point v as UTF-8 at out: the number of bytes (1 to 4). */
static size_t put_utf8(char *out, unsigned long v)
{
	if (v < 0x80) {
		out[0] = (char)v;
		return 1;
	}
	if (v < 0x800) {
		out[0] = (char)(0xc0 | (v >> 6));
		out[1] = (char)(0x80 | (v & 0x3f));
		return 2;
	}
	if (v < 0x10000) {
		out[0] = (char)(0xe0 | (v >> 12));
		out[1] = (char)(0x80 | ((v >> 6) & 0x3f));
		out[2] = (char)(0x80 | (v & 0x3f));
		return 3;
	}
	out[0] = (char)(0xf0 | (v >> 18));
	out[1] = (char)(0x80 | ((v >> 12) & 0x3f));
	out[2] = (char)(0x80 | ((v >> 6) & 0x3f));
	out[3] = (char)(0x80 | (v & 0x3f));
	return 4;
}

/* One escape (j->p after its backslash): appends what it stands for to
 * buf[*n] when buf is not NULL.  0, or -1 if malformed. */
static int json_escape(struct json *j, char *buf, size_t *n)
{
	static const char from[] = "bfnrt", to[] = "\b\f\n\r\t";
	const char *hit;
	long v;
	char c;

	if (j->p >= j->end)
		return -1;
	c = *j->p++;
	if (c != 'u') {
		/* \" \\ \/ (and any other character) stand for themselves. */
		hit = c != 0 ? strchr(from, c) : NULL;
		if (buf != NULL)
			buf[(*n)++] = hit != NULL ? to[hit - from] : c;
		return 0;
	}
	v = json_escape_u(j);
	if (v < 0)
		return -1;
	if (buf != NULL)
		*n += put_utf8(buf + *n, (unsigned long)v);
	return 0;
}

/* Parses a string; with out != NULL, stores it (malloc'ed, escapes
 * decoded, \u escapes above 0x7f encoded as UTF-8). */
static int json_string(struct json *j, char **out)
{
	char *buf = NULL;
	size_t n = 0;

	json_ws(j);
	if (j->p >= j->end || *j->p != '"')
		return -1;
	j->p++;
	/* An escape never decodes to more bytes than it takes. */
	if (out != NULL && (buf = malloc((size_t)(j->end - j->p) + 1)) == NULL)
		return -1;
	while (j->p < j->end && *j->p != '"') {
		char c = *j->p++;

		if (c == '\\') {
			if (json_escape(j, buf, &n) != 0)
				goto fail;
		} else if (buf != NULL) {
			buf[n++] = c;
		}
	}
	if (j->p >= j->end)
		goto fail;
	j->p++;
	if (buf != NULL) {
		buf[n] = 0;
		*out = buf;
	}
	return 0;
fail:
	free(buf);
	return -1;
}

static int json_skip(struct json *j, int depth);

/* The rest of an object or array after its opening character, skipped. */
static int json_skip_container(struct json *j, char close, int depth)
{
	json_ws(j);
	if (j->p < j->end && *j->p == close) {
		j->p++;
		return 0;
	}
	for (;;) {
		if (close == '}') {
			if (json_string(j, NULL) != 0)
				return -1;
			json_ws(j);
			if (j->p >= j->end || *j->p++ != ':')
				return -1;
		}
		if (json_skip(j, depth + 1) != 0)
			return -1;
		json_ws(j);
		if (j->p < j->end && *j->p == ',') {
			j->p++;
			continue;
		}
		if (j->p < j->end && *j->p == close) {
			j->p++;
			return 0;
		}
		return -1;
	}
}

/* Skips one value: a string, an object, an array, or a scalar (a run of
 * letters, digits and "+-.", not checked further). */
static int json_skip(struct json *j, int depth)
{
	const char *start;

	json_ws(j);
	if (j->p >= j->end || depth > VN_JSON_MAX_DEPTH)
		return -1;
	if (*j->p == '"')
		return json_string(j, NULL);
	if (*j->p == '{' || *j->p == '[') {
		char close = *j->p == '{' ? '}' : ']';

		j->p++;
		return json_skip_container(j, close, depth);
	}
	start = j->p;
	while (j->p < j->end && *j->p != 0 && (isalnum((unsigned char)*j->p) ||
	    strchr("+-.", *j->p) != NULL))
		j->p++;
	return j->p > start ? 0 : -1;
}

/* replication_spooling_dir: a string, or null (none); any other value is
 * kept as its JSON text in spool_bad. */
static int parse_spool(struct json *j, struct vn_env_config *out)
{
	const char *start = j->p;

	free(out->spool);
	free(out->spool_bad);
	out->spool = out->spool_bad = NULL;
	if (j->p < j->end && *j->p == '"')
		return json_string(j, &out->spool);
	if (json_skip(j, 0) != 0)
		return -1;
	if (j->p - start == 4 && memcmp(start, "null", 4) == 0)
		return 0;
	out->spool_bad = strndup(start, (size_t)(j->p - start));
	return out->spool_bad != NULL ? 0 : -1;
}

/* A boolean key: true or false sets *flag; any other value is skipped and
 * leaves it as it was. */
static int parse_bool(struct json *j, int *flag)
{
	if (json_literal(j, "true"))
		*flag = 1;
	else if (json_literal(j, "false"))
		*flag = 0;
	else
		return json_skip(j, 0);
	return 0;
}

/* A size key: a JSON integer of decimal digits sets *size (at most what an
 * unsigned long long holds); any other value is skipped and leaves it. */
static int parse_size(struct json *j, unsigned long long *size)
{
	const char *start = j->p;
	unsigned long long n = 0;

	while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
		unsigned d = (unsigned)(*j->p - '0');

		if (n > (ULLONG_MAX - d) / 10)
			break;
		n = n * 10 + d;
		j->p++;
	}
	if (j->p > start && (j->p == j->end || strchr(",} \t\r\n", *j->p) != NULL)) {
		*size = n;
		return 0;
	}
	j->p = start;
	return json_skip(j, 0);
}

/* One "key": value of the object; the last of a repeated key counts. */
static int parse_member(struct json *j, struct vn_env_config *out)
{
	char *key = NULL;
	int rc;

	if (json_string(j, &key) != 0)
		return -1;
	json_ws(j);
	if (j->p >= j->end || *j->p != ':') {
		free(key);
		return -1;
	}
	j->p++;
	json_ws(j);
	if (strcmp(key, "replication_spooling_dir") == 0)
		rc = parse_spool(j, out);
	else if (strcmp(key, "make_default") == 0)
		rc = parse_bool(j, &out->make_default);
	else if (strcmp(key, "warn_stderr") == 0)
		rc = parse_bool(j, &out->warn_stderr);
	else if (strcmp(key, "max_db_size") == 0)
		rc = parse_size(j, &out->max_db_size);
	else
		rc = json_skip(j, 0);
	free(key);
	return rc;
}

/* The object in j, and nothing but white space after it; 0 or -1 (j->p
 * then where the text went wrong). */
static int parse_object(struct json *j, struct vn_env_config *out)
{
	json_ws(j);
	if (j->p >= j->end || *j->p != '{')
		return -1;
	j->p++;
	json_ws(j);
	if (j->p < j->end && *j->p == '}') {
		j->p++;
	} else {
		for (;;) {
			if (parse_member(j, out) != 0)
				return -1;
			json_ws(j);
			if (j->p < j->end && *j->p == ',') {
				j->p++;
				continue;
			}
			if (j->p >= j->end || *j->p != '}')
				return -1;
			j->p++;
			break;
		}
	}
	json_ws(j);
	return j->p == j->end ? 0 : -1;
}

/* The first VN_CONFIG_MAX bytes of `path`, NUL-terminated and malloc'ed,
 * and their length in *len; NULL (errno set) when it cannot be read. */
static char *read_config_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "re");
	char *buf;

	if (f == NULL)
		return NULL;
	buf = malloc(VN_CONFIG_MAX + 1);
	if (buf != NULL) {
		*len = fread(buf, 1, VN_CONFIG_MAX, f);
		buf[*len] = 0;
	}
	fclose(f);
	return buf;
}

static void config_defaults(struct vn_env_config *config)
{
	config->spool = NULL;
	config->spool_bad = NULL;
	config->make_default = 0;
	config->warn_stderr = -1;
	config->max_db_size = 0;
}

void vn_config_free(struct vn_env_config *config)
{
	free(config->spool);
	free(config->spool_bad);
	config_defaults(config);
}

/* Parses text[0, len) into *out: 0, or -1 with what is wrong in
 * problem[0, cap) (and *out back to the defaults). */
static int parse_text(const char *text, size_t len, struct vn_env_config *out,
    char *problem, size_t cap)
{
	struct json j = { text, text + len }, first = j;

	if (parse_object(&j, out) == 0)
		return 0;
	vn_config_free(out);
	json_ws(&first);
	if (j.p == first.p && (j.p == j.end || *j.p != '{'))
		snprintf(problem, cap, "not a JSON object");
	else
		snprintf(problem, cap, "not valid JSON at byte %zu",
		    (size_t)(j.p - text));
	return -1;
}

int vn_config_from_env(struct vn_env_config *out, char *why, size_t cap)
{
	const char *env = getenv(VN_CONFIG_ENV);
	char *file = NULL;
	char problem[VN_CONFIG_WHY_MAX];
	size_t len = env != NULL ? strlen(env) : 0;
	int rc;

	config_defaults(out);
	if (len == 0)
		return 0;
	if (env[0] == '@') {
		file = read_config_file(env + 1, &len);
		if (file == NULL) {
			snprintf(problem, sizeof(problem), "cannot read %s: %s",
			    env + 1, strerror(errno));
			snprintf(why, cap, VN_CONFIG_ENV " is unusable (%s): "
			    VN_CONFIG_NOTHING, problem);
			return -1;
		}
	}
	rc = parse_text(file != NULL ? file : env, len, out, problem,
	    sizeof(problem));
	free(file);
	if (rc != 0) {
		snprintf(why, cap, VN_CONFIG_ENV " is unusable (%s): "
		    VN_CONFIG_NOTHING, problem);
	} else if (out->spool_bad != NULL) {
		snprintf(why, cap, VN_CONFIG_ENV ": replication_spooling_dir "
		    "must be a string, not %s: " VN_CONFIG_NOTHING,
		    out->spool_bad);
		rc = 1;
	}
	return rc;
}
