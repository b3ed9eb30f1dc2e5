/* A strict JSON parser for test-vector manifests (RFC 8259) in UTF-8 (RFC 3629: the text
 * is refused whole if any byte sequence is not): objects, arrays, strings,
 * numbers, true, false, null. Hardened for hostile input: the text is read within its
 * given length only, nesting is bounded (JSON_MAX_DEPTH), numbers follow the RFC grammar
 * (no inf, nan, hex, leading '+' or zeros) and must be finite as doubles, strings hold no
 * raw control characters and only the RFC's escapes (a \u escape of a non-ASCII code
 * point reads as '?': the reader never needs one), duplicate keys are refused, and an object has at
 * most JSON_MAX_MEMBERS members.
 * The reader never frees its nodes (it is a short-lived process); the fuzz target does. */
#ifndef VECTORS_JSON_H
#define VECTORS_JSON_H

#include <stddef.h>

#define JSON_MAX_DEPTH 64
#define JSON_MAX_MEMBERS 256 /* per object: a manifest's objects have at most a dozen */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jnode {
    jtype type;
    double num;        /* J_NUM (and J_BOOL: 0 or 1) */
    int is_int;        /* J_NUM written without fraction or exponent, and fitting in integer */
    long long integer; /* J_NUM with is_int set */
    char *str;         /* J_STR, NUL-terminated (a \u0000 escape reads as '?') */
    long long len;     /* J_ARR, J_OBJ: number of items */
    struct jnode **items;
    char **keys;       /* J_OBJ */
} jnode;

/* Parse len bytes of text; on error return NULL and write a message to err (size errlen). */
jnode *json_parse(const char *text, size_t len, char *err, int errlen);
/* Free a tree json_parse returned (NULL is ignored). */
void json_free(jnode *n);
/* The member key of an object, or NULL. */
const jnode *json_get(const jnode *obj, const char *key);

#endif
