/* The .npy subset of test vectors, parsed from memory: version 1.0, '<f4' or '<f8',
 * C order, at most NPY_MAX_DIMS dimensions. Hardened for hostile input: the header is
 * read within its stated length and the file's, every dimension is checked, the element
 * count and byte count are computed with overflow checks, and the data must fill the
 * rest of the file exactly. */
#ifndef VECTORS_NPY_H
#define VECTORS_NPY_H

#include <stddef.h>

#define NPY_MAX_DIMS 8

typedef struct {
    double *data; /* count values, converted to double */
    long long count;
    int ndim;
    long long shape[NPY_MAX_DIMS];
} array;

/* Parse size bytes; return 0 and fill *out, or -1 with a message in err (size errlen).
 * max_count bounds the elements (and so the allocation). */
int npy_parse(const unsigned char *buf, size_t size, long long max_count, array *out, char *err, int errlen);

#endif
