/*
 * VERNEUIL_CONFIG for the writer (config.h): just the keys the VFS needs from
 * a JSON object, every other value skipped whatever it holds, with bounds on
 * the file's size and on nesting.
 */
#define _GNU_SOURCE
#include "config.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Largest VERNEUIL_CONFIG file we read: configs are a few hundred bytes. */
#define VN_CONFIG_MAX (1 << 20)

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

/* Parses a string; with out != NULL, stores it (malloc'ed, ASCII escapes
 * decoded, \u escapes above 0x7f encoded as UTF-8). */
static int json_string(struct json *j, char **out)
{
	char *buf = NULL;
	size_t n = 0;

	json_ws(j);
	if (j->p >= j->end || *j->p != '"')
		return -1;
	j->p++;
	if (out != NULL && (buf = malloc((size_t)(j->end - j->p) * 2 + 1)) == NULL)
		return -1;
	while (j->p < j->end && *j->p != '"') {
		unsigned c = (unsigned char)*j->p++;

		if (c == '\\') {
			if (j->p >= j->end)
				goto fail;
			c = (unsigned char)*j->p++;
			switch (c) {
			case 'b': c = '\b'; break;
			case 'f': c = '\f'; break;
			case 'n': c = '\n'; break;
			case 'r': c = '\r'; break;
			case 't': c = '\t'; break;
			case 'u': {
				unsigned v = 0;

				if (j->end - j->p < 4)
					goto fail;
				for (int k = 0; k < 4; k++) {
					char h = *j->p++;

					if (!isxdigit((unsigned char)h))
						goto fail;
					v = v * 16 + (unsigned)(isdigit((unsigned char)h) ?
					    h - '0' : (tolower((unsigned char)h) - 'a' + 10));
				}
				if (buf != NULL && v >= 0x80) {
					if (v < 0x800) {
						buf[n++] = (char)(0xc0 | (v >> 6));
					} else {
						buf[n++] = (char)(0xe0 | (v >> 12));
						buf[n++] = (char)(0x80 | ((v >> 6) & 0x3f));
					}
					c = 0x80 | (v & 0x3f);
				} else {
					c = v;
				}
				break;
			}
			default: break; /* \" \\ \/ */
			}
		}
		if (buf != NULL)
			buf[n++] = (char)c;
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

static int json_skip(struct json *j, int depth)
{
	json_ws(j);
	if (j->p >= j->end || depth > VN_JSON_MAX_DEPTH)
		return -1;
	if (*j->p == '"')
		return json_string(j, NULL);
	if (*j->p == '{' || *j->p == '[') {
		char close = *j->p == '{' ? '}' : ']';

		j->p++;
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
	while (j->p < j->end && (isalnum((unsigned char)*j->p) ||
	    strchr("+-.", *j->p) != NULL))
		j->p++;
	return 0;
}

int vn_config_parse(const char *text, size_t len, struct vn_env_config *out)
{
	struct json j = { text, text + len };
	char **spool = &out->spool;
	int *make_default = &out->make_default;
	int *warn_stderr = &out->warn_stderr;

	*spool = NULL;
	*make_default = 0;
	*warn_stderr = -1;
	json_ws(&j);
	if (j.p >= j.end || *j.p++ != '{')
		return -1;
	json_ws(&j);
	if (j.p < j.end && *j.p == '}')
		return 0;
	for (;;) {
		char *key = NULL;

		if (json_string(&j, &key) != 0)
			return -1;
		json_ws(&j);
		if (j.p >= j.end || *j.p++ != ':') {
			free(key);
			return -1;
		}
		json_ws(&j);
		if (strcmp(key, "replication_spooling_dir") == 0 &&
		    j.p < j.end && *j.p == '"') {
			free(*spool);
			*spool = NULL;
			if (json_string(&j, spool) != 0) {
				free(key);
				return -1;
			}
		} else if (strcmp(key, "make_default") == 0 &&
		    j.end - j.p >= 4 && memcmp(j.p, "true", 4) == 0) {
			*make_default = 1;
			j.p += 4;
		} else if (strcmp(key, "warn_stderr") == 0 &&
		    j.end - j.p >= 5 && memcmp(j.p, "false", 5) == 0) {
			*warn_stderr = 0;
			j.p += 5;
		} else if (strcmp(key, "warn_stderr") == 0 &&
		    j.end - j.p >= 4 && memcmp(j.p, "true", 4) == 0) {
			*warn_stderr = 1;
			j.p += 4;
		} else if (json_skip(&j, 0) != 0) {
			free(key);
			return -1;
		}
		free(key);
		json_ws(&j);
		if (j.p < j.end && *j.p == ',') {
			j.p++;
			continue;
		}
		if (j.p < j.end && *j.p == '}')
			return 0;
		return -1;
	}
}

char *vn_config_read_file(const char *path, size_t *len)
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
