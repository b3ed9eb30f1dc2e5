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
 * stored * scale.
 *
 * Hostile input: a vector is never trusted. Every count, length, index and value the
 * loop uses is checked against the geometry before use, sizes are computed with
 * overflow checks and bounded (the READER LIMITS below), array files must be
 * arrays/NNN.npy regular files inside the vector's directory, and the tolerance
 * parameters are this reader's own (a manifest naming others is refused).
 *
 * Prints PASS, FAIL or ERROR per vector; exits 0 (every vector passed), 1 (a vector
 * failed: what this reader computed differs from the vector) or 2 (a usage or setup
 * error: a file cannot be read, or a vector is malformed or past a reader limit; the
 * other vectors are still checked). C99 plus POSIX (realpath, lstat), libc and libm. */
#define _XOPEN_SOURCE 700
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
#define MAX_BLOCK_VALUES (1LL << 24) /* 2 * block_size * num_kv_heads * head_dim */
#define MAX_BLOCKS (1LL << 40)       /* num_blocks: slots stay below 2^56 */
#define MAX_WHOLE_POOL (1LL << 20)   /* blocks in a read_kv of the whole pool */
#define MAX_CACHE_VALUES (1LL << 27) /* values held by the cache and the expected image */
#define MAX_CONTEXT (1LL << 24)      /* keys one query attends to */
#define MAX_WORK (1LL << 33)         /* multiply-adds of attention per vector */

#define EXIT_FAIL 1
#define EXIT_SETUP 2

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

/* ---- fields ---------------------------------------------------------------- */

static const jnode *field(const jnode *obj, const char *key) {
    const jnode *n = json_get(obj, key);
    if (!obj || obj->type != J_OBJ) die("expected an object holding the field", key);
    if (!n) die("manifest field missing", key);
    return n;
}
static int isnull(const jnode *n) { return !n || n->type == J_NULL; }
/* obj is an object with exactly the fields of the space-separated list (all are required). */
static void exactly(const jnode *obj, const char *fields, const char *what) {
    char name[64];
    const char *p = fields;
    long long count = 0;
    if (!obj || obj->type != J_OBJ) die("not an object", what);
    while (*p) {
        size_t n = strcspn(p, " ");
        snprintf(name, sizeof name, "%.*s", (int)n, p);
        field(obj, name);
        count++;
        p += n;
        while (*p == ' ') p++;
    }
    if (obj->len != count) die("an unknown field in", what); /* keys are unique: the parser refuses duplicates */
}
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
static const char *sval(const jnode *obj, const char *key) {
    const jnode *n = field(obj, key);
    if (n->type != J_STR) die("not a string", key);
    return n->str;
}
static const jnode *arr(const jnode *n, const char *what) {
    if (!n || n->type != J_ARR) die("not an array", what);
    return n;
}
/* Item i of an array, or a setup error: a vector is never trusted to be in range. */
static const jnode *at(const jnode *a, long long i, const char *what) {
    arr(a, what);
    if (i < 0 || i >= a->len) die("an index is out of range of", what);
    return a->items[i];
}

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
    if (!name || name->type != J_STR) die("an array field is not a path", NULL);
    check_array_name(name->str);
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

static void shape_is(const array *a, int ndim, const long long *shape, const char *what) {
    int k;
    if (a->ndim != ndim) die("an array has the wrong number of dimensions", what);
    for (k = 0; k < ndim; k++)
        if (a->shape[k] != shape[k]) die("an array's shape does not match the manifest", what);
}

/* ---- the cache: blocks by (layer, block id), allocated on first touch --------- */

typedef struct { long long key; double *kv; unsigned char *filled; } entry; /* kv: K then V, B * H_kv * D each; filled: per slot, written */
typedef struct { entry *e; long long cap, used, row, *values; int B; } store;

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
    long long key = blk * MAX_LAYERS + layer, i, size = 2LL * st->B * st->row;
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

typedef struct { int mant, min_exp; double max; } fp8;

static double round_fp8(double x, const fp8 *f) {
    double c = x > f->max ? f->max : x < -f->max ? -f->max : x, q, r; /* NaN passes */
    int e;
    frexp(c, &e);
    e = e - 1 > f->min_exp ? e - 1 : f->min_exp;
    q = ldexp(1.0, e - f->mant);
    r = rint(c / q) * q; /* the default rounding mode: to nearest, ties to even */
    r = r > f->max ? f->max : r < -f->max ? -f->max : r;
    return copysign(r, c);
}

static double quantize(double x, double scale, const fp8 *f) {
    volatile float quotient = (float)x / (float)scale; /* the division in float32 */
    return round_fp8(quotient, f);
}

/* ---- one vector -------------------------------------------------------------- */

typedef struct {
    const jnode *m, *groups; store cache, expect; rule tol; meter met;
    long long layers, B, hkv, D, H, num_blocks, slots, values, work; int fails;
    int quantized; fp8 fmt; double (*scales)[2]; /* per layer (k_scale, v_scale) */
} vec;

static double *slot_row(vec *v, store *st, long long layer, long long slot, int which) {
    if (slot < 0 || slot >= v->slots) die("a slot out of range of the pool", NULL);
    return block(st, layer, slot / v->B, 1) + (which * v->B + slot % v->B) * v->cache.row;
}

/* Write one token's K (which 0) or V (1) row: as given, or its fp8 values. */
static void store_row(vec *v, long long layer, long long slot, int which, const double *x) {
    double *dst = slot_row(v, &v->cache, layer, slot, which);
    long long d;
    entry_of(&v->cache, layer, slot / v->B)->filled[slot % v->B] = 1;
    for (d = 0; d < v->cache.row; d++)
        dst[d] = v->quantized ? quantize(x[d], v->scales[layer][which], &v->fmt) : x[d];
}

static void report(vec *v, long long op, const char *kind, long long step, const char *fmt, double a, double b) {
    printf("FAIL %s: operation %lld (%s), step %lld: ", dir, op, kind, step);
    printf(fmt, a, b);
    printf("\n");
    v->fails++;
}

static long long step_of(const jnode *op) { return ival(op, "step", 0, 1LL << 62); }
static long long layer_of(const vec *v, const jnode *op) { return ival(op, "layer", 0, v->layers - 1); }

/* A per-head list of finite numbers (sinks, ALiBi slopes), or NULL. */
static const jnode *per_head(const vec *v, const jnode *var, const char *key) {
    const jnode *n = field(var, key);
    long long h;
    if (isnull(n)) return NULL;
    if (arr(n, key)->len != v->H) die("not one value per query head", key);
    for (h = 0; h < v->H; h++) num_of(n->items[h], 0, key);
    return n;
}

/* The batch's sequences: query_start_loc [S + 1] from 0 to T, nondecreasing. */
static long long check_qsl(const jnode *qsl, long long T) {
    long long i, S = arr(qsl, "query_start_loc")->len - 1;
    if (S < 0 || int_in(qsl->items[0], 0, 0, "query_start_loc[0]") != 0) die("query_start_loc must start at 0", NULL);
    for (i = 1; i <= S; i++) int_in(qsl->items[i], qsl->items[i - 1]->integer, T, "query_start_loc (nondecreasing, at most T)");
    if (qsl->items[S]->integer != T) die("query_start_loc must end at the number of query rows", NULL);
    return S;
}

static void attention(vec *v, const jnode *op, long long index) {
    const jnode *batch = field(op, "batch"), *var = field(op, "variant");
    long long layer = layer_of(v, op), g = 0, h, d, T, S, i, r, k, worst = -1;
    const jnode *qsl = field(batch, "query_start_loc"), *pos = arr(field(batch, "positions"), "positions");
    const jnode *tables, *seqs = arr(field(batch, "seq_ids"), "seq_ids"), *lens = arr(field(batch, "seq_lens"), "seq_lens");
    array q, ex;
    double scale = num_of(field(op, "scale"), 1, "scale"), cap = 0, *out, *scores;
    double top = 0, ref_max = 0, got_max = 0;
    long long window = 0, ratio, shape[4];
    const jnode *sinks = NULL, *slopes = NULL;
    if (!v->H) die("an attention operation in a vector whose num_heads is null", NULL);
    ratio = v->H / v->hkv;
    exactly(op, "op step layer scale variant batch query expected", "an attention operation");
    exactly(batch, "block_size seq_ids query_start_loc seq_lens positions copies group_tables group_slots", "batch");
    step_of(op);
    if (ival(batch, "block_size", v->B, v->B) != v->B) die("batch.block_size", NULL);
    T = pos->len;
    S = check_qsl(qsl, T);
    if (lens->len != S || seqs->len != S) die("seq_lens and seq_ids must have one entry per sequence", NULL);
    for (i = 0; i < S; i++) int_in(seqs->items[i], -(1LL << 62), 1LL << 62, "seq_ids");
    q = load_npy(field(op, "query"));
    shape[0] = T; shape[1] = v->H; shape[2] = v->D;
    shape_is(&q, 3, shape, "query [T, num_heads, head_dim]");
    ex = load_npy(field(op, "expected"));
    shape[0] = 2; shape[1] = T; shape[2] = v->H; shape[3] = v->D;
    shape_is(&ex, 4, shape, "expected [2, T, num_heads, head_dim]");
    if (v->groups->len) g = v->groups->items[layer]->integer;
    tables = arr(at(arr(field(batch, "group_tables"), "group_tables"), g, "group_tables (by the layer's group)"), "a group's tables");
    if (tables->len < S) die("a group's tables have fewer rows than sequences", NULL);
    if (arr(field(batch, "group_slots"), "group_slots")->len != field(batch, "group_tables")->len)
        die("group_slots must have one slot mapping per group", NULL);
    for (i = 0; i < field(batch, "group_slots")->len; i++) { /* unused here, but a vector's backend reads them */
        const jnode *gs = arr(field(batch, "group_slots")->items[i], "a group's slot mapping");
        if (gs->len != T) die("a group's slot mapping must have one slot per query row", NULL);
        for (k = 0; k < T; k++) int_in(gs->items[k], -1, v->slots - 1, "group_slots (-1 or a slot of the pool)");
    }
    if (!isnull(var)) {
        exactly(var, "window softcap sinks alibi_slopes", "variant");
        if (!isnull(field(var, "window"))) window = ival(var, "window", 1, MAX_CONTEXT);
        if (!isnull(field(var, "softcap"))) cap = num_of(field(var, "softcap"), 1, "softcap");
        sinks = per_head(v, var, "sinks");
        slopes = per_head(v, var, "alibi_slopes");
    }
    out = alloc(q.count, sizeof(double));
    for (i = 0; i < S; i++) {
        const jnode *table = arr(tables->items[i], "a block table row");
        long long seq_len = int_in(lens->items[i], 1, product(table->len, v->B, 1LL << 62, "a block table's span"),
                                   "seq_lens (1 up to what its block table row covers)");
        for (r = qsl->items[i]->integer; r < qsl->items[i + 1]->integer; r++) {
            long long p = int_in(pos->items[r], 0, seq_len - 1, "positions (below its sequence's seq_len)");
            long long first = window && p - window + 1 > 0 ? p - window + 1 : 0, n = p - first + 1;
            if (n > MAX_CONTEXT) die("past this reader's limit", "keys attended by one query");
            if (product(n, v->H * v->D, MAX_WORK, "attention work") > MAX_WORK - v->work)
                die("past this reader's limit", "attention work in one vector");
            v->work += n * v->H * v->D;
            scores = alloc(n, sizeof(double));
            for (k = first; k <= p; k++) { /* every block the query reads must be in the pool */
                long long blk = int_in(table->items[k / v->B], 0, v->num_blocks - 1, "a block table entry read by a query");
                (void)blk;
            }
            for (h = 0; h < v->H; h++) {
                double m = -HUGE_VAL, total = 0, *o = out + (r * v->H + h) * v->D;
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
                    const double *vr = slot_row(v, &v->cache, layer, slot, 1) + kvh * v->D;
                    double w = exp(scores[k - first] - m), vs = v->quantized ? v->scales[layer][1] : 1.0;
                    total += w;
                    for (d = 0; d < v->D; d++) o[d] += w * vs * vr[d];
                }
                if (sinks) total += exp(sinks->items[h]->num - m);
                for (d = 0; d < v->D; d++) o[d] /= total;
            }
            free(scores);
        }
    }
    /* check 1: the largest error in ulps against ratio x the reference's + floor */
    for (k = 0; k < q.count; k++) if (fabs(ex.data[k]) > top) top = fabs(ex.data[k]);
    top = v->tol.mag * top;
    if (top < ulp(0.0, &v->tol)) top = ulp(0.0, &v->tol);
    for (k = 0; k < q.count; k++) {
        double e = ex.data[k], unit = ulp(fabs(e) > top ? e : top, &v->tol);
        double err = fabs(out[k] - e) / unit, ref = fabs(ex.data[q.count + k] - e) / unit;
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
        long long row = worst / (v->H * v->D), s = 0;
        while (s + 1 < S && qsl->items[s + 1]->integer <= row) s++;
        printf("FAIL %s: operation %lld (attention), step %lld, layer %lld, sequence %lld, token %lld, "
               "head %lld: error %.3g ulp > allowed %.3g ulp\n", dir, index, step_of(op), layer,
               seqs->items[s]->integer, pos->items[row]->integer, worst / v->D % v->H, got_max,
               v->tol.ratio * ref_max + v->tol.floor_ulps);
        v->fails++;
    }
    free(out); free(q.data); free(ex.data);
}

static void read_kv(vec *v, const jnode *op, long long index) {
    const jnode *blocks = field(op, "blocks"), *slots = arr(field(op, "update_slots"), "update_slots");
    long long layer = layer_of(v, op), i, n, j, per = v->B * v->cache.row;
    int which;
    exactly(op, "op step layer blocks update_slots update", "a read_kv operation");
    step_of(op);
    if (!isnull(blocks)) arr(blocks, "blocks");
    else if (v->num_blocks > MAX_WHOLE_POOL) die("past this reader's limit", "blocks in a read of the whole pool");
    n = isnull(blocks) ? v->num_blocks : blocks->len;
    if (!isnull(field(op, "update"))) {
        array u = load_npy(field(op, "update"));
        long long shape[4];
        shape[0] = 2; shape[1] = slots->len; shape[2] = v->hkv; shape[3] = v->D;
        shape_is(&u, 4, shape, "update [2, len(update_slots), num_kv_heads, head_dim]");
        for (i = 0; i < slots->len; i++) {
            long long slot = int_in(slots->items[i], 0, v->slots - 1, "update_slots");
            const entry *e = entry_of(&v->cache, layer, slot / v->B);
            if (!e || !e->filled[slot % v->B]) /* else this reader would be blamed for what the vector never wrote */
                die("update_slots names a slot the vector's write_kv operations never wrote", NULL);
            for (which = 0; which < 2; which++)
                memcpy(slot_row(v, &v->expect, layer, slot, which), u.data + (which * slots->len + i) * v->cache.row,
                       sizeof(double) * (size_t)v->cache.row);
        }
        free(u.data);
    }
    for (i = 0; i < n && !v->fails; i++) {
        long long blk = isnull(blocks) ? i : int_in(blocks->items[i], 0, v->num_blocks - 1, "blocks");
        double *want = block(&v->expect, layer, blk, 0), *got;
        if (!want) die("a block is read before any update gave its expected contents", NULL);
        got = block(&v->cache, layer, blk, 1);
        for (j = 0; j < 2 * per; j++)
            if (want[j] != got[j]) {
                printf("FAIL %s: operation %lld (read_kv), step %lld, layer %lld, %c of block %lld, offset %lld: "
                       "expected %.9g, this reader holds %.9g\n", dir, index, step_of(op), layer,
                       j < per ? 'K' : 'V', blk, j % per / v->cache.row, want[j], got[j]);
                v->fails++;
                break;
            }
    }
}

static void write_kv(vec *v, const jnode *op) {
    const jnode *slots = arr(field(op, "slot_mapping"), "slot_mapping");
    long long layer = layer_of(v, op), j, rows, row = v->cache.row;
    array kv;
    int which;
    exactly(op, "op step layer slot_mapping kv tokens", "a write_kv operation");
    step_of(op);
    kv = load_npy(field(op, "kv"));
    rows = kv.ndim == 4 ? kv.shape[1] : 0;
    if (kv.ndim != 4 || kv.shape[0] != 2 || kv.shape[2] != v->hkv || kv.shape[3] != v->D)
        die("a write_kv array is not [2, rows, num_kv_heads, head_dim]", NULL);
    if (slots->len > rows) die("slot_mapping is longer than the kv array's rows", NULL);
    for (j = 0; j < slots->len; j++) {
        long long slot = int_in(slots->items[j], -1, v->slots - 1, "slot_mapping (-1 or a slot of the pool)");
        if (slot >= 0)
            for (which = 0; which < 2; which++) store_row(v, layer, slot, which, kv.data + (which * rows + j) * row);
    }
    free(kv.data);
}

static void copy_blocks(vec *v, const jnode *op) {
    const jnode *copies = arr(field(op, "copies"), "copies");
    long long c, layer;
    exactly(op, "op step copies", "a copy_blocks operation");
    step_of(op);
    for (c = 0; c < copies->len; c++) {
        const jnode *pair = arr(copies->items[c], "copies[i]");
        long long src, dst;
        if (pair->len != 2) die("a copy is not a [src, dst] pair", NULL);
        src = int_in(pair->items[0], 0, v->num_blocks - 1, "a copy's source block");
        dst = int_in(pair->items[1], 0, v->num_blocks - 1, "a copy's destination block");
        for (layer = 0; layer < v->layers; layer++) {
            double *to = block(&v->cache, layer, dst, 1), *from = block(&v->cache, layer, src, 1);
            memmove(to, from, sizeof(double) * (size_t)(2 * v->B * v->cache.row));
            memmove(entry_of(&v->cache, layer, dst)->filled, entry_of(&v->cache, layer, src)->filled, (size_t)v->B);
        }
    }
}

static void finish(vec *v, const jnode *op, long long i) {
    double n = (double)v->met.count, mean, allowed, lean;
    exactly(op, "op step", "a finish operation");
    step_of(op);
    if (v->met.count < v->tol.min_samples) return;
    mean = v->met.abs_sum / n;
    allowed = v->tol.mean_ratio * v->met.ref_sum / n + v->tol.mean_floor;
    lean = fmax(fabs(v->met.signed_sum / n), fabs(v->met.outward_sum / n));
    if (mean > allowed) report(v, i, "finish", step_of(op), "mean error %.3g ulp > allowed %.3g ulp", mean, allowed);
    else if (lean > v->tol.bias_limit) report(v, i, "finish", step_of(op), "outputs lean %.3g ulp > limit %.3g ulp", lean, v->tol.bias_limit);
}

/* The geometry's fields, each in range; the pool's blocks come from create_cache. */
static void geometry(vec *v, const jnode *g, const jnode *made) {
    const char *names[] = {"num_layers", "block_size", "num_kv_heads", "head_dim"};
    const long long highs[] = {MAX_LAYERS, MAX_BLOCK_SIZE, MAX_HEADS, MAX_HEAD_DIM};
    long long values[4], i;
    const char *dtype = sval(g, "dtype"), *all = "num_layers num_blocks block_size num_kv_heads head_dim dtype kv_dtype kv_scales layer_groups";
    exactly(g, all, "geometry");
    exactly(made, all, "create_cache's geometry");
    exactly(field(v->m, "tolerance"), "rule dtype mantissa_bits min_normal_exponent magnitude_floor ratio floor_ulps mean_ratio "
            "mean_floor_ulps bias_limit_ulps bias_clip_ulps min_samples", "tolerance");
    for (i = 0; i < 4; i++) {
        values[i] = ival(g, names[i], 1, highs[i]);
        if (ival(made, names[i], values[i], values[i]) != values[i]) die("create_cache's geometry differs", names[i]);
    }
    v->layers = values[0]; v->B = values[1]; v->hkv = values[2]; v->D = values[3];
    product(2 * v->B, v->hkv * v->D, MAX_BLOCK_VALUES, "values per block");
    v->num_blocks = ival(made, "num_blocks", ival(g, "num_blocks", 1, MAX_BLOCKS), MAX_BLOCKS);
    v->slots = v->num_blocks * v->B;
    if (strcmp(dtype, sval(made, "dtype"))) die("create_cache's geometry differs", "dtype");
    v->tol = tolerance_of(field(v->m, "tolerance"), dtype);
    v->groups = arr(field(g, "layer_groups"), "layer_groups");
    if (v->groups->len && v->groups->len != v->layers) die("layer_groups must be empty or one per layer", NULL);
    for (i = 0; i < v->groups->len; i++) int_in(v->groups->items[i], 0, MAX_LAYERS - 1, "layer_groups");
    v->H = isnull(field(v->m, "num_heads")) ? 0 : ival(v->m, "num_heads", 1, MAX_HEADS); /* null: no attention */
    if (v->H % v->hkv) die("num_heads is not a multiple of num_kv_heads", NULL);
}

/* fp8 KV: the format and one positive scale pair per layer, finite in float32. */
static void kv_format(vec *v, const jnode *g, const jnode *made) {
    const jnode *kind = field(g, "kv_dtype"), *scales;
    fp8 e4m3 = {3, -6, 448.0}, e5m2 = {2, -14, 57344.0};
    long long i;
    int which;
    if (isnull(kind) != isnull(field(made, "kv_dtype")) ||
        (!isnull(kind) && (field(made, "kv_dtype")->type != J_STR || kind->type != J_STR ||
                           strcmp(kind->str, field(made, "kv_dtype")->str))))
        die("create_cache's geometry differs", "kv_dtype");
    if (isnull(kind)) return;
    if (kind->type == J_STR && !strcmp(kind->str, "fp8_e4m3")) v->fmt = e4m3;
    else if (kind->type == J_STR && !strcmp(kind->str, "fp8_e5m2")) v->fmt = e5m2;
    else die("kv_dtype is not null, fp8_e4m3 or fp8_e5m2", NULL);
    scales = arr(field(g, "kv_scales"), "kv_scales");
    if (scales->len != v->layers) die("kv_scales must hold one pair per layer", NULL);
    v->scales = alloc(v->layers, sizeof *v->scales);
    for (i = 0; i < v->layers; i++) {
        const jnode *pair = arr(scales->items[i], "kv_scales[i]");
        if (pair->len != 2) die("a kv_scales entry is not a (k_scale, v_scale) pair", NULL);
        for (which = 0; which < 2; which++) { /* scales are used as float32 values */
            float s = (float)num_of(pair->items[which], 1, "kv_scales");
            if (!(s > 0) || !isfinite(s)) die("a kv scale is not a positive finite float32", NULL);
            v->scales[i][which] = s;
        }
    }
    v->quantized = 1;
}

/* The vector's verdict: 0 PASS, EXIT_FAIL, or EXIT_SETUP (printed by die()). */
static int run_vector(const char *manifest) {
    char err[256], *slash;
    const jnode *ops, *g, *version;
    static vec v; /* static: setjmp leaves it intact */
    long long i;
    size_t size;
    unsigned char *text;
    memset(&v, 0, sizeof v);
    v.cache.values = v.expect.values = &v.values;
    if (strlen(manifest) >= sizeof dir) { fprintf(stderr, "vectors_check: a path too long\n"); printf("ERROR (a path too long)\n"); return EXIT_SETUP; }
    snprintf(dir, sizeof dir, "%s", manifest);
    slash = strrchr(dir, '/');
    if (slash) *slash = '\0'; else strcpy(dir, ".");
    if (setjmp(setup_error)) return EXIT_SETUP;
    text = slurp(manifest, MAX_MANIFEST_BYTES, &size);
    v.m = json_parse((const char *)text, size, err, sizeof err);
    if (!v.m) die(err, manifest);
    if (v.m->type != J_OBJ || !json_get(v.m, "format") || field(v.m, "format")->type != J_STR ||
        strcmp(sval(v.m, "format"), "paged-spec-vectors"))
        die("not a paged-spec-vectors manifest", manifest);
    version = field(v.m, "version");
    if (version->type != J_NUM || !version->is_int || version->integer != 1) die("not a manifest of version 1", manifest);
    exactly(v.m, "format version example source geometry num_heads scale scale_regime layer_variants tolerance operations", "the manifest");
    exactly(field(v.m, "source"), "profile seed passes suite", "source");
    ops = arr(field(v.m, "operations"), "operations");
    if (ops->len < 2) die("a vector needs create_cache and at least one more operation", "operations");
    if (ops->items[0]->type != J_OBJ || strcmp(sval(ops->items[0], "op"), "create_cache"))
        die("the first operation must be create_cache", NULL);
    exactly(ops->items[0], "op geometry", "create_cache");
    g = field(v.m, "geometry");
    geometry(&v, g, field(ops->items[0], "geometry"));
    kv_format(&v, g, field(ops->items[0], "geometry"));
    v.cache.B = v.expect.B = (int)v.B;
    v.cache.row = v.expect.row = v.hkv * v.D;
    for (i = 1; i < ops->len && !v.fails; i++) {
        const jnode *op = ops->items[i];
        const char *kind;
        if (op->type != J_OBJ) die("an operation is not an object", NULL);
        kind = sval(op, "op");
        if (!strcmp(kind, "write_kv")) write_kv(&v, op);
        else if (!strcmp(kind, "copy_blocks")) copy_blocks(&v, op);
        else if (!strcmp(kind, "attention")) attention(&v, op, i);
        else if (!strcmp(kind, "read_kv")) read_kv(&v, op, i);
        else if (!strcmp(kind, "finish")) finish(&v, op, i);
        else die("an unknown operation (create_cache comes first, once)", kind);
    }
    if (!v.fails) printf("PASS %s: %lld operations\n", dir, ops->len);
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
