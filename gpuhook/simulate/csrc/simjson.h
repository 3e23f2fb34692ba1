/*
 * A small JSON document model for the simulated NVML state file (gpuhook simulate).
 *
 * The simulated libnvidia-ml and nvidia-smi must read the file that Python writes and, for a
 * reset, write it back without losing fields they do not know. So this is a complete JSON
 * parser (RFC 8259: objects, arrays, strings with escapes, numbers, true/false/null) into a
 * tree that keeps member order, plus a writer; not a streaming subset reader. Documents are
 * small (one record per GPU), so simplicity wins over speed.
 */
#ifndef GPUHOOK_SIMJSON_H
#define GPUHOOK_SIMJSON_H

#include <stddef.h>
#include <stdio.h>

enum sj_type { SJ_NULL, SJ_BOOL, SJ_NUMBER, SJ_STRING, SJ_ARRAY, SJ_OBJECT };

struct sj {
    enum sj_type type;
    int boolean;            /* SJ_BOOL */
    double number;          /* SJ_NUMBER, always set */
    long long integer;      /* SJ_NUMBER, valid when is_integer */
    int is_integer;         /* the number was written without fraction or exponent and fits */
    char *string;           /* SJ_STRING, UTF-8, NUL-terminated (embedded NULs are rejected) */
    char *key;              /* member name when this node is an object member */
    struct sj *child;       /* first element or member (arrays, objects) */
    struct sj *next;        /* next sibling */
};

/* Parse `len` bytes. On error returns NULL and writes "line L column C: what" into err. */
struct sj *sj_parse(const char *text, size_t len, char *err, size_t errlen);
void sj_free(struct sj *node);

/* Member `key` of an object (NULL if absent or not an object). */
struct sj *sj_get(const struct sj *object, const char *key);
size_t sj_length(const struct sj *array);

/* Set (or add) member `key` of an object; 0 on success, -1 when out of memory. */
int sj_set_integer(struct sj *object, const char *key, long long value);
int sj_set_bool(struct sj *object, const char *key, int value);
/* Make member `key` an empty array (adding it if absent). */
int sj_set_empty_array(struct sj *object, const char *key);

/* Write `node` as indented JSON followed by a newline; returns 0 or -1 on a write error. */
int sj_write(FILE *out, const struct sj *node);

#endif
