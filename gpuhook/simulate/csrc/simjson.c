/*
 * JSON parser and writer for the simulated NVML state file; see simjson.h.
 */
#include "simjson.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* Deep nesting only comes from a damaged or hostile file; refuse it instead of recursing. */
#define MAX_DEPTH 64

struct parser {
    const char *text;
    size_t len;
    size_t pos;
    char *err;
    size_t errlen;
    int failed;
};

static void fail(struct parser *p, const char *fmt, ...)
{
    size_t line = 1, column = 1, i;
    char what[160];
    va_list ap;

    if (p->failed)
        return;
    p->failed = 1;
    for (i = 0; i < p->pos && i < p->len; i++) {
        if (p->text[i] == '\n') {
            line++;
            column = 1;
        } else {
            column++;
        }
    }
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (p->err != NULL && p->errlen > 0)
        snprintf(p->err, p->errlen, "line %zu column %zu: %s", line, column, what);
}

static struct sj *new_node(struct parser *p, enum sj_type type)
{
    struct sj *node = calloc(1, sizeof *node);

    if (node == NULL)
        fail(p, "out of memory");
    else
        node->type = type;
    return node;
}

static void skip_space(struct parser *p)
{
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        p->pos++;
    }
}

static int literal(struct parser *p, const char *word)
{
    size_t n = strlen(word);

    if (p->len - p->pos >= n && memcmp(p->text + p->pos, word, n) == 0) {
        p->pos += n;
        return 1;
    }
    return 0;
}

static int hex4(struct parser *p, unsigned *out)
{
    unsigned value = 0;
    int i;

    if (p->len - p->pos < 4) {
        fail(p, "truncated \\u escape");
        return -1;
    }
    for (i = 0; i < 4; i++) {
        char c = p->text[p->pos++];
        value <<= 4;
        if (c >= '0' && c <= '9')
            value |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            value |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            value |= (unsigned)(c - 'A' + 10);
        else {
            fail(p, "bad hex digit in \\u escape");
            return -1;
        }
    }
    *out = value;
    return 0;
}

static size_t put_utf8(char *out, unsigned cp)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Parse a string at p->pos (which is at the opening quote); returns a malloc'ed copy. */
static char *parse_string(struct parser *p)
{
    size_t cap = 16, n = 0;
    char *out = malloc(cap);

    p->pos++;
    if (out == NULL) {
        fail(p, "out of memory");
        return NULL;
    }
    for (;;) {
        unsigned char c;

        if (p->pos >= p->len) {
            fail(p, "unterminated string");
            goto bad;
        }
        if (cap - n < 8) {
            char *bigger = realloc(out, cap * 2);
            if (bigger == NULL) {
                fail(p, "out of memory");
                goto bad;
            }
            out = bigger;
            cap *= 2;
        }
        c = (unsigned char)p->text[p->pos++];
        if (c == '"')
            break;
        if (c < 0x20) {
            fail(p, "control character in string");
            goto bad;
        }
        if (c != '\\') {
            out[n++] = (char)c;
            continue;
        }
        if (p->pos >= p->len) {
            fail(p, "unterminated escape");
            goto bad;
        }
        c = (unsigned char)p->text[p->pos++];
        switch (c) {
        case '"': out[n++] = '"'; break;
        case '\\': out[n++] = '\\'; break;
        case '/': out[n++] = '/'; break;
        case 'b': out[n++] = '\b'; break;
        case 'f': out[n++] = '\f'; break;
        case 'n': out[n++] = '\n'; break;
        case 'r': out[n++] = '\r'; break;
        case 't': out[n++] = '\t'; break;
        case 'u': {
            unsigned cp, low;
            if (hex4(p, &cp) < 0)
                goto bad;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (!literal(p, "\\u") || hex4(p, &low) < 0 || low < 0xDC00 || low > 0xDFFF) {
                    fail(p, "unpaired surrogate in \\u escape");
                    goto bad;
                }
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                fail(p, "unpaired surrogate in \\u escape");
                goto bad;
            }
            if (cp == 0) {
                fail(p, "NUL character in string");
                goto bad;
            }
            n += put_utf8(out + n, cp);
            break;
        }
        default:
            fail(p, "bad escape \\%c", c);
            goto bad;
        }
    }
    out[n] = '\0';
    return out;
bad:
    free(out);
    return NULL;
}

static struct sj *parse_number(struct parser *p)
{
    size_t start = p->pos;
    int integral = 1;
    char buf[64];
    struct sj *node;
    char *end;

    if (p->pos < p->len && p->text[p->pos] == '-')
        p->pos++;
    if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') {
        fail(p, "bad number");
        return NULL;
    }
    if (p->text[p->pos] == '0')
        p->pos++;
    else
        while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9')
            p->pos++;
    if (p->pos < p->len && p->text[p->pos] == '.') {
        integral = 0;
        p->pos++;
        if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') {
            fail(p, "bad number: digits must follow '.'");
            return NULL;
        }
        while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9')
            p->pos++;
    }
    if (p->pos < p->len && (p->text[p->pos] == 'e' || p->text[p->pos] == 'E')) {
        integral = 0;
        p->pos++;
        if (p->pos < p->len && (p->text[p->pos] == '+' || p->text[p->pos] == '-'))
            p->pos++;
        if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') {
            fail(p, "bad number: digits must follow the exponent");
            return NULL;
        }
        while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9')
            p->pos++;
    }
    if (p->pos - start >= sizeof buf) {
        fail(p, "number too long");
        return NULL;
    }
    memcpy(buf, p->text + start, p->pos - start);
    buf[p->pos - start] = '\0';
    if ((node = new_node(p, SJ_NUMBER)) == NULL)
        return NULL;
    node->number = strtod(buf, NULL);
    if (integral) {
        errno = 0;
        node->integer = strtoll(buf, &end, 10);
        node->is_integer = errno == 0 && *end == '\0';
    }
    return node;
}

static struct sj *parse_value(struct parser *p, int depth);

static struct sj *parse_container(struct parser *p, int depth, int is_object)
{
    struct sj *node = new_node(p, is_object ? SJ_OBJECT : SJ_ARRAY), **tail;
    char close = is_object ? '}' : ']';

    if (node == NULL)
        return NULL;
    tail = &node->child;
    p->pos++;
    skip_space(p);
    if (p->pos < p->len && p->text[p->pos] == close) {
        p->pos++;
        return node;
    }
    for (;;) {
        char *key = NULL;
        struct sj *item;

        skip_space(p);
        if (is_object) {
            if (p->pos >= p->len || p->text[p->pos] != '"') {
                fail(p, "expected a member name in double quotes");
                goto bad;
            }
            if ((key = parse_string(p)) == NULL)
                goto bad;
            skip_space(p);
            if (p->pos >= p->len || p->text[p->pos] != ':') {
                free(key);
                fail(p, "expected ':' after member name");
                goto bad;
            }
            p->pos++;
        }
        if ((item = parse_value(p, depth + 1)) == NULL) {
            free(key);
            goto bad;
        }
        item->key = key;
        *tail = item;
        tail = &item->next;
        skip_space(p);
        if (p->pos < p->len && p->text[p->pos] == ',') {
            p->pos++;
            continue;
        }
        if (p->pos < p->len && p->text[p->pos] == close) {
            p->pos++;
            return node;
        }
        fail(p, is_object ? "expected ',' or '}'" : "expected ',' or ']'");
        goto bad;
    }
bad:
    sj_free(node);
    return NULL;
}

static struct sj *parse_value(struct parser *p, int depth)
{
    struct sj *node;
    char c;

    if (depth > MAX_DEPTH) {
        fail(p, "nested deeper than %d levels", MAX_DEPTH);
        return NULL;
    }
    skip_space(p);
    if (p->pos >= p->len) {
        fail(p, "unexpected end of input");
        return NULL;
    }
    c = p->text[p->pos];
    if (c == '{' || c == '[')
        return parse_container(p, depth, c == '{');
    if (c == '"') {
        char *s = parse_string(p);
        if (s == NULL)
            return NULL;
        if ((node = new_node(p, SJ_STRING)) == NULL) {
            free(s);
            return NULL;
        }
        node->string = s;
        return node;
    }
    if (c == '-' || (c >= '0' && c <= '9'))
        return parse_number(p);
    if (literal(p, "true") || literal(p, "false")) {
        if ((node = new_node(p, SJ_BOOL)) != NULL)
            node->boolean = c == 't';
        return node;
    }
    if (literal(p, "null"))
        return new_node(p, SJ_NULL);
    fail(p, "unexpected character '%c'", c);
    return NULL;
}

struct sj *sj_parse(const char *text, size_t len, char *err, size_t errlen)
{
    struct parser p = {text, len, 0, err, errlen, 0};
    struct sj *root;

    if (memchr(text, '\0', len) != NULL) {
        p.pos = (size_t)((const char *)memchr(text, '\0', len) - text);
        fail(&p, "NUL byte in input");
        return NULL;
    }
    root = parse_value(&p, 0);
    if (root == NULL)
        return NULL;
    skip_space(&p);
    if (p.pos != p.len) {
        fail(&p, "unexpected text after the JSON value");
        sj_free(root);
        return NULL;
    }
    return root;
}

void sj_free(struct sj *node)
{
    while (node != NULL) {
        struct sj *next = node->next;
        sj_free(node->child);
        free(node->string);
        free(node->key);
        free(node);
        node = next;
    }
}

struct sj *sj_get(const struct sj *object, const char *key)
{
    struct sj *member;

    if (object == NULL || object->type != SJ_OBJECT)
        return NULL;
    for (member = object->child; member != NULL; member = member->next)
        if (strcmp(member->key, key) == 0)
            return member;
    return NULL;
}

size_t sj_length(const struct sj *array)
{
    size_t n = 0;
    const struct sj *item;

    if (array == NULL || (array->type != SJ_ARRAY && array->type != SJ_OBJECT))
        return 0;
    for (item = array->child; item != NULL; item = item->next)
        n++;
    return n;
}

/* The member `key`, emptied of its old value, or a new one appended; NULL if out of memory. */
static struct sj *member_for_set(struct sj *object, const char *key)
{
    struct sj *member = sj_get(object, key), **tail;

    if (member != NULL) {
        sj_free(member->child);
        free(member->string);
        member->child = NULL;
        member->string = NULL;
        return member;
    }
    if (object == NULL || object->type != SJ_OBJECT)
        return NULL;
    if ((member = calloc(1, sizeof *member)) == NULL)
        return NULL;
    if ((member->key = strdup(key)) == NULL) {
        free(member);
        return NULL;
    }
    for (tail = &object->child; *tail != NULL; tail = &(*tail)->next)
        ;
    *tail = member;
    return member;
}

int sj_set_integer(struct sj *object, const char *key, long long value)
{
    struct sj *member = member_for_set(object, key);

    if (member == NULL)
        return -1;
    member->type = SJ_NUMBER;
    member->integer = value;
    member->number = (double)value;
    member->is_integer = 1;
    return 0;
}

int sj_set_bool(struct sj *object, const char *key, int value)
{
    struct sj *member = member_for_set(object, key);

    if (member == NULL)
        return -1;
    member->type = SJ_BOOL;
    member->boolean = value != 0;
    return 0;
}

int sj_set_empty_array(struct sj *object, const char *key)
{
    struct sj *member = member_for_set(object, key);

    if (member == NULL)
        return -1;
    member->type = SJ_ARRAY;
    return 0;
}

static void write_string(FILE *out, const char *s)
{
    fputc('"', out);
    for (; *s != '\0'; s++) {
        unsigned char c = (unsigned char)*s;
        switch (c) {
        case '"': fputs("\\\"", out); break;
        case '\\': fputs("\\\\", out); break;
        case '\n': fputs("\\n", out); break;
        case '\r': fputs("\\r", out); break;
        case '\t': fputs("\\t", out); break;
        default:
            if (c < 0x20)
                fprintf(out, "\\u%04x", c);
            else
                fputc(c, out);
        }
    }
    fputc('"', out);
}

static void write_node(FILE *out, const struct sj *node, int indent)
{
    const struct sj *item;
    int first = 1;

    switch (node->type) {
    case SJ_NULL: fputs("null", out); return;
    case SJ_BOOL: fputs(node->boolean ? "true" : "false", out); return;
    case SJ_NUMBER:
        if (node->is_integer)
            fprintf(out, "%lld", node->integer);
        else
            fprintf(out, "%.17g", node->number);
        return;
    case SJ_STRING: write_string(out, node->string); return;
    case SJ_ARRAY:
    case SJ_OBJECT:
        if (node->child == NULL) {
            fputs(node->type == SJ_ARRAY ? "[]" : "{}", out);
            return;
        }
        fputc(node->type == SJ_ARRAY ? '[' : '{', out);
        for (item = node->child; item != NULL; item = item->next) {
            fprintf(out, "%s\n%*s", first ? "" : ",", indent + 2, "");
            first = 0;
            if (node->type == SJ_OBJECT) {
                write_string(out, item->key);
                fputs(": ", out);
            }
            write_node(out, item, indent + 2);
        }
        fprintf(out, "\n%*s%c", indent, "", node->type == SJ_ARRAY ? ']' : '}');
        return;
    }
}

int sj_write(FILE *out, const struct sj *node)
{
    write_node(out, node, 0);
    fputc('\n', out);
    return ferror(out) ? -1 : 0;
}
