/* vectors_check: replays paged-spec test vectors with a naive paged-attention loop.
 *
 * Build: cc -std=c99 -O2 -o vectors_check vectors_check.c json.c -lm
 * Run:   ./vectors_check DIR/0000/manifest.json [more manifests...]
 *
 * For each vector it keeps its own KV cache (written by write_kv, copied by
 * copy_blocks), compares it bit for bit with every read_kv's expected contents,
 * computes every attention call in double precision (slot = table[p / B] * B + p % B,
 * causal, GQA, scale; sliding window, soft-cap, sinks and ALiBi) and judges it with
 * the manifest's tolerance rule. An fp8 cache (kv_dtype fp8_e4m3 or fp8_e5m2) stores
 * round_fp8(float32(x) / float32(scale)) and attention reads stored * scale.
 * Prints PASS, SKIP or FAIL per vector; exits 0 (no failure), 1 (a failure) or
 * 2 (a file cannot be read or is not a vector). C99, libc and libm only. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

static char dir[4096];

static void die(const char *msg, const char *what) {
    fprintf(stderr, "vectors_check: %s%s%s\n", msg, what ? ": " : "", what ? what : "");
    exit(2);
}

static char *slurp(const char *path, long *size) {
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;
    if (!f) die("cannot open", path);
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) die("cannot read", path);
    fclose(f);
    buf[n] = '\0';
    if (size) *size = n;
    return buf;
}

/* ---- fields ---------------------------------------------------------------- */

static const jnode *field(const jnode *obj, const char *key) {
    const jnode *n = json_get(obj, key);
    if (!n) die("manifest field missing", key);
    return n;
}
static const jnode *number_of(const jnode *n, const char *what) {
    if (n->type != J_NUM) die("not a number", what);
    return n;
}
static long long ival(const jnode *obj, const char *key) { return number_of(field(obj, key), key)->integer; }
static double dval(const jnode *obj, const char *key) { return number_of(field(obj, key), key)->num; }
static const char *sval(const jnode *obj, const char *key) {
    const jnode *n = field(obj, key);
    if (n->type != J_STR) die("not a string", key);
    return n->str;
}
/* Item i of an array, or exit 2 naming the problem: a vector is never trusted to be in range. */
static const jnode *at(const jnode *arr, long long i) {
    if (!arr || arr->type != J_ARR) die("expected an array in the manifest", NULL);
    if (i < 0 || i >= arr->len) die("an index in the manifest is out of range", NULL);
    return arr->items[i];
}
static int isnull(const jnode *n) { return !n || n->type == J_NULL; }

/* ---- .npy: version 1.0, '<f4' or '<f8', C order ------------------------------ */

typedef struct { double *data; long long count; int ndim; long long shape[8]; } array;

static array load_npy(const jnode *name) {
    char path[8192], *buf, *h, *s;
    long size;
    unsigned hlen;
    int f4;
    long long i;
    array a;
    memset(&a, 0, sizeof a);
    if (!name || name->type != J_STR) die("an array field is not a path", NULL);
    snprintf(path, sizeof path, "%s/%s", dir, name->str);
    buf = slurp(path, &size);
    if (size < 10 || memcmp(buf, "\x93NUMPY\x01\x00", 8)) die("not a version 1.0 .npy", path);
    hlen = (unsigned char)buf[8] | (unsigned)(unsigned char)buf[9] << 8;
    h = buf + 10;
    if (strstr(h, "'descr': '<f4'") && strstr(h, "'descr': '<f4'") < h + hlen) f4 = 1;
    else if (strstr(h, "'descr': '<f8'") && strstr(h, "'descr': '<f8'") < h + hlen) f4 = 0;
    else die("dtype is not '<f4' or '<f8'", path);
    if (!strstr(h, "'fortran_order': False")) die("not C order", path);
    s = strstr(h, "'shape': (");
    if (!s) die("no shape", path);
    s += 10;
    a.count = 1;
    while (*s != ')') {
        char *end;
        long long d = strtoll(s, &end, 10);
        if (end == s) break;
        if (a.ndim == 8) die("too many dimensions", path);
        a.shape[a.ndim++] = d;
        a.count *= d;
        s = end;
        while (*s == ',' || *s == ' ') s++;
    }
    if (size - 10 - (long)hlen != a.count * (f4 ? 4 : 8)) die("data size does not match shape", path);
    a.data = malloc(sizeof(double) * (size_t)(a.count ? a.count : 1));
    for (i = 0; i < a.count; i++) { /* little-endian bytes, whatever this machine's order */
        const unsigned char *b = (const unsigned char *)buf + 10 + hlen + i * (f4 ? 4 : 8);
        if (f4) {
            unsigned long u = (unsigned long)b[0] | (unsigned long)b[1] << 8 |
                              (unsigned long)b[2] << 16 | (unsigned long)b[3] << 24;
            float x;
            unsigned int u32 = (unsigned int)u;
            memcpy(&x, &u32, 4);
            a.data[i] = x;
        } else {
            unsigned long long u = 0;
            int k;
            for (k = 7; k >= 0; k--) u = u << 8 | b[k];
            memcpy(&a.data[i], &u, 8);
        }
    }
    free(buf);
    return a;
}

/* ---- the cache: blocks by (layer, block id), allocated on first touch --------- */

typedef struct { long long key; double *kv; } entry; /* kv: K then V, B * H_kv * D each */
typedef struct { entry *e; long long cap, used, row; int B; } store;

static long long probe(const store *st, long long key) {
    long long i = (key * 2654435761LL & 0x7fffffffffffLL) % st->cap;
    while (st->e[i].kv && st->e[i].key != key) i = (i + 1) % st->cap;
    return i;
}

/* The block's storage; created (zeros) if absent and create is set. Pointers returned
 * earlier stay valid: growing the table moves entries, never their storage. */
static double *block(store *st, int layer, long long blk, int create) {
    long long key = blk * 4096 + layer, i;
    if (st->cap && st->e[i = probe(st, key)].kv) return st->e[i].kv;
    if (!create) return NULL;
    if (st->used * 2 >= st->cap) { /* grow and rehash */
        store bigger = *st;
        bigger.cap = st->cap ? st->cap * 2 : 1024;
        bigger.e = calloc((size_t)bigger.cap, sizeof(entry));
        if (!bigger.e) die("out of memory", NULL);
        for (i = 0; i < st->cap; i++)
            if (st->e[i].kv) bigger.e[probe(&bigger, st->e[i].key)] = st->e[i];
        free(st->e);
        *st = bigger;
    }
    i = probe(st, key);
    st->e[i].key = key;
    st->e[i].kv = calloc((size_t)(2 * st->B * st->row), sizeof(double));
    if (!st->e[i].kv) die("out of memory", NULL);
    st->used++;
    return st->e[i].kv;
}

static double *slot_row(store *st, int layer, long long slot, int which, int create) {
    if (slot < 0) die("a negative slot where a real one is needed", NULL);
    double *b = block(st, layer, slot / st->B, create);
    return b ? b + (which * st->B + slot % st->B) * st->row : NULL;
}

/* ---- the tolerance rule (docs/vectors.md) --------------------------------------- */

typedef struct { int mant, min_exp, min_samples; double mag, ratio, floor_ulps, mean_ratio,
                 mean_floor, bias_limit, clip; } rule;
typedef struct { double abs_sum, ref_sum, signed_sum, outward_sum; long long count; } meter;

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
    const jnode *m; store cache, expect; rule tol; meter met;
    int layers, B, hkv, D, H, fails; long long num_blocks;
    int quantized; fp8 fmt; double scales[4096][2]; /* per layer (k_scale, v_scale) */
} vec;

/* Write one token's K (which 0) or V (1) row: as given, or its fp8 values. */
static void store_row(vec *v, int layer, long long slot, int which, const double *x) {
    double *dst = slot_row(&v->cache, layer, slot, which, 1);
    long long d;
    for (d = 0; d < v->cache.row; d++)
        dst[d] = v->quantized ? quantize(x[d], v->scales[layer][which], &v->fmt) : x[d];
}

static void report(vec *v, int op, const char *kind, long long step, const char *fmt, double a, double b) {
    printf("FAIL %s: operation %d (%s), step %lld: ", dir, op, kind, step);
    printf(fmt, a, b);
    printf("\n");
    v->fails++;
}

static void attention(vec *v, const jnode *op, int index) {
    const jnode *batch = field(op, "batch"), *var = field(op, "variant");
    int layer = (int)ival(op, "layer"), g = 0, h, d;
    const jnode *groups = json_get(field(v->m, "geometry"), "layer_groups");
    const jnode *qsl = field(batch, "query_start_loc"), *pos = field(batch, "positions");
    const jnode *tables, *seqs = field(batch, "seq_ids");
    array q = load_npy(field(op, "query")), ex = load_npy(field(op, "expected"));
    double scale = dval(op, "scale"), cap = 0, *out, *scores, top = 0, ref_max = 0, got_max = 0;
    long long T = q.shape[0], i, r, k, worst = -1;
    int window = 0, ratio = v->H / v->hkv;
    const jnode *sinks = NULL, *slopes = NULL;
    if (q.ndim != 3 || q.shape[1] != v->H || q.shape[2] != v->D || ex.count != 2 * q.count ||
        q.shape[0] != pos->len)
        die("query and expected do not match the batch and num_heads", NULL);
    if (groups && groups->len) g = (int)at(groups, layer)->integer;
    tables = at(field(batch, "group_tables"), g);
    if (!isnull(var)) {
        if (!isnull(json_get(var, "window"))) window = (int)ival(var, "window");
        if (!isnull(json_get(var, "softcap"))) cap = dval(var, "softcap");
        if (!isnull(json_get(var, "sinks"))) sinks = json_get(var, "sinks");
        if (!isnull(json_get(var, "alibi_slopes"))) slopes = json_get(var, "alibi_slopes");
    }
    out = calloc((size_t)(T * v->H * v->D), sizeof(double));
    for (i = 0; i + 1 < qsl->len; i++) {
        const jnode *table = at(tables, i);
        long long seq_len = at(field(batch, "seq_lens"), i)->integer;
        scores = malloc(sizeof(double) * (size_t)seq_len);
        for (r = at(qsl, i)->integer; r < at(qsl, i + 1)->integer; r++) {
            long long p = at(pos, r)->integer, first = window ? p - window + 1 : 0;
            if (first < 0) first = 0;
            if (p >= seq_len) die("a position at or past its sequence's seq_len", NULL);
            for (h = 0; h < v->H; h++) {
                double m = -HUGE_VAL, total = 0, *o = out + (r * v->H + h) * v->D;
                const double *qr = q.data + (r * v->H + h) * v->D;
                int kvh = h / ratio;
                for (k = first; k <= p; k++) {
                    long long slot = at(table, k / v->B)->integer * v->B + k % v->B;
                    const double *kr = slot_row(&v->cache, layer, slot, 0, 1) + kvh * v->D;
                    double s = 0;
                    for (d = 0; d < v->D; d++) s += qr[d] * kr[d];
                    if (v->quantized) s *= v->scales[layer][0];
                    s *= scale;
                    if (cap > 0) s = cap * tanh(s / cap);
                    if (slopes) s += at(slopes, h)->num * (double)(k - p);
                    scores[k] = s;
                    if (s > m) m = s;
                }
                if (sinks && at(sinks, h)->num > m) m = at(sinks, h)->num;
                for (k = first; k <= p; k++) {
                    long long slot = at(table, k / v->B)->integer * v->B + k % v->B;
                    const double *vr = slot_row(&v->cache, layer, slot, 1, 1) + kvh * v->D;
                    double w = exp(scores[k] - m), vs = v->quantized ? v->scales[layer][1] : 1.0;
                    total += w;
                    for (d = 0; d < v->D; d++) o[d] += w * vs * vr[d];
                }
                if (sinks) total += exp(at(sinks, h)->num - m);
                for (d = 0; d < v->D; d++) o[d] /= total;
            }
        }
        free(scores);
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
        long long row = worst / ((long long)v->H * v->D), s = 0;
        while (s + 1 < qsl->len && at(qsl, s + 1)->integer <= row) s++;
        printf("FAIL %s: operation %d (attention), step %lld, layer %d, sequence %lld, token %lld, "
               "head %lld: error %.3g ulp > allowed %.3g ulp\n", dir, index, ival(op, "step"), layer,
               at(seqs, s)->integer, at(pos, row)->integer, worst / v->D % v->H, got_max,
               v->tol.ratio * ref_max + v->tol.floor_ulps);
        v->fails++;
    }
    free(out); free(q.data); free(ex.data);
}

static void read_kv(vec *v, const jnode *op, int index) {
    const jnode *blocks = field(op, "blocks"), *slots = field(op, "update_slots");
    int layer = (int)ival(op, "layer"), which;
    long long i, n = isnull(blocks) ? v->num_blocks : blocks->len, j;
    if (!isnull(field(op, "update"))) {
        array u = load_npy(field(op, "update"));
        if (u.count != 2 * slots->len * v->hkv * v->D) die("an update does not match update_slots", NULL);
        for (i = 0; i < slots->len; i++)
            for (which = 0; which < 2; which++)
                memcpy(slot_row(&v->expect, layer, at(slots, i)->integer, which, 1),
                       u.data + (which * slots->len + i) * v->hkv * v->D, sizeof(double) * (size_t)(v->hkv * v->D));
        free(u.data);
    }
    for (i = 0; i < n && !v->fails; i++) {
        long long blk = isnull(blocks) ? i : at(blocks, i)->integer;
        double *want = block(&v->expect, layer, blk, 1), *got = block(&v->cache, layer, blk, 1);
        for (j = 0; j < 2LL * v->B * v->hkv * v->D; j++)
            if (want[j] != got[j] && !(want[j] != want[j] && got[j] != got[j])) {
                long long per = (long long)v->B * v->hkv * v->D;
                printf("FAIL %s: operation %d (read_kv), step %lld, layer %d, %c of block %lld, offset %lld: "
                       "expected %.9g, this reader holds %.9g\n", dir, index, ival(op, "step"), layer,
                       j < per ? 'K' : 'V', blk, j % per / (v->hkv * v->D), want[j], got[j]);
                v->fails++;
                break;
            }
    }
}

static int run_vector(const char *manifest) {
    char err[256], *slash;
    const jnode *ops, *g, *tol;
    vec v;
    int i;
    char *text = slurp(manifest, NULL);
    memset(&v, 0, sizeof v);
    snprintf(dir, sizeof dir, "%s", manifest);
    slash = strrchr(dir, '/');
    if (slash) *slash = '\0'; else strcpy(dir, ".");
    v.m = json_parse(text, err, sizeof err);
    if (!v.m) die(err, manifest);
    if (!json_get(v.m, "format") || strcmp(sval(v.m, "format"), "paged-spec-vectors") ||
        ival(v.m, "version") != 1)
        die("not a paged-spec-vectors manifest of version 1", manifest);
    g = field(v.m, "geometry");
    tol = field(v.m, "tolerance");
    if (strcmp(sval(tol, "rule"), "same-precision-ulps")) die("unknown tolerance rule", manifest);
    if (!isnull(field(g, "kv_dtype"))) {
        const char *name = sval(g, "kv_dtype");
        const jnode *scales = field(g, "kv_scales");
        fp8 e4m3 = {3, -6, 448.0}, e5m2 = {2, -14, 57344.0};
        if (!strcmp(name, "fp8_e4m3")) v.fmt = e4m3;
        else if (!strcmp(name, "fp8_e5m2")) v.fmt = e5m2;
        else {
            printf("SKIP %s: KV dtype %s is not implemented by this reader\n", dir, name);
            return 0;
        }
        if (scales->len > 4096) die("more than 4096 layers", manifest);
        for (i = 0; i < scales->len; i++) { /* scales are used as float32 values */
            v.scales[i][0] = (float)at(at(scales, i), 0)->num;
            v.scales[i][1] = (float)at(at(scales, i), 1)->num;
        }
        v.quantized = 1;
    }
    v.layers = (int)ival(g, "num_layers"); v.B = (int)ival(g, "block_size");
    v.hkv = (int)ival(g, "num_kv_heads"); v.D = (int)ival(g, "head_dim");
    v.H = isnull(field(v.m, "num_heads")) ? 0 : (int)ival(v.m, "num_heads"); /* null: no attention */
    v.tol.mant = (int)ival(tol, "mantissa_bits"); v.tol.min_exp = (int)ival(tol, "min_normal_exponent");
    v.tol.mag = dval(tol, "magnitude_floor"); v.tol.ratio = dval(tol, "ratio");
    v.tol.floor_ulps = dval(tol, "floor_ulps"); v.tol.mean_ratio = dval(tol, "mean_ratio");
    v.tol.mean_floor = dval(tol, "mean_floor_ulps"); v.tol.bias_limit = dval(tol, "bias_limit_ulps");
    v.tol.clip = dval(tol, "bias_clip_ulps"); v.tol.min_samples = (int)ival(tol, "min_samples");
    v.cache.B = v.expect.B = v.B;
    v.cache.row = v.expect.row = (long long)v.hkv * v.D;
    ops = field(v.m, "operations");
    for (i = 0; i < ops->len && !v.fails; i++) {
        const jnode *op = at(ops, i);
        const char *kind = sval(op, "op");
        if (!strcmp(kind, "create_cache")) {
            v.num_blocks = ival(field(op, "geometry"), "num_blocks");
        } else if (!strcmp(kind, "write_kv")) {
            const jnode *slots = field(op, "slot_mapping");
            array kv = load_npy(field(op, "kv"));
            long long j, rows = kv.shape[1], row = v.cache.row;
            if (kv.ndim != 4 || kv.shape[0] != 2 || kv.shape[2] * kv.shape[3] != row)
                die("a write_kv array is not [2, rows, H_kv, D]", NULL);
            int layer = (int)ival(op, "layer"), which;
            for (j = 0; j < slots->len && j < rows; j++)
                if (at(slots, j)->integer >= 0)
                    for (which = 0; which < 2; which++)
                        store_row(&v, layer, at(slots, j)->integer, which, kv.data + (which * rows + j) * row);
            free(kv.data);
        } else if (!strcmp(kind, "copy_blocks")) {
            const jnode *copies = field(op, "copies");
            int c, layer;
            for (c = 0; c < copies->len; c++)
                for (layer = 0; layer < v.layers; layer++) {
                    double *dst = block(&v.cache, layer, at(at(copies, c), 1)->integer, 1);
                    double *src = block(&v.cache, layer, at(at(copies, c), 0)->integer, 1);
                    memcpy(dst, src, sizeof(double) * (size_t)(2 * v.B * v.cache.row));
                }
        } else if (!strcmp(kind, "attention")) {
            attention(&v, op, i);
        } else if (!strcmp(kind, "read_kv")) {
            read_kv(&v, op, i);
        } else if (!strcmp(kind, "finish") && v.met.count >= v.tol.min_samples) {
            double n = (double)v.met.count, mean = v.met.abs_sum / n;
            double allowed = v.tol.mean_ratio * v.met.ref_sum / n + v.tol.mean_floor;
            double lean = fmax(fabs(v.met.signed_sum / n), fabs(v.met.outward_sum / n));
            if (mean > allowed) report(&v, i, kind, ival(op, "step"), "mean error %.3g ulp > allowed %.3g ulp", mean, allowed);
            else if (lean > v.tol.bias_limit) report(&v, i, kind, ival(op, "step"), "outputs lean %.3g ulp > limit %.3g ulp", lean, v.tol.bias_limit);
        }
    }
    if (!v.fails) printf("PASS %s: %d operations\n", dir, ops->len);
    return v.fails ? 1 : 0;
}

int main(int argc, char **argv) {
    int i, failed = 0;
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR/NNNN/manifest.json [...]\n", argv[0]);
        return 2;
    }
    for (i = 1; i < argc; i++) failed |= run_vector(argv[i]);
    return failed;
}
