/* A JSON subset parser for test-vector manifests: objects, arrays, strings without
 * \u escapes beyond ASCII, numbers, true, false, null. Nodes are never freed: the
 * reader is a short-lived process. */
#ifndef VECTORS_JSON_H
#define VECTORS_JSON_H

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jnode {
    jtype type;
    double num;        /* J_NUM (and J_BOOL: 0 or 1) */
    long long integer; /* J_NUM written without fraction or exponent */
    char *str;         /* J_STR */
    int len;           /* J_ARR, J_OBJ: number of items */
    struct jnode **items;
    char **keys;       /* J_OBJ */
} jnode;

/* Parse text; on error return NULL and write a message to err (size errlen). */
jnode *json_parse(const char *text, char *err, int errlen);
/* The member key of an object, or NULL. */
const jnode *json_get(const jnode *obj, const char *key);

#endif
