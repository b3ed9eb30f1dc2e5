/* See json.h. Recursive descent over the whole text held in memory. */
#include "json.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *p;
    char *err;
    int errlen;
    int failed;
} parser;

static jnode *value(parser *ps);

static void fail(parser *ps, const char *what) {
    if (!ps->failed)
        snprintf(ps->err, (size_t)ps->errlen, "JSON: %s near '%.20s'", what, ps->p);
    ps->failed = 1;
}

static void skip(parser *ps) {
    while (*ps->p == ' ' || *ps->p == '\n' || *ps->p == '\r' || *ps->p == '\t') ps->p++;
}

static jnode *node(jtype type) {
    jnode *n = calloc(1, sizeof *n);
    if (!n) { fputs("out of memory\n", stderr); exit(2); }
    n->type = type;
    return n;
}

static void push(jnode *n, jnode *item, char *key) {
    n->items = realloc(n->items, sizeof *n->items * (size_t)(n->len + 1));
    if (n->type == J_OBJ) n->keys = realloc(n->keys, sizeof *n->keys * (size_t)(n->len + 1));
    if (!n->items || (n->type == J_OBJ && !n->keys)) { fputs("out of memory\n", stderr); exit(2); }
    n->items[n->len] = item;
    if (n->type == J_OBJ) n->keys[n->len] = key;
    n->len++;
}

static char *string(parser *ps) {
    const char *start = ++ps->p; /* after the opening quote */
    size_t cap = 16, n = 0;
    char *out = malloc(cap);
    (void)start;
    while (*ps->p && *ps->p != '"') {
        char c = *ps->p++;
        if (c == '\\') {
            char e = *ps->p++;
            switch (e) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': c = '?'; ps->p += 4; break; /* non-ASCII is never needed by the reader */
            default: c = e;
            }
        }
        if (n + 2 > cap) out = realloc(out, cap *= 2);
        out[n++] = c;
    }
    if (*ps->p != '"') { fail(ps, "unterminated string"); return out; }
    ps->p++;
    out[n] = '\0';
    return out;
}

static jnode *number(parser *ps) {
    jnode *n = node(J_NUM);
    char *end;
    const char *s = ps->p;
    n->num = strtod(s, &end);
    if (end == s) { fail(ps, "bad number"); return n; }
    n->integer = strtoll(s, NULL, 10);
    ps->p = end;
    return n;
}

static jnode *container(parser *ps, jtype type, char close) {
    jnode *n = node(type);
    ps->p++;
    skip(ps);
    if (*ps->p == close) { ps->p++; return n; }
    for (;;) {
        char *key = NULL;
        skip(ps);
        if (type == J_OBJ) {
            if (*ps->p != '"') { fail(ps, "expected a key"); return n; }
            key = string(ps);
            skip(ps);
            if (*ps->p != ':') { fail(ps, "expected ':'"); return n; }
            ps->p++;
        }
        push(n, value(ps), key);
        if (ps->failed) return n;
        skip(ps);
        if (*ps->p == ',') { ps->p++; continue; }
        if (*ps->p == close) { ps->p++; return n; }
        fail(ps, "expected ',' or the closing bracket");
        return n;
    }
}

static jnode *value(parser *ps) {
    skip(ps);
    switch (*ps->p) {
    case '{': return container(ps, J_OBJ, '}');
    case '[': return container(ps, J_ARR, ']');
    case '"': { jnode *n = node(J_STR); n->str = string(ps); return n; }
    case 't': if (!strncmp(ps->p, "true", 4)) { jnode *n = node(J_BOOL); n->num = 1; ps->p += 4; return n; } break;
    case 'f': if (!strncmp(ps->p, "false", 5)) { jnode *n = node(J_BOOL); ps->p += 5; return n; } break;
    case 'n': if (!strncmp(ps->p, "null", 4)) { ps->p += 4; return node(J_NULL); } break;
    default: return number(ps);
    }
    fail(ps, "unexpected token");
    return node(J_NULL);
}

jnode *json_parse(const char *text, char *err, int errlen) {
    parser ps = {text, err, errlen, 0};
    jnode *root = value(&ps);
    skip(&ps);
    if (!ps.failed && *ps.p) fail(&ps, "trailing text");
    return ps.failed ? NULL : root;
}

const jnode *json_get(const jnode *obj, const char *key) {
    int i;
    if (!obj || obj->type != J_OBJ) return NULL;
    for (i = 0; i < obj->len; i++)
        if (!strcmp(obj->keys[i], key)) return obj->items[i];
    return NULL;
}
