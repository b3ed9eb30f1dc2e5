/* See json.h. Recursive descent over the text held in memory, bounded by its length
 * and by JSON_MAX_DEPTH; every allocation size is checked before it is made. */
#include "json.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *p, *end;
    char *err;
    int errlen, failed, depth;
} parser;

static jnode *value(parser *ps);

static void fail(parser *ps, const char *what) {
    if (!ps->failed) {
        int left = (int)(ps->end - ps->p > 20 ? 20 : ps->end - ps->p), i;
        char near[21];
        for (i = 0; i < left; i++) { /* printable context only */
            unsigned char c = (unsigned char)ps->p[i];
            near[i] = c >= 0x20 && c < 0x7f ? (char)c : '?';
        }
        near[left] = '\0';
        snprintf(ps->err, (size_t)ps->errlen, "JSON: %s near '%s'", what, near);
    }
    ps->failed = 1;
}

static int more(const parser *ps) { return ps->p < ps->end; }
static char peek(const parser *ps) { return more(ps) ? *ps->p : '\0'; }

static void skip(parser *ps) {
    while (more(ps) && (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t')) ps->p++;
}

static void *checked_alloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p) { fputs("vectors_check: out of memory\n", stderr); exit(2); }
    return p;
}

void json_free(jnode *n) {
    long long i;
    if (!n) return;
    for (i = 0; i < n->len; i++) {
        json_free(n->items[i]);
        if (n->keys) free(n->keys[i]);
    }
    free(n->items);
    free(n->keys);
    free(n->str);
    free(n);
}

/* Free a container being built (and the key read for its next item): on a parse error. */
static jnode *discard(jnode *n, char *key) {
    json_free(n);
    free(key);
    return NULL;
}

static jnode *node(jtype type) {
    jnode *n = checked_alloc(sizeof *n);
    n->type = type;
    return n;
}

/* Append an item (and its key); capacity doubles, with the byte counts checked. */
static void push(jnode *n, long long *cap, jnode *item, char *key) {
    if (n->len == *cap) {
        long long grown = *cap ? *cap * 2 : 4;
        void *items, *keys = NULL;
        if (grown > (long long)(SIZE_MAX / sizeof(void *))) { fputs("vectors_check: out of memory\n", stderr); exit(2); }
        items = realloc(n->items, sizeof(void *) * (size_t)grown);
        if (items) n->items = items;
        if (n->type == J_OBJ) {
            keys = realloc(n->keys, sizeof(void *) * (size_t)grown);
            if (keys) n->keys = keys;
        }
        if (!items || (n->type == J_OBJ && !keys)) { fputs("vectors_check: out of memory\n", stderr); exit(2); }
        *cap = grown;
    }
    n->items[n->len] = item;
    if (n->type == J_OBJ) n->keys[n->len] = key;
    n->len++;
}

static int hexdigit(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* A string starting at the opening quote. The output is never longer than the input. */
static char *string(parser *ps) {
    const char *start = ++ps->p; /* after the opening quote */
    size_t n = 0;
    char *out;
    while (more(ps) && *ps->p != '"') ps->p += *ps->p == '\\' && ps->p + 1 < ps->end ? 2 : 1;
    if (!more(ps)) { ps->p = start; fail(ps, "unterminated string"); return NULL; }
    /* from here every error path frees out */
    out = checked_alloc((size_t)(ps->p - start) + 1);
    ps->p = start;
    while (*ps->p != '"') { /* the closing quote is known to be there */
        char c = *ps->p++;
        if ((unsigned char)c < 0x20) { free(out); fail(ps, "a control character in a string"); return NULL; }
        if (c == '\\') {
            char e = *ps->p++; /* the scan above proved a character follows a backslash */
            switch (e) {
            case '"': case '\\': case '/': c = e; break;
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                int k;
                unsigned code = 0;
                for (k = 0; k < 4; k++) {
                    if (ps->p + k >= ps->end || !hexdigit(ps->p[k])) { free(out); fail(ps, "a \\u escape without 4 hex digits"); return NULL; }
                    code = code * 16 + (unsigned)(ps->p[k] <= '9' ? ps->p[k] - '0' : (ps->p[k] | 0x20) - 'a' + 10);
                }
                ps->p += 4;
                c = code > 0 && code < 0x80 ? (char)code : '?';
                break;
            }
            default: ps->p--; free(out); fail(ps, "an unknown escape in a string"); return NULL;
            }
        }
        out[n++] = c;
    }
    ps->p++;
    out[n] = '\0';
    return out;
}

/* RFC 8259: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?, finite as a double. */
static jnode *number(parser *ps) {
    const char *s = ps->p, *q = ps->p;
    char buf[64];
    int integral = 1;
    jnode *n;
    if (q < ps->end && *q == '-') q++;
    if (q < ps->end && *q == '0') q++;
    else if (q < ps->end && *q >= '1' && *q <= '9') while (q < ps->end && *q >= '0' && *q <= '9') q++;
    else { fail(ps, "not a JSON value"); return NULL; }
    if (q < ps->end && *q == '.') {
        integral = 0;
        if (++q >= ps->end || *q < '0' || *q > '9') { fail(ps, "bad number"); return NULL; }
        while (q < ps->end && *q >= '0' && *q <= '9') q++;
    }
    if (q < ps->end && (*q == 'e' || *q == 'E')) {
        integral = 0;
        q++;
        if (q < ps->end && (*q == '+' || *q == '-')) q++;
        if (q >= ps->end || *q < '0' || *q > '9') { fail(ps, "bad number"); return NULL; }
        while (q < ps->end && *q >= '0' && *q <= '9') q++;
    }
    if (q - s >= (long)sizeof buf) { fail(ps, "a number of too many digits"); return NULL; }
    memcpy(buf, s, (size_t)(q - s)); /* strtod needs a terminated copy */
    buf[q - s] = '\0';
    n = node(J_NUM);
    errno = 0;
    n->num = strtod(buf, NULL);
    if (n->num > 1.7976931348623157e308 || n->num < -1.7976931348623157e308) { free(n); fail(ps, "a number too large for a double"); return NULL; }
    if (integral) {
        errno = 0;
        n->integer = strtoll(buf, NULL, 10);
        n->is_int = errno == 0;
    }
    ps->p = q;
    return n;
}

static jnode *container(parser *ps, jtype type, char close) {
    jnode *n = node(type);
    long long cap = 0, i;
    if (++ps->depth > JSON_MAX_DEPTH) { fail(ps, "nested too deeply"); return discard(n, NULL); }
    ps->p++;
    skip(ps);
    if (peek(ps) == close) { ps->p++; ps->depth--; return n; }
    for (;;) {
        char *key = NULL;
        jnode *item;
        skip(ps);
        if (type == J_OBJ) {
            if (peek(ps) != '"') { fail(ps, "expected a key"); return discard(n, NULL); }
            if (n->len == JSON_MAX_MEMBERS) { fail(ps, "an object of too many members"); return discard(n, NULL); }
            key = string(ps);
            if (!key) return discard(n, NULL);
            for (i = 0; i < n->len; i++) /* quadratic, so members are bounded */
                if (!strcmp(n->keys[i], key)) { fail(ps, "a duplicate key"); return discard(n, key); }
            skip(ps);
            if (peek(ps) != ':') { fail(ps, "expected ':'"); return discard(n, key); }
            ps->p++;
        }
        item = value(ps);
        if (!item) return discard(n, key);
        push(n, &cap, item, key);
        skip(ps);
        if (peek(ps) == ',') { ps->p++; continue; }
        if (peek(ps) == close) { ps->p++; ps->depth--; return n; }
        fail(ps, "expected ',' or the closing bracket");
        return discard(n, NULL);
    }
}

static int word(parser *ps, const char *w) {
    size_t k = strlen(w);
    if ((size_t)(ps->end - ps->p) < k || memcmp(ps->p, w, k)) return 0;
    ps->p += k;
    return 1;
}

static jnode *value(parser *ps) {
    jnode *n;
    skip(ps);
    switch (peek(ps)) {
    case '{': return container(ps, J_OBJ, '}');
    case '[': return container(ps, J_ARR, ']');
    case '"': {
        char *s = string(ps);
        if (!s) return NULL;
        n = node(J_STR);
        n->str = s;
        return n;
    }
    case 't': if (word(ps, "true")) { n = node(J_BOOL); n->num = 1; return n; } break;
    case 'f': if (word(ps, "false")) return node(J_BOOL); break;
    case 'n': if (word(ps, "null")) return node(J_NULL); break;
    default: return number(ps);
    }
    fail(ps, "not a JSON value");
    return NULL;
}

/* Whether len bytes are UTF-8 as RFC 3629 has it: no overlong form, no surrogate, nothing
 * past U+10FFFF, no sequence cut short. Returns the offset of the first bad byte, or -1. */
static long long utf8_error(const unsigned char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i], need, k;
        unsigned long code;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) need = 1, code = c & 0x1F;
        else if (c >= 0xE0 && c <= 0xEF) need = 2, code = c & 0x0F;
        else if (c >= 0xF0 && c <= 0xF4) need = 3, code = c & 0x07;
        else return (long long)i;
        if (len - i <= need) return (long long)i;
        for (k = 1; k <= need; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return (long long)i;
            code = code << 6 | (s[i + k] & 0x3F);
        }
        if ((need == 2 && code < 0x800) || (need == 3 && code < 0x10000) || code > 0x10FFFF ||
            (code >= 0xD800 && code <= 0xDFFF))
            return (long long)i;
        i += need + 1;
    }
    return -1;
}

jnode *json_parse(const char *text, size_t len, char *err, int errlen) {
    parser ps;
    jnode *root;
    long long bad = utf8_error((const unsigned char *)text, len);
    if (bad >= 0) {
        snprintf(err, (size_t)errlen, "JSON: not UTF-8 at byte %lld", bad);
        return NULL;
    }
    ps.p = text;
    ps.end = text + len;
    ps.err = err;
    ps.errlen = errlen;
    ps.failed = ps.depth = 0;
    root = value(&ps);
    skip(&ps);
    if (!ps.failed && more(&ps)) fail(&ps, "trailing text");
    if (ps.failed) {
        json_free(root);
        return NULL;
    }
    return root;
}

const jnode *json_get(const jnode *obj, const char *key) {
    long long i;
    if (!obj || obj->type != J_OBJ) return NULL;
    for (i = 0; i < obj->len; i++)
        if (!strcmp(obj->keys[i], key)) return obj->items[i];
    return NULL;
}
