/* See npy.h. */
#include "npy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int refuse(char *err, int errlen, const char *what) {
    snprintf(err, (size_t)errlen, "%s", what);
    return -1;
}

/* Parse "(" [dim (", " dim)* [","]] ")" with each dim as numpy writes it: no leading
 * zero, at most 18 digits. Returns the text after ")", or NULL. */
static const char *parse_shape(const char *s, array *a, char *err, int errlen) {
    if (*s++ != '(') { refuse(err, errlen, "the .npy shape is not a tuple"); return NULL; }
    while (*s != ')') {
        long long d = 0;
        int digits = 0;
        if (a->ndim && *s == ',' && s[1] == ')') { s++; break; } /* "(5,)" */
        if (a->ndim && (*s++ != ',' || *s++ != ' ')) { refuse(err, errlen, "a malformed .npy shape"); return NULL; }
        if (*s == '0' && s[1] >= '0' && s[1] <= '9') { refuse(err, errlen, "a .npy dimension with a leading zero"); return NULL; }
        while (*s >= '0' && *s <= '9') {
            if (++digits > 18) { refuse(err, errlen, "a .npy dimension is too large"); return NULL; }
            d = d * 10 + (*s++ - '0');
        }
        if (!digits) { refuse(err, errlen, "a .npy dimension is not a number"); return NULL; }
        if (a->ndim == NPY_MAX_DIMS) { refuse(err, errlen, "a .npy array of too many dimensions"); return NULL; }
        a->shape[a->ndim++] = d;
    }
    return s + 1;
}

/* The header is the dictionary numpy writes, padded with spaces, then a newline:
 * {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }    \n
 * Sets *f4; 0, or -1 with a message. */
static int parse_header(const char *h, int *f4, array *a, char *err, int errlen) {
    static const char descr[] = "{'descr': '<f", order[] = "', 'fortran_order': False, 'shape': ";
    if (strncmp(h, descr, sizeof descr - 1)) return refuse(err, errlen, "the .npy header is not numpy's dictionary");
    h += sizeof descr - 1;
    if (*h != '4' && *h != '8') return refuse(err, errlen, "the .npy dtype is not '<f4' or '<f8'");
    *f4 = *h++ == '4';
    if (strncmp(h, order, sizeof order - 1)) return refuse(err, errlen, "the .npy array is not in C order, or its header is not numpy's");
    h = parse_shape(h + sizeof order - 1, a, err, errlen);
    if (!h) return -1;
    if (strncmp(h, ", }", 3)) return refuse(err, errlen, "the .npy header is not numpy's dictionary");
    h += 3;
    while (*h == ' ') h++;
    if (h[0] != '\n' || h[1] != '\0') return refuse(err, errlen, "the .npy header does not end in spaces and a newline");
    return 0;
}

int npy_parse(const unsigned char *buf, size_t size, long long max_count, array *out, char *err, int errlen) {
    char header[65536 + 1];
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
    if (parse_header(header, &f4, &a, err, errlen)) return -1;
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
