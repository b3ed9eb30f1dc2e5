/* vectors_check: replays paged-spec test vectors with a naive paged-attention loop.
 *
 * Build: cc -std=c99 -O2 -o vectors_check vectors_check.c json.c npy.c -lm
 * Run:   ./vectors_check DIR/0000/manifest.json [more manifests...]
 *
 * For each vector it keeps its own KV cache (written by write_kv, copied by
 * copy_blocks), compares it bit for bit with every read_kv's expected contents,
 * computes every attention call in double precision (slot = table[p / B] * B + p % B,
 * causal, GQA, scale; sliding window, soft-cap, sinks and ALiBi) and judges it with
 * the format's tolerance rule for the vector's dtype. An fp8 cache (kv_dtype fp8_e4m3
 * or fp8_e5m2) stores round_fp8(float32(x) / float32(scale)) and attention reads
 * stored * scale. A latent cache (format version 2, geometry.latent_dim set: multi-head
 * latent attention) holds one row [c_kv, k_rope] a token and layer: every query head's
 * key is the whole row, and its value the row's first latent_dim columns.
 *
 * Hostile input: a vector is never trusted. Each vector is walked twice. The first
 * walk checks everything `vectors check` checks, in the same terms (docs/vectors.md,
 * "Hostile vectors"): the schema's types, every value against the geometry, every
 * table entry of every group, the padding, the slot mapping against the tables, each
 * array's shape and values, and that every operation reads only what earlier ones
 * wrote. Only a vector that passes it all is replayed and judged, in the second walk,
 * so both readers give one vector the same verdict. Sizes are computed with overflow
 * checks and bounded (the READER LIMITS below), array files must be arrays/NNN.npy
 * regular files inside the vector's directory, and the tolerance parameters are this
 * reader's own (a manifest naming others is refused).
 *
 * Prints PASS, FAIL or ERROR per vector; exits 0 (every vector passed), 1 (a vector
 * failed: what this reader computed differs from the vector) or 2 (a usage or setup
 * error: a file cannot be read, or a vector is malformed or past a reader limit; the
 * other vectors are still checked). C99 plus POSIX (realpath, lstat), libc and libm. */
#define _XOPEN_SOURCE 700
#include <float.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "json.h"
#include "npy.h"

/* ---- READER LIMITS (docs/vectors.md): past one, a vector is a setup error ---------- */
#define MAX_MANIFEST_BYTES (16LL << 20)
#define MAX_ARRAY_BYTES (256LL << 20)
#define MAX_LAYERS 4096LL
#define MAX_BLOCK_SIZE 65536LL
#define MAX_HEADS 4096LL            /* query heads and KV heads */
#define MAX_HEAD_DIM 65536LL
#define MAX_BLOCK_VALUES (1LL << 24) /* 2 * block_size * num_kv_heads * head_dim; latent: block_size * head_dim */
#define MAX_BLOCKS (1LL << 40)       /* num_blocks: slots stay below 2^56 */
#define MAX_WHOLE_POOL (1LL << 20)   /* blocks in a read_kv of the whole pool */
#define MAX_CACHE_VALUES (1LL << 27) /* values held by the cache and the expected image */
#define MAX_CONTEXT (1LL << 24)      /* keys one query attends to, and a window */
#define MAX_WORK (1LL << 33)         /* multiply-adds of attention per vector */

#define EXIT_FAIL 1
#define EXIT_SETUP 2
#define PAD -1LL /* a padding slot, or a table entry naming no block */

static char dir[4096];
static jmp_buf setup_error; /* where die() returns to: the vector is abandoned */

static void die(const char *msg, const char *what) {
    fprintf(stderr, "vectors_check: %s: %s%s%s\n", dir, msg, what ? ": " : "", what ? what : "");
    printf("ERROR %s: %s%s%s\n", dir, msg, what ? ": " : "", what ? what : "");
    longjmp(setup_error, 1);
}

static void *alloc(long long count, size_t size) {
    void *p;
    if (count < 0 || (unsigned long long)count > (size_t)-1 / size) die("an allocation size overflows", NULL);
    p = calloc((size_t)(count ? count : 1), size);
    if (!p) die("out of memory", NULL);
    return p;
}

/* a * b, or die naming what when it is negative or passes limit. */
static long long product(long long a, long long b, long long limit, const char *what) {
    if (a < 0 || b < 0 || (a && b > limit / a) || a * b > limit) die("past this reader's limit", what);
    return a * b;
}

/* A whole regular file of at most limit bytes; exits the vector with a setup error if not. */
static unsigned char *slurp(const char *path, long long limit, size_t *size) {
    struct stat st;
    FILE *f;
    unsigned char *buf;
    if (lstat(path, &st)) die("cannot open", path);
    if (S_ISLNK(st.st_mode)) die("a symbolic link (refused)", path);
    if (!S_ISREG(st.st_mode)) die("not a regular file", path);
    if (st.st_size > limit) die("a file larger than this reader's limit", path);
    f = fopen(path, "rb");
    if (!f) die("cannot open", path);
    buf = alloc((long long)st.st_size + 1, 1);
    if (fread(buf, 1, (size_t)st.st_size, f) != (size_t)st.st_size || fgetc(f) != EOF) {
        fclose(f);
        die("cannot read (or it changed size)", path);
    }
    fclose(f);
    *size = (size_t)st.st_size;
    return buf;
}

static int cmp_ll(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* ---- fields: the schema's types, strict (a bool is not a number, 2.0 not an integer) ---- */

static const jnode *field(const jnode *obj, const char *key) {
    const jnode *n = json_get(obj, key);
    if (!obj || obj->type != J_OBJ) die("expected an object holding the field", key);
    if (!n) die("manifest field missing", key);
    return n;
}
static int isnull(const jnode *n) { return !n || n->type == J_NULL; }
/* obj is an object with exactly the fields of the space-separated list (all required),
 * plus those of optional that it has. */
static void fields(const jnode *obj, const char *required, const char *optional, const char *what) {
    char name[64];
    const char *lists[2], *p;
    long long count = 0;
    int k;
    lists[0] = required;
    lists[1] = optional;
    if (!obj || obj->type != J_OBJ) die("not an object", what);
    for (k = 0; k < 2; k++)
        for (p = lists[k]; *p;) {
            size_t n = strcspn(p, " ");
            snprintf(name, sizeof name, "%.*s", (int)n, p);
            if (k == 0) field(obj, name);
            if (json_get(obj, name)) count++;
            p += n;
            while (*p == ' ') p++;
        }
    if (obj->len != count) die("an unknown field in", what); /* keys are unique: the parser refuses duplicates */
}
static void exactly(const jnode *obj, const char *names, const char *what) { fields(obj, names, "", what); }
/* An integer written as one (no fraction, exponent or bool) in lo..hi. */
static long long int_in(const jnode *n, long long lo, long long hi, const char *what) {
    if (!n || n->type != J_NUM || !n->is_int) die("not an integer", what);
    if (n->integer < lo || n->integer > hi) die("an integer out of range", what);
    return n->integer;
}
static long long ival(const jnode *obj, const char *key, long long lo, long long hi) {
    return int_in(field(obj, key), lo, hi, key);
}
/* A number (finite: the parser refuses others), > 0 when positive is set. */
static double num_of(const jnode *n, int positive, const char *what) {
    if (!n || n->type != J_NUM) die("not a number", what);
    if (positive && !(n->num > 0)) die("not > 0", what);
    return n->num;
}
static const char *str_of(const jnode *n, const char *what) {
    if (!n || n->type != J_STR) die("not a string", what);
    return n->str;
}
static const char *sval(const jnode *obj, const char *key) { return str_of(field(obj, key), key); }
static const jnode *arr(const jnode *n, const char *what) {
    if (!n || n->type != J_ARR) die("not an array", what);
    return n;
}
/* An array of integers, each in lo..hi. */
static const jnode *ints(const jnode *n, long long lo, long long hi, const char *what) {
    long long i;
    for (i = 0; i < arr(n, what)->len; i++) int_in(n->items[i], lo, hi, what);
    return n;
}
/* An array of [a, b] pairs of integers, each in lo..hi. */
static const jnode *pairs(const jnode *n, long long lo, long long hi, const char *what) {
    long long i;
    for (i = 0; i < arr(n, what)->len; i++)
        if (ints(n->items[i], lo, hi, what)->len != 2) die("not a pair", what);
    return n;
}
/* An array of numbers, each > 0 when positive is set. */
static const jnode *numbers(const jnode *n, int positive, const char *what) {
    long long i;
    for (i = 0; i < arr(n, what)->len; i++) num_of(n->items[i], positive, what);
    return n;
}
static int same_number(const jnode *a, const jnode *b) { return a->type == J_NUM && b->type == J_NUM && a->num == b->num; }

/* ---- arrays: arrays/NNN.npy inside the vector's directory ---------------------- */

static void check_array_name(const char *name) {
    const char *d = name + 7;
    if (strncmp(name, "arrays/", 7) || strlen(name) > 64) die("an array path is not arrays/NNN.npy", name);
    while (*d >= '0' && *d <= '9') d++;
    if (d == name + 7 || strcmp(d, ".npy")) die("an array path is not arrays/NNN.npy", name);
}

/* Load an array whose values must all be finite; shape checks are the caller's. */
static array load_npy(const jnode *name) {
    char path[8192], *real, *root, err[200];
    unsigned char *buf;
    size_t size, n;
    struct stat st;
    array a;
    long long i;
    check_array_name(str_of(name, "an array field"));
    snprintf(path, sizeof path, "%s/arrays", dir);
    if (lstat(path, &st) || !S_ISDIR(st.st_mode)) die("arrays/ is not a directory (or is a symbolic link)", path);
    snprintf(path, sizeof path, "%s/%s", dir, name->str);
    root = realpath(dir, NULL); /* symbolic links anywhere on the way are followed here */
    real = realpath(path, NULL);
    if (!root || !real) die("cannot resolve", path);
    n = strlen(root);
    if (strncmp(real, root, n) || real[n] != '/') die("an array outside the vector's directory", path);
    free(root);
    free(real);
    buf = slurp(path, MAX_ARRAY_BYTES, &size);
    if (npy_parse(buf, size, MAX_ARRAY_BYTES / 4, &a, err, sizeof err)) die(err, path);
    free(buf);
    for (i = 0; i < a.count; i++)
        if (!isfinite(a.data[i])) die("an array holds a NaN or infinite value", path);
    return a;
}

/* shape[k] < 0 matches any size. */
static void shape_is(const array *a, int ndim, const long long *shape, const char *what) {
    int k;
    if (a->ndim != ndim) die("an array has the wrong number of dimensions", what);
    for (k = 0; k < ndim; k++)
        if (shape[k] >= 0 && a->shape[k] != shape[k]) die("an array's shape does not match the manifest", what);
}

/* ---- number formats: which values a dtype (or an fp8 format) holds exactly ------------ */

typedef struct { int mant, min_exp; double max; } format;

static const format F32 = {23, -126, FLT_MAX}, F16 = {10, -14, 65504.0}, BF16 = {7, -126, 3.3895313892515355e38},
                    E4M3 = {3, -6, 448.0}, E5M2 = {2, -14, 57344.0};

/* x is finite, within the format's range, and a whole number of its quantum
 * 2^(max(e, min_exp) - mant) at x's exponent e. */
static int representable(double x, const format *f) {
    int e;
    double q;
    if (!isfinite(x) || fabs(x) > f->max) return 0;
    frexp(x, &e);
    q = ldexp(1.0, (e - 1 > f->min_exp ? e - 1 : f->min_exp) - f->mant);
    return rint(x / q) * q == x;
}

static void all_representable(const array *a, const format *f, const char *what) {
    long long i;
    for (i = 0; i < a->count; i++)
        if (!representable(a->data[i], f)) die("an array holds a value its format cannot hold exactly", what);
}

/* ---- the cache: blocks by (layer, block id), allocated on first touch --------- */

typedef struct { long long key; double *kv; unsigned char *filled; } entry; /* kv: K then V, B * H_kv * D each (latent: the rows only); filled: per slot, written */
typedef struct { entry *e; long long cap, used, row, *values; int B, parts; } store; /* parts: 2 (K, V) or 1 (latent rows) */

static long long probe(const store *st, long long key) {
    unsigned long long i = (unsigned long long)key * 11400714819323198485ULL % (unsigned long long)st->cap;
    while (st->e[i].kv && st->e[i].key != key) i = (i + 1) % (unsigned long long)st->cap;
    return (long long)i;
}

static entry *entry_of(store *st, long long layer, long long blk) {
    long long i;
    if (!st->cap) return NULL;
    i = probe(st, blk * MAX_LAYERS + layer);
    return st->e[i].kv ? &st->e[i] : NULL;
}

/* The block's storage; created (zeros) if absent and create is set. Pointers returned
 * earlier stay valid: growing the table moves entries, never their storage. The
 * caller has checked 0 <= blk < num_blocks and 0 <= layer < num_layers. */
static double *block(store *st, long long layer, long long blk, int create) {
    long long key = blk * MAX_LAYERS + layer, i, size = (long long)st->parts * st->B * st->row;
    if (st->cap && st->e[i = probe(st, key)].kv) return st->e[i].kv;
    if (!create) return NULL;
    if (*st->values > MAX_CACHE_VALUES - size) die("past this reader's limit", "the KV cache and expected image hold too many values");
    if (st->used * 2 >= st->cap) { /* grow and rehash */
        store bigger = *st;
        bigger.cap = st->cap ? st->cap * 2 : 1024;
        bigger.e = alloc(bigger.cap, sizeof(entry));
        for (i = 0; i < st->cap; i++)
            if (st->e[i].kv) bigger.e[probe(&bigger, st->e[i].key)] = st->e[i];
        free(st->e);
        *st = bigger;
    }
    i = probe(st, key);
    st->e[i].key = key;
    st->e[i].kv = alloc(size, sizeof(double));
    st->e[i].filled = alloc(st->B, 1);
    *st->values += size;
    st->used++;
    return st->e[i].kv;
}

static void store_free(store *st) {
    long long i;
    for (i = 0; i < st->cap; i++)
        if (st->e[i].kv) {
            free(st->e[i].kv);
            free(st->e[i].filled);
        }
    free(st->e);
    st->e = NULL;
    st->cap = st->used = 0;
}

/* ---- the tolerance rule (docs/vectors.md): fixed per dtype, never the manifest's ---- */

typedef struct { const char *dtype; int mant, min_exp, min_samples; double mag, ratio, floor_ulps,
                 mean_ratio, mean_floor, bias_limit, clip; } rule;
typedef struct { double abs_sum, ref_sum, signed_sum, outward_sum; long long count; } meter;

static const rule RULES[] = {
    {"float32", 23, -126, 512, 1.0, 4.0, 512.0, 2.0, 64.0, 1.0, 4.0},
    {"float16", 10, -14, 512, 0.015625, 2.0, 1.0, 1.25, 0.05, 0.2, 4.0},
    {"bfloat16", 7, -126, 512, 0.015625, 2.0, 1.0, 1.25, 0.05, 0.2, 4.0},
};

/* This reader's rule for the manifest's dtype; a manifest whose parameters differ is refused. */
static rule tolerance_of(const jnode *tol, const char *dtype) {
    const char *names[] = {"magnitude_floor", "ratio", "floor_ulps", "mean_ratio", "mean_floor_ulps",
                           "bias_limit_ulps", "bias_clip_ulps"};
    size_t r, k;
    if (strcmp(sval(tol, "rule"), "same-precision-ulps")) die("unknown tolerance rule", sval(tol, "rule"));
    if (strcmp(sval(tol, "dtype"), dtype)) die("the tolerance's dtype is not the geometry's", "tolerance.dtype");
    for (r = 0; r < sizeof RULES / sizeof RULES[0]; r++) {
        const rule *x = &RULES[r];
        const double want[] = {x->mag, x->ratio, x->floor_ulps, x->mean_ratio, x->mean_floor, x->bias_limit, x->clip};
        if (strcmp(x->dtype, dtype)) continue;
        ival(tol, "mantissa_bits", x->mant, x->mant); /* each must be the rule's own */
        ival(tol, "min_normal_exponent", x->min_exp, x->min_exp);
        ival(tol, "min_samples", x->min_samples, x->min_samples);
        for (k = 0; k < sizeof names / sizeof names[0]; k++)
            if (num_of(field(tol, names[k]), 0, names[k]) != want[k])
                die("a tolerance parameter differs from the format's rule for its dtype", names[k]);
        return *x;
    }
    die("an unknown dtype", dtype);
    return RULES[0];
}

static double ulp(double x, const rule *r) {
    int e;
    double p = 0.0;
    x = fabs(x);
    if (x > 0) { frexp(x, &e); p = ldexp(1.0, e - 1); }
    if (p < ldexp(1.0, r->min_exp)) p = ldexp(1.0, r->min_exp);
    return ldexp(p, -r->mant);
}

/* ---- fp8 KV: the rounding of spec/quant.py ------------------------------------- */

static double round_fp8(double x, const format *f) {
    double c = x > f->max ? f->max : x < -f->max ? -f->max : x, q, r; /* NaN passes */
    int e;
    frexp(c, &e);
    e = e - 1 > f->min_exp ? e - 1 : f->min_exp;
    q = ldexp(1.0, e - f->mant);
    r = rint(c / q) * q; /* the default rounding mode: to nearest, ties to even */
    r = r > f->max ? f->max : r < -f->max ? -f->max : r;
    return copysign(r, c);
}

static double quantize(double x, double scale, const format *f) {
    volatile float quotient = (float)x / (float)scale; /* the division in float32 */
    return round_fp8(quotient, f);
}

/* ---- one vector -------------------------------------------------------------- */

typedef struct {
    const jnode *m, *made, *groups, *variants; store cache, expect; rule tol; meter met;
    long long layers, B, hkv, D, Dv, H, num_blocks, slots, values, work; int fails, version;
    int latent; /* rows [c_kv, k_rope] (Dv = latent_dim columns of c_kv), no separate V */
    int checking; /* the first walk: check every operation, compute and judge nothing */
    int quantized; format act, stored; double (*scales)[2]; /* per layer (k_scale, v_scale) */
} vec;

static double *slot_row(vec *v, store *st, long long layer, long long slot, int which) {
    if (slot < 0 || slot >= v->slots) die("a slot out of range of the pool", NULL);
    return block(st, layer, slot / v->B, 1) + (which * v->B + slot % v->B) * v->cache.row;
}

static int has(store *st, long long layer, long long slot, long long B) {
    const entry *e = entry_of(st, layer, slot / B);
    return e && e->filled[slot % B];
}

/* Write one token's K (which 0) or V (1) row: as given, or its fp8 values. */
static void store_row(vec *v, long long layer, long long slot, int which, const double *x) {
    double *dst = slot_row(v, &v->cache, layer, slot, which);
    long long d;
    entry_of(&v->cache, layer, slot / v->B)->filled[slot % v->B] = 1;
    for (d = 0; d < v->cache.row; d++)
        dst[d] = v->quantized ? quantize(x[d], v->scales[layer][which], &v->stored) : x[d];
}

static void report(vec *v, long long op, const char *kind, long long step, const char *fmt, double a, double b) {
    printf("FAIL %s: operation %lld (%s), step %lld: ", dir, op, kind, step);
    printf(fmt, a, b);
    printf("\n");
    v->fails++;
}

static long long step_of(const jnode *op) { return ival(op, "step", 0, LLONG_MAX); }
static long long layer_of(const vec *v, const jnode *op) { return ival(op, "layer", 0, v->layers - 1); }

/* No value of the list (lo..hi integers) twice, skip aside; sorted in a copy. */
static void distinct(const jnode *list, long long skip, const char *what) {
    long long *x = alloc(list->len, sizeof(long long)), n = 0, i;
    for (i = 0; i < list->len; i++)
        if (list->items[i]->integer != skip) x[n++] = list->items[i]->integer;
    qsort(x, (size_t)n, sizeof *x, cmp_ll);
    for (i = 1; i < n; i++)
        if (x[i] == x[i - 1]) { free(x); die("a value appears twice in", what); }
    free(x);
}

/* A copy list of spec.batch.check_copies: [src, dst] pairs of the pool's blocks, no
 * destination twice, and no block both a source and a destination. */
static void check_copies(const vec *v, const jnode *copies, const char *what) {
    long long *src, *dst, i, n = pairs(copies, 0, v->num_blocks - 1, what)->len;
    src = alloc(n, sizeof(long long));
    dst = alloc(n, sizeof(long long));
    for (i = 0; i < n; i++) {
        src[i] = copies->items[i]->items[0]->integer;
        dst[i] = copies->items[i]->items[1]->integer;
    }
    qsort(src, (size_t)n, sizeof *src, cmp_ll);
    qsort(dst, (size_t)n, sizeof *dst, cmp_ll);
    for (i = 0; i < n; i++) {
        if ((i && dst[i] == dst[i - 1]) || bsearch(&dst[i], src, (size_t)n, sizeof *src, cmp_ll)) {
            free(src);
            free(dst);
            die("a destination block appears twice, or a block is both a source and a destination, in", what);
        }
    }
    free(src);
    free(dst);
}

/* A per-head list of numbers (sinks, ALiBi slopes): null, or one per query head. */
static void per_head(const vec *v, const jnode *var, const char *key) {
    const jnode *n = field(var, key);
    if (isnull(n)) return;
    if (numbers(n, 0, key)->len != v->H || !v->H) die("not one value per query head", key);
}

/* null (plain attention) or an AttentionVariant: a window of 1..MAX_CONTEXT tokens, a
 * soft-cap > 0, sinks and ALiBi slopes one per query head. */
static void check_variant(const vec *v, const jnode *var, const char *what) {
    if (isnull(var)) return;
    exactly(var, "window softcap sinks alibi_slopes", what);
    if (!isnull(field(var, "window"))) ival(var, "window", 1, MAX_CONTEXT);
    if (!isnull(field(var, "softcap"))) num_of(field(var, "softcap"), 1, "softcap");
    per_head(v, var, "sinks");
    per_head(v, var, "alibi_slopes");
}

/* Two checked variants are the same (null is plain: every feature null). */
static int same_variant(const jnode *a, const jnode *b) {
    const char *names[] = {"window", "softcap", "sinks", "alibi_slopes"};
    size_t k;
    long long i;
    for (k = 0; k < 4; k++) {
        const jnode *x = isnull(a) ? NULL : json_get(a, names[k]), *y = isnull(b) ? NULL : json_get(b, names[k]);
        if (isnull(x) || isnull(y)) {
            if (isnull(x) != isnull(y)) return 0;
        } else if (x->type == J_ARR) {
            if (x->len != y->len) return 0;
            for (i = 0; i < x->len; i++)
                if (!same_number(x->items[i], y->items[i])) return 0;
        } else if (!same_number(x, y)) return 0;
    }
    return 1;
}

/* One geometry object: the schema's fields and types, the limits, and KVGeometry's rules. */
static void check_geometry(const jnode *g, long long version, const char *what) {
    const char *names[] = {"num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"};
    const long long highs[] = {MAX_LAYERS, MAX_BLOCKS, MAX_BLOCK_SIZE, MAX_HEADS, MAX_HEAD_DIM};
    const jnode *kind, *scales, *groups;
    const char *dtype;
    long long values[5], i, *used;
    int latent;
    fields(g, "num_layers num_blocks block_size num_kv_heads head_dim dtype kv_dtype kv_scales layer_groups", "latent_dim", what);
    latent = !isnull(json_get(g, "latent_dim"));
    if (latent && version < 2) die("latent_dim is not null (format version 1 holds no latent vector)", what);
    for (i = 0; i < 5; i++) values[i] = ival(g, names[i], 1, highs[i]);
    if (latent) { /* spec.kv_memory.check_latent: 0 < latent_dim < head_dim, one KV head */
        ival(g, "latent_dim", 1, values[4] - 1);
        if (values[3] != 1) die("num_kv_heads must be 1 for a latent layout", what);
    }
    product((latent ? 1 : 2) * values[2], values[3] * values[4], MAX_BLOCK_VALUES, "values per block");
    dtype = sval(g, "dtype");
    if (strcmp(dtype, "float32") && strcmp(dtype, "float16") && strcmp(dtype, "bfloat16")) die("an unknown dtype", dtype);
    kind = field(g, "kv_dtype");
    if (!isnull(kind) && strcmp(str_of(kind, "kv_dtype"), "fp8_e4m3") && strcmp(kind->str, "fp8_e5m2"))
        die("kv_dtype is not null, fp8_e4m3 or fp8_e5m2", NULL);
    scales = arr(field(g, "kv_scales"), "kv_scales");
    for (i = 0; i < scales->len; i++)
        if (numbers(scales->items[i], 1, "kv_scales")->len != 2) die("a kv_scales entry is not a (k_scale, v_scale) pair", NULL);
    if (isnull(kind) && scales->len) die("kv_scales are only for a quantized kv_dtype", what);
    if (!isnull(kind) && scales->len != values[0]) die("kv_scales must hold one pair per layer", what);
    for (i = 0; latent && i < scales->len; i++) /* spec.kv_memory.check_latent_scales */
        if (!same_number(scales->items[i]->items[0], scales->items[i]->items[1]))
            die("a latent cache has one scale a layer: k_scale and v_scale must be equal", what);
    for (i = 0; i < 2 * scales->len; i++) { /* scales are used as float32 values */
        float s = (float)scales->items[i / 2]->items[i % 2]->num;
        if (!(s > 0) || !isfinite(s)) die("a kv scale is not a positive finite float32", what);
    }
    groups = ints(field(g, "layer_groups"), 0, LLONG_MAX, "layer_groups");
    if (groups->len && groups->len != values[0]) die("layer_groups must be empty or one per layer", what);
    used = alloc(groups->len, sizeof(long long));
    for (i = 0; i < groups->len; i++) used[i] = groups->items[i]->integer;
    qsort(used, (size_t)groups->len, sizeof *used, cmp_ll);
    for (i = 0; i < groups->len; i++) /* the groups used are 0..G-1 */
        if (used[i] != (i ? used[i - 1] + (used[i] != used[i - 1]) : 0)) { free(used); die("layer_groups must number groups 0..G-1", what); }
    free(used);
}

/* create_cache's geometry is the manifest's, but for at least as many blocks. */
static void same_geometry(const jnode *g, const jnode *made) {
    const char *names[] = {"num_layers", "block_size", "num_kv_heads", "head_dim"};
    const jnode *a = field(g, "kv_scales"), *b = field(made, "kv_scales"), *x, *y;
    size_t k;
    long long i;
    for (k = 0; k < 4; k++)
        if (field(g, names[k])->integer != field(made, names[k])->integer) die("create_cache's geometry differs", names[k]);
    if (strcmp(sval(g, "dtype"), sval(made, "dtype"))) die("create_cache's geometry differs", "dtype");
    x = field(g, "kv_dtype");
    y = field(made, "kv_dtype");
    if (isnull(x) != isnull(y) || (!isnull(x) && strcmp(x->str, y->str))) die("create_cache's geometry differs", "kv_dtype");
    if (a->len != b->len) die("create_cache's geometry differs", "kv_scales");
    for (i = 0; i < 2 * a->len; i++)
        if (!same_number(a->items[i / 2]->items[i % 2], b->items[i / 2]->items[i % 2])) die("create_cache's geometry differs", "kv_scales");
    a = field(g, "layer_groups");
    b = field(made, "layer_groups");
    if (a->len != b->len) die("create_cache's geometry differs", "layer_groups");
    for (i = 0; i < a->len; i++)
        if (a->items[i]->integer != b->items[i]->integer) die("create_cache's geometry differs", "layer_groups");
    x = json_get(g, "latent_dim"); /* absent is null */
    y = json_get(made, "latent_dim");
    if (isnull(x) != isnull(y) || (!isnull(x) && x->integer != y->integer)) die("create_cache's geometry differs", "latent_dim");
    ival(made, "num_blocks", field(g, "num_blocks")->integer, MAX_BLOCKS);
}

/* Everything of the manifest but its operations: the schema, the limits, KVGeometry's
 * rules, the tolerance; the vector's geometry and formats set from it. */
static void check_manifest(vec *v) {
    const jnode *m = v->m, *ops, *source, *passes, *g, *kind;
    long long i;
    fields(m, "format version example source geometry num_heads scale scale_regime layer_variants tolerance operations", "", "the manifest");
    ival(m, "example", 0, LLONG_MAX);
    source = field(m, "source");
    exactly(source, "profile seed passes suite", "source");
    sval(source, "profile");
    ival(source, "seed", 0, LLONG_MAX);
    sval(source, "suite");
    passes = arr(field(source, "passes"), "passes");
    for (i = 0; i < passes->len; i++) {
        if (arr(passes->items[i], "passes")->len != 2) die("a pass is not a [name, examples] pair", "passes");
        str_of(passes->items[i]->items[0], "passes");
        int_in(passes->items[i]->items[1], LLONG_MIN, LLONG_MAX, "passes");
    }
    if (!isnull(field(m, "scale"))) num_of(field(m, "scale"), 1, "scale");
    sval(m, "scale_regime");
    ops = arr(field(m, "operations"), "operations");
    if (ops->len < 2) die("a vector needs create_cache and at least one more operation", "operations");
    kind = ops->items[0]->type == J_OBJ ? json_get(ops->items[0], "op") : NULL;
    if (!kind || kind->type != J_STR || strcmp(kind->str, "create_cache")) die("the first operation must be create_cache", NULL);
    exactly(ops->items[0], "op geometry", "create_cache");
    g = field(m, "geometry");
    v->made = field(ops->items[0], "geometry");
    check_geometry(g, v->version, "geometry");
    check_geometry(v->made, v->version, "create_cache's geometry");
    same_geometry(g, v->made);
    v->layers = field(g, "num_layers")->integer;
    v->B = field(g, "block_size")->integer;
    v->hkv = field(g, "num_kv_heads")->integer;
    v->D = field(g, "head_dim")->integer;
    v->latent = !isnull(json_get(g, "latent_dim"));
    v->Dv = v->latent ? field(g, "latent_dim")->integer : v->D;
    v->num_blocks = field(v->made, "num_blocks")->integer;
    v->slots = v->num_blocks * v->B;
    v->groups = field(g, "layer_groups");
    exactly(field(m, "tolerance"), "rule dtype mantissa_bits min_normal_exponent magnitude_floor ratio floor_ulps mean_ratio "
            "mean_floor_ulps bias_limit_ulps bias_clip_ulps min_samples", "tolerance");
    v->tol = tolerance_of(field(m, "tolerance"), sval(g, "dtype"));
    v->act = !strcmp(sval(g, "dtype"), "float32") ? F32 : !strcmp(sval(g, "dtype"), "float16") ? F16 : BF16;
    v->H = isnull(field(m, "num_heads")) ? 0 : ival(m, "num_heads", 1, MAX_HEADS); /* null: no attention */
    if (v->H % v->hkv) die("num_heads is not a multiple of num_kv_heads", NULL);
    v->variants = arr(field(m, "layer_variants"), "layer_variants");
    if (v->variants->len != v->layers) die("layer_variants must hold one entry per layer", NULL);
    for (i = 0; i < v->layers; i++) check_variant(v, v->variants->items[i], "layer_variants");
    kind = field(v->made, "kv_dtype");
    v->stored = v->act;
    if (isnull(kind)) return;
    v->stored = !strcmp(kind->str, "fp8_e4m3") ? E4M3 : E5M2;
    v->scales = alloc(v->layers, sizeof *v->scales);
    for (i = 0; i < 2 * v->layers; i++)
        v->scales[i / 2][i % 2] = (float)field(v->made, "kv_scales")->items[i / 2]->items[i % 2]->num;
    v->quantized = 1;
}

static void write_kv(vec *v, const jnode *op) {
    const jnode *slots;
    long long layer, j, rows, row = v->cache.row;
    array kv;
    int which;
    exactly(op, "op step layer slot_mapping kv tokens", "a write_kv operation");
    step_of(op);
    layer = layer_of(v, op);
    slots = ints(field(op, "slot_mapping"), PAD, v->slots - 1, "slot_mapping (-1 or a slot of the pool)");
    if (!isnull(field(op, "tokens"))) pairs(field(op, "tokens"), LLONG_MIN, LLONG_MAX, "tokens");
    kv = load_npy(field(op, "kv"));
    if (v->latent) {
        long long shape[3];
        shape[0] = -1; shape[1] = 1; shape[2] = v->D;
        shape_is(&kv, 3, shape, "kv [rows, 1, head_dim] (latent rows: c_kv, then k_rope)");
    } else {
        long long shape[4];
        shape[0] = 2; shape[1] = -1; shape[2] = v->hkv; shape[3] = v->D;
        shape_is(&kv, 4, shape, "kv [2, rows, num_kv_heads, head_dim]");
    }
    rows = kv.shape[v->latent ? 0 : 1];
    if (slots->len > rows) die("slot_mapping is longer than the kv array's rows", NULL);
    all_representable(&kv, &v->act, "kv (values of the dtype)");
    distinct(slots, PAD, "slot_mapping");
    for (j = 0; j < slots->len; j++) {
        long long slot = slots->items[j]->integer;
        if (slot != PAD)
            for (which = 0; which < v->cache.parts; which++) store_row(v, layer, slot, which, kv.data + (which * rows + j) * row);
    }
    free(kv.data);
}

static void copy_blocks(vec *v, const jnode *op) {
    const jnode *copies;
    long long c, layer;
    exactly(op, "op step copies", "a copy_blocks operation");
    step_of(op);
    copies = field(op, "copies");
    check_copies(v, copies, "copies");
    for (c = 0; c < copies->len; c++) {
        long long src = copies->items[c]->items[0]->integer, dst = copies->items[c]->items[1]->integer;
        for (layer = 0; layer < v->layers; layer++) {
            double *to = block(&v->cache, layer, dst, 1), *from = block(&v->cache, layer, src, 1);
            memmove(to, from, sizeof(double) * (size_t)(v->cache.parts * v->B * v->cache.row));
            memmove(entry_of(&v->cache, layer, dst)->filled, entry_of(&v->cache, layer, src)->filled, (size_t)v->B);
        }
    }
}

/* The batch of spec.batch.BatchMetadata.validate: shapes agree; seq_ids distinct;
 * query_start_loc from 0, strictly increasing; 1 <= query_len <= seq_len; positions each
 * sequence's last query_len; per group, table rows as wide as the widest, each holding
 * its ceil(seq_len / B) used entries in the pool (a released prefix of -1 aside) and -1
 * after, and the slot mapping what the paging formula gives; the copy list valid. */
static void check_batch(const vec *v, const jnode *batch) {
    const jnode *seqs, *qsl, *lens, *pos, *gt, *gs;
    long long S, T, i, r, g, j;
    exactly(batch, "block_size seq_ids query_start_loc seq_lens positions copies group_tables group_slots", "batch");
    if (ival(batch, "block_size", 1, LLONG_MAX) != v->B) die("batch.block_size is not the geometry's", NULL);
    seqs = ints(field(batch, "seq_ids"), LLONG_MIN, LLONG_MAX, "seq_ids");
    qsl = ints(field(batch, "query_start_loc"), 0, LLONG_MAX, "query_start_loc");
    lens = ints(field(batch, "seq_lens"), 1, LLONG_MAX, "seq_lens");
    pos = ints(field(batch, "positions"), 0, LLONG_MAX, "positions");
    pairs(field(batch, "copies"), 0, LLONG_MAX, "batch.copies");
    gt = arr(field(batch, "group_tables"), "group_tables");
    gs = arr(field(batch, "group_slots"), "group_slots");
    if (!qsl->len || !gt->len || !gs->len) die("query_start_loc, group_tables and group_slots need an entry each", NULL);
    for (g = 0; g < gt->len; g++)
        for (i = 0; i < arr(gt->items[g], "group_tables")->len; i++) ints(gt->items[g]->items[i], LLONG_MIN, LLONG_MAX, "group_tables");
    for (g = 0; g < gs->len; g++) ints(gs->items[g], PAD, LLONG_MAX, "group_slots");
    if (gt->len != gs->len) die("group_slots must hold one slot mapping per group's tables", NULL);
    S = seqs->len;
    if (lens->len != S || qsl->len - 1 != S) die("seq_lens and query_start_loc must have one entry per sequence", NULL);
    for (g = 0; g < gt->len; g++)
        if (gt->items[g]->len != S) die("a group's tables must have one row per sequence", NULL);
    distinct(seqs, LLONG_MIN, "seq_ids");
    if (qsl->items[0]->integer != 0) die("query_start_loc must start at 0", NULL);
    for (i = 0; i < S; i++) {
        long long q0 = qsl->items[i]->integer, q1 = qsl->items[i + 1]->integer, len = lens->items[i]->integer;
        if (q1 <= q0) die("query_start_loc must increase", NULL);
        if (q1 - q0 > len) die("a sequence's seq_len is below its new tokens", NULL);
    }
    T = qsl->items[S]->integer;
    if (pos->len != T) die("positions must have one entry per query row", NULL);
    for (i = 0; i < S; i++)
        for (r = qsl->items[i]->integer; r < qsl->items[i + 1]->integer; r++)
            if (pos->items[r]->integer != lens->items[i]->integer - (qsl->items[i + 1]->integer - r))
                die("a sequence's positions are not its last query_len positions", NULL);
    for (g = 0; g < gt->len; g++) {
        const jnode *tables = gt->items[g], *slots = gs->items[g];
        long long width = 0;
        if (slots->len != T) die("a group's slot mapping must have one slot per query row", NULL);
        for (i = 0; i < S; i++)
            if (tables->items[i]->len > width) width = tables->items[i]->len;
        for (i = 0; i < S; i++) {
            const jnode *row = tables->items[i];
            long long len = lens->items[i]->integer, used = len / v->B + (len % v->B != 0), released = width;
            if (row->len != width || used > width) die("a table row is not as wide as the widest, or too short for its seq_len", NULL);
            for (j = 0; j < width && released == width; j++)
                if (row->items[j]->integer != PAD) released = j;
            for (j = 0; j < width; j++) {
                long long e = row->items[j]->integer;
                if ((j >= used || j < released) ? e != PAD : (e < 0 || e >= v->num_blocks))
                    die("a table entry is not a block of the pool where used, or -1 where not", "group_tables");
            }
            for (r = qsl->items[i]->integer; r < qsl->items[i + 1]->integer; r++) {
                long long p = pos->items[r]->integer;
                if (p / v->B < released) die("a position in a released block", NULL);
                if (slots->items[r]->integer != row->items[p / v->B]->integer * v->B + p % v->B)
                    die("the slot mapping is not what the table gives (table[p / B] * B + p % B)", "group_slots");
            }
        }
    }
    check_copies(v, field(batch, "copies"), "batch.copies");
}

static void attention(vec *v, const jnode *op, long long index) {
    const jnode *batch, *var, *qsl, *pos, *tables, *seqs;
    long long layer, g = 0, h, d, T, S, i, r, k, outs, worst = -1, window = 0, ratio, shape[4];
    array q, ex;
    double scale, cap = 0, *out, *scores, top = 0, ref_max = 0, got_max = 0;
    const jnode *sinks = NULL, *slopes = NULL;
    exactly(op, "op step layer scale variant batch query expected", "an attention operation");
    step_of(op);
    layer = layer_of(v, op);
    if (!v->H) die("an attention operation in a vector whose num_heads is null", NULL);
    ratio = v->H / v->hkv;
    scale = num_of(field(op, "scale"), 1, "scale");
    var = field(op, "variant");
    check_variant(v, var, "variant");
    if (!same_variant(var, v->variants->items[layer])) die("the variant is not its layer's (layer_variants)", NULL);
    batch = field(op, "batch");
    if (v->groups->len) g = v->groups->items[layer]->integer;
    if (arr(field(batch, "group_tables"), "group_tables")->len <= g || arr(field(batch, "group_slots"), "group_slots")->len <= g)
        die("the batch has no tables or slots for the layer's group", NULL);
    check_batch(v, batch);
    qsl = field(batch, "query_start_loc");
    pos = field(batch, "positions");
    seqs = field(batch, "seq_ids");
    tables = field(batch, "group_tables")->items[g];
    S = seqs->len;
    T = pos->len;
    q = load_npy(field(op, "query"));
    shape[0] = T; shape[1] = v->H; shape[2] = v->D;
    shape_is(&q, 3, shape, "query [T, num_heads, head_dim]");
    all_representable(&q, &v->act, "query (values of the dtype)");
    ex = load_npy(field(op, "expected"));
    shape[0] = 2; shape[1] = T; shape[2] = v->H; shape[3] = v->Dv;
    shape_is(&ex, 4, shape, v->latent ? "expected [2, T, num_heads, latent_dim]" : "expected [2, T, num_heads, head_dim]");
    outs = ex.count / 2; /* outputs: T * num_heads * (head_dim, or latent_dim) */
    if (!isnull(var)) {
        if (!isnull(field(var, "window"))) window = field(var, "window")->integer;
        if (!isnull(field(var, "softcap"))) cap = field(var, "softcap")->num;
        sinks = isnull(field(var, "sinks")) ? NULL : field(var, "sinks");
        slopes = isnull(field(var, "alibi_slopes")) ? NULL : field(var, "alibi_slopes");
    }
    for (i = 0; i < S; i++) { /* every key a query sees: in a block of the pool, in a written slot */
        const jnode *row = tables->items[i];
        long long p0 = pos->items[qsl->items[i]->integer]->integer, last = pos->items[qsl->items[i + 1]->integer - 1]->integer;
        long long first = window && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
        for (r = qsl->items[i]->integer; r < qsl->items[i + 1]->integer; r++) {
            long long p = pos->items[r]->integer, n = p - (window && p - window + 1 > 0 ? p - window + 1 : 0) + 1;
            if (n > MAX_CONTEXT) die("past this reader's limit", "keys attended by one query");
            if (product(n, v->H * v->D, MAX_WORK, "attention work") > MAX_WORK - v->work)
                die("past this reader's limit", "attention work in one vector");
            v->work += n * v->H * v->D;
        }
        for (k = first; k <= last; k++) {
            long long blk = row->items[k / v->B]->integer;
            if (blk == PAD) die("a query sees a position in a released block", NULL);
            if (!has(&v->cache, layer, blk * v->B + k % v->B, v->B))
                die("a query sees a slot that no write_kv of the vector filled", NULL);
        }
    }
    if (v->checking) { free(q.data); free(ex.data); return; }
    out = alloc(outs, sizeof(double));
    for (i = 0; i < S; i++) {
        const jnode *table = tables->items[i];
        for (r = qsl->items[i]->integer; r < qsl->items[i + 1]->integer; r++) {
            long long p = pos->items[r]->integer;
            long long first = window && p - window + 1 > 0 ? p - window + 1 : 0, n = p - first + 1;
            scores = alloc(n, sizeof(double));
            for (h = 0; h < v->H; h++) {
                double m = -HUGE_VAL, total = 0, *o = out + (r * v->H + h) * v->Dv;
                const double *qr = q.data + (r * v->H + h) * v->D;
                long long kvh = h / ratio;
                for (k = first; k <= p; k++) {
                    long long slot = table->items[k / v->B]->integer * v->B + k % v->B;
                    const double *kr = slot_row(v, &v->cache, layer, slot, 0) + kvh * v->D;
                    double s = 0;
                    for (d = 0; d < v->D; d++) s += qr[d] * kr[d];
                    if (v->quantized) s *= v->scales[layer][0];
                    s *= scale;
                    if (cap > 0) s = cap * tanh(s / cap);
                    if (slopes) s += slopes->items[h]->num * (double)(k - p);
                    scores[k - first] = s;
                    if (s > m) m = s;
                }
                if (sinks && sinks->items[h]->num > m) m = sinks->items[h]->num;
                for (k = first; k <= p; k++) {
                    long long slot = table->items[k / v->B]->integer * v->B + k % v->B;
                    /* latent: the value is the key's row, its first latent_dim columns (c_kv) */
                    const double *vr = slot_row(v, &v->cache, layer, slot, v->latent ? 0 : 1) + kvh * v->D;
                    double w = exp(scores[k - first] - m), vs = v->quantized ? v->scales[layer][1] : 1.0;
                    total += w;
                    for (d = 0; d < v->Dv; d++) o[d] += w * vs * vr[d];
                }
                if (sinks) total += exp(sinks->items[h]->num - m);
                for (d = 0; d < v->Dv; d++) o[d] /= total;
            }
            free(scores);
        }
    }
    /* check 1: the largest error in ulps against ratio x the reference's + floor */
    for (k = 0; k < outs; k++) if (fabs(ex.data[k]) > top) top = fabs(ex.data[k]);
    top = v->tol.mag * top;
    if (top < ulp(0.0, &v->tol)) top = ulp(0.0, &v->tol);
    for (k = 0; k < outs; k++) {
        double e = ex.data[k], unit = ulp(fabs(e) > top ? e : top, &v->tol);
        double err = fabs(out[k] - e) / unit, ref = fabs(ex.data[outs + k] - e) / unit;
        double sgn = (out[k] - e) / unit, c = sgn > v->tol.clip ? v->tol.clip : sgn < -v->tol.clip ? -v->tol.clip : sgn;
        if (err != err) err = HUGE_VAL;
        if (err > got_max) { got_max = err; worst = k; }
        if (ref > ref_max) ref_max = ref;
        if (isfinite(sgn) && isfinite(ref)) {
            v->met.abs_sum += fabs(sgn); v->met.ref_sum += ref; v->met.signed_sum += c;
            v->met.outward_sum += e > 0 ? c : e < 0 ? -c : 0; v->met.count++;
        }
    }
    if (got_max > v->tol.ratio * ref_max + v->tol.floor_ulps) {
        long long row = worst / (v->H * v->Dv), s = 0;
        while (s + 1 < S && qsl->items[s + 1]->integer <= row) s++;
        printf("FAIL %s: operation %lld (attention), step %lld, layer %lld, sequence %lld, token %lld, "
               "head %lld: error %.3g ulp > allowed %.3g ulp\n", dir, index, step_of(op), layer,
               seqs->items[s]->integer, pos->items[row]->integer, worst / v->Dv % v->H, got_max,
               v->tol.ratio * ref_max + v->tol.floor_ulps);
        v->fails++;
    }
    free(out); free(q.data); free(ex.data);
}

static void read_kv(vec *v, const jnode *op, long long index) {
    const jnode *blocks, *slots, *update;
    long long layer, i, n, j, per = v->B * v->cache.row, shape[4];
    int which;
    exactly(op, "op step layer blocks update_slots update", "a read_kv operation");
    step_of(op);
    layer = layer_of(v, op);
    blocks = field(op, "blocks");
    if (!isnull(blocks)) ints(blocks, 0, v->num_blocks - 1, "blocks");
    else if (v->num_blocks > MAX_WHOLE_POOL) die("past this reader's limit", "blocks in a read of the whole pool");
    slots = ints(field(op, "update_slots"), 0, v->slots - 1, "update_slots");
    update = field(op, "update");
    if (!isnull(update)) {
        array u = load_npy(update);
        if (v->latent) {
            shape[0] = slots->len; shape[1] = 1; shape[2] = v->D;
            shape_is(&u, 3, shape, "update [len(update_slots), 1, head_dim] (latent rows)");
        } else {
            shape[0] = 2; shape[1] = slots->len; shape[2] = v->hkv; shape[3] = v->D;
            shape_is(&u, 4, shape, "update [2, len(update_slots), num_kv_heads, head_dim]");
        }
        all_representable(&u, &v->stored, "update (values the cache stores)");
        for (i = 0; i < slots->len; i++) /* else this reader would be blamed for what the vector never wrote */
            if (!has(&v->cache, layer, slots->items[i]->integer, v->B))
                die("update_slots names a slot the vector's write_kv operations never wrote", NULL);
        for (i = 0; i < slots->len; i++) {
            long long slot = slots->items[i]->integer;
            for (which = 0; which < v->expect.parts; which++)
                memcpy(slot_row(v, &v->expect, layer, slot, which), u.data + (which * slots->len + i) * v->cache.row,
                       sizeof(double) * (size_t)v->cache.row);
            entry_of(&v->expect, layer, slot / v->B)->filled[slot % v->B] = 1;
        }
        free(u.data);
    } else if (slots->len) die("update_slots name slots, but update is null", NULL);
    n = isnull(blocks) ? v->num_blocks : blocks->len;
    for (i = 0; i < n; i++) { /* every slot of a block read has its expected contents */
        long long blk = isnull(blocks) ? i : blocks->items[i]->integer;
        for (j = 0; j < v->B; j++)
            if (!has(&v->expect, layer, blk * v->B + j, v->B))
                die("a block is read before an update gave every slot of it its expected contents", NULL);
    }
    if (v->checking) return;
    for (i = 0; i < n && !v->fails; i++) {
        long long blk = isnull(blocks) ? i : blocks->items[i]->integer;
        double *want = block(&v->expect, layer, blk, 0), *got = block(&v->cache, layer, blk, 1);
        for (j = 0; j < v->cache.parts * per; j++)
            if (want[j] != got[j]) {
                printf("FAIL %s: operation %lld (read_kv), step %lld, layer %lld, %s of block %lld, offset %lld: "
                       "expected %.9g, this reader holds %.9g\n", dir, index, step_of(op), layer,
                       v->latent ? "latent row" : j < per ? "K" : "V", blk, j % per / v->cache.row, want[j], got[j]);
                v->fails++;
                break;
            }
    }
}

static void finish(vec *v, const jnode *op, long long i) {
    double n = (double)v->met.count, mean, allowed, lean;
    exactly(op, "op step", "a finish operation");
    step_of(op);
    if (v->checking || v->met.count < v->tol.min_samples) return;
    mean = v->met.abs_sum / n;
    allowed = v->tol.mean_ratio * v->met.ref_sum / n + v->tol.mean_floor;
    lean = fmax(fabs(v->met.signed_sum / n), fabs(v->met.outward_sum / n));
    if (mean > allowed) report(v, i, "finish", step_of(op), "mean error %.3g ulp > allowed %.3g ulp", mean, allowed);
    else if (lean > v->tol.bias_limit) report(v, i, "finish", step_of(op), "outputs lean %.3g ulp > limit %.3g ulp", lean, v->tol.bias_limit);
}

/* One walk over the operations after create_cache: checking only, or replaying. */
static void walk(vec *v) {
    const jnode *ops = field(v->m, "operations");
    long long i;
    memset(&v->met, 0, sizeof v->met);
    v->work = v->values = 0;
    store_free(&v->cache);
    store_free(&v->expect);
    for (i = 1; i < ops->len && !v->fails; i++) {
        const jnode *op = ops->items[i];
        const char *kind;
        if (op->type != J_OBJ) die("an operation is not an object", NULL);
        kind = sval(op, "op");
        if (!strcmp(kind, "write_kv")) write_kv(v, op);
        else if (!strcmp(kind, "copy_blocks")) copy_blocks(v, op);
        else if (!strcmp(kind, "attention")) attention(v, op, i);
        else if (!strcmp(kind, "read_kv")) read_kv(v, op, i);
        else if (!strcmp(kind, "finish")) finish(v, op, i);
        else die("an unknown operation (create_cache comes first, once)", kind);
    }
}

/* The vector's verdict: 0 PASS, EXIT_FAIL, or EXIT_SETUP (printed by die()). */
static int run_vector(const char *manifest) {
    char err[256], *slash;
    const jnode *version;
    static vec v; /* static: setjmp leaves it intact */
    size_t size;
    unsigned char *text;
    store_free(&v.cache); /* what the last vector held, whether it ended or was abandoned */
    store_free(&v.expect);
    free(v.scales);
    json_free((jnode *)v.m);
    memset(&v, 0, sizeof v);
    v.cache.values = v.expect.values = &v.values;
    if (strlen(manifest) >= sizeof dir) { fprintf(stderr, "vectors_check: a path too long\n"); printf("ERROR (a path too long)\n"); return EXIT_SETUP; }
    snprintf(dir, sizeof dir, "%s", manifest);
    slash = strrchr(dir, '/');
    if (slash) *slash = '\0'; else strcpy(dir, ".");
    if (setjmp(setup_error)) return EXIT_SETUP;
    text = slurp(manifest, MAX_MANIFEST_BYTES, &size);
    v.m = json_parse((const char *)text, size, err, sizeof err);
    free(text);
    if (!v.m) die(err, manifest);
    if (v.m->type != J_OBJ || !json_get(v.m, "format") || field(v.m, "format")->type != J_STR ||
        strcmp(sval(v.m, "format"), "paged-spec-vectors"))
        die("not a paged-spec-vectors manifest", manifest);
    version = field(v.m, "version");
    if (version->type != J_NUM || !version->is_int || version->integer < 1 || version->integer > 2)
        die("not a manifest of version 1 or 2", manifest);
    v.version = (int)version->integer;
    check_manifest(&v);
    v.cache.B = v.expect.B = (int)v.B;
    v.cache.parts = v.expect.parts = v.latent ? 1 : 2;
    v.cache.row = v.expect.row = v.hkv * v.D;
    v.checking = 1; /* every operation checked before any is judged */
    walk(&v);
    v.checking = 0;
    walk(&v);
    if (!v.fails) printf("PASS %s: %lld operations\n", dir, field(v.m, "operations")->len);
    return v.fails ? EXIT_FAIL : 0;
}

int main(int argc, char **argv) {
    int i, worst = 0;
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR/NNNN/manifest.json [...]\n", argv[0]);
        return EXIT_SETUP;
    }
    for (i = 1; i < argc; i++) {
        int verdict = run_vector(argv[i]);
        fflush(stdout);
        if (verdict > worst) worst = verdict;
    }
    return worst;
}
