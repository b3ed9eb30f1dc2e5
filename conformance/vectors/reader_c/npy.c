/* See npy.h. */
#include "npy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int refuse(char *err, int errlen, const char *what) {
    snprintf(err, (size_t)errlen, "%s", what);
    return -1;
}

/* The value text after key in the header dictionary, or NULL. */
static const char *after(const char *header, const char *key) {
    const char *s = strstr(header, key);
    return s ? s + strlen(key) : NULL;
}

/* Parse "(d0, d1, ...)" with each d a decimal of at most 18 digits. */
static int parse_shape(const char *s, array *a, char *err, int errlen) {
    if (!s) return refuse(err, errlen, "no 'shape' in the .npy header");
    while (*s == ' ') s++;
    if (*s++ != '(') return refuse(err, errlen, "the .npy shape is not a tuple");
    for (;;) {
        long long d = 0;
        int digits = 0;
        while (*s == ' ') s++;
        if (*s == ')') break;
        while (*s >= '0' && *s <= '9') {
            if (++digits > 18) return refuse(err, errlen, "a .npy dimension is too large");
            d = d * 10 + (*s++ - '0');
        }
        if (!digits) return refuse(err, errlen, "a .npy dimension is not a number");
        if (a->ndim == NPY_MAX_DIMS) return refuse(err, errlen, "a .npy array of too many dimensions");
        a->shape[a->ndim++] = d;
        while (*s == ' ') s++;
        if (*s == ',') s++;
        else if (*s != ')') return refuse(err, errlen, "a malformed .npy shape");
    }
    return 0;
}

int npy_parse(const unsigned char *buf, size_t size, long long max_count, array *out, char *err, int errlen) {
    char header[65536 + 1];
    const char *descr, *fortran;
    size_t hlen, body, item;
    long long count = 1, i;
    int k, f4;
    array a;
    memset(&a, 0, sizeof a);
    memset(out, 0, sizeof *out);
    if (size < 10 || memcmp(buf, "\x93NUMPY\x01\x00", 8)) return refuse(err, errlen, "not a version 1.0 .npy");
    hlen = (size_t)buf[8] | (size_t)buf[9] << 8;
    if (hlen > size - 10) return refuse(err, errlen, "the .npy header runs past the end of the file");
    memcpy(header, buf + 10, hlen);
    header[hlen] = '\0';
    if (strlen(header) != hlen) return refuse(err, errlen, "a NUL byte in the .npy header");
    descr = after(header, "'descr':");
    fortran = after(header, "'fortran_order':");
    if (!descr || !fortran) return refuse(err, errlen, "the .npy header has no 'descr' or 'fortran_order'");
    while (*descr == ' ') descr++;
    if (!strncmp(descr, "'<f4'", 5)) f4 = 1;
    else if (!strncmp(descr, "'<f8'", 5)) f4 = 0;
    else return refuse(err, errlen, "the .npy dtype is not '<f4' or '<f8'");
    while (*fortran == ' ') fortran++;
    if (strncmp(fortran, "False", 5)) return refuse(err, errlen, "the .npy array is not in C order");
    if (parse_shape(after(header, "'shape':"), &a, err, errlen)) return -1;
    for (k = 0; k < a.ndim; k++) { /* overflow-checked product, bounded by max_count */
        if (a.shape[k] != 0 && count > max_count / a.shape[k]) return refuse(err, errlen, "a .npy array of too many elements");
        count *= a.shape[k];
    }
    if (count > max_count) return refuse(err, errlen, "a .npy array of too many elements");
    item = f4 ? 4 : 8;
    body = size - 10 - hlen;
    if (body / item != (size_t)count || body % item) return refuse(err, errlen, "the .npy data size does not match shape");
    a.count = count;
    a.data = malloc(sizeof(double) * (size_t)(count ? count : 1));
    if (!a.data) return refuse(err, errlen, "out of memory for a .npy array");
    for (i = 0; i < count; i++) { /* little-endian bytes, whatever this machine's order */
        const unsigned char *b = buf + 10 + hlen + (size_t)i * item;
        if (f4) {
            unsigned int u = (unsigned int)b[0] | (unsigned int)b[1] << 8 | (unsigned int)b[2] << 16 | (unsigned int)b[3] << 24;
            float x;
            memcpy(&x, &u, 4);
            a.data[i] = x;
        } else {
            unsigned long long u = 0;
            for (k = 7; k >= 0; k--) u = u << 8 | b[k];
            memcpy(&a.data[i], &u, 8);
        }
    }
    *out = a;
    return 0;
}
