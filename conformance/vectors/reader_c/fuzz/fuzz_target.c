/* A fuzz target for the C reader's two parsers of untrusted bytes: the JSON parser
 * (json.c) and the .npy loader (npy.c). Each input goes through both.
 *
 * With clang it is a libFuzzer target (build with -DVECTORS_LIBFUZZER and
 * -fsanitize=fuzzer,address,undefined). Without libFuzzer (gcc) main() below is a
 * self-contained random-mutation fuzzer over a seed corpus, meant to be built with
 * -fsanitize=address,undefined -fno-sanitize-recover=all so that any memory error or
 * undefined behaviour aborts; the input that did it is saved first as crash-N.bin.
 * It also replays files given as arguments, or stdin, once each. docs/vectors.md
 * gives the commands. */
#define _XOPEN_SOURCE 700
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../json.h"
#include "../npy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[256];
    array a;
    jnode *root = json_parse((const char *)data, size, err, sizeof err);
    json_free(root);
    if (!npy_parse(data, size, 1LL << 24, &a, err, sizeof err)) free(a.data);
    return 0;
}

#ifndef VECTORS_LIBFUZZER

#if defined(__SANITIZE_ADDRESS__)
#define HAVE_DEATH_CALLBACK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HAVE_DEATH_CALLBACK 1
#endif
#endif
#ifdef HAVE_DEATH_CALLBACK
void __sanitizer_set_death_callback(void (*callback)(void));
#endif

typedef struct { unsigned char *data; size_t size; } input;

static input current; /* the input being run: saved if it crashes */

static void save_current(void) {
    char name[64];
    FILE *f;
    if (!current.data) return;
    snprintf(name, sizeof name, "crash-%ld.bin", (long)time(NULL));
    f = fopen(name, "wb");
    if (f) {
        fwrite(current.data, 1, current.size, f);
        fclose(f);
        fprintf(stderr, "fuzz: the input is saved as %s\n", name);
    }
}

static input read_file(FILE *f) {
    input in = {NULL, 0};
    size_t cap = 0, n;
    unsigned char chunk[65536];
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (in.size + n > cap) {
            cap = (in.size + n) * 2;
            in.data = realloc(in.data, cap);
            if (!in.data) { fputs("fuzz: out of memory\n", stderr); exit(2); }
        }
        memcpy(in.data + in.size, chunk, n);
        in.size += n;
    }
    return in;
}

static unsigned long long rng = 88172645463325252ULL;
static unsigned long long next(void) { /* xorshift64 */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static size_t below(size_t n) { return n ? (size_t)(next() % n) : 0; }

/* Tokens that reach the parsers' corners: escapes, nesting, numbers, .npy header text. */
static const char *TOKENS[] = {"\\", "\\u", "\\u00", "\"", "[", "]", "{", "}", ",", ":", "-", "0", "1e999", "-0.5e-3",
                               "1e", "0x10", "Infinity", "NaN", "nan", "inf", "9223372036854775808", "true", "null",
                               "'shape': (", "'descr': '<f4'", "'descr': '<f8'", "'fortran_order': False", ")", "(",
                               "4294967296, 4294967296, ", "0, ", "\x93NUMPY\x01\x00", "\xff\xff", "\x00"};

/* One random edit of buf (capacity cap) in place; returns the new size. */
static size_t mutate(unsigned char *buf, size_t size, size_t cap) {
    size_t at = below(size + 1), n, k;
    const char *tok;
    switch (next() % 7) {
    case 0: if (size) buf[below(size)] ^= (unsigned char)(1u << below(8)); break;
    case 1: if (size) buf[below(size)] = (unsigned char)next(); break;
    case 2: /* delete a range */
        if (size) { n = 1 + below(size - at < 16 ? size - at : 16); if (at + n > size) n = size - at; memmove(buf + at, buf + at + n, size - at - n); size -= n; }
        break;
    case 3: case 4: /* insert a token */
        tok = TOKENS[below(sizeof TOKENS / sizeof TOKENS[0])];
        n = strlen(tok);
        if (!n) n = 1; /* the NUL token */
        if (size + n <= cap) { memmove(buf + at + n, buf + at, size - at); memcpy(buf + at, tok, n); size += n; }
        break;
    case 5: /* duplicate a range (grows nesting and lists) */
        if (size) { k = below(size); n = 1 + below(64); if (k + n > size) n = size - k;
            if (size + n <= cap) { memmove(buf + at + n, buf + at, size - at); memmove(buf + at, buf + k + (k >= at ? n : 0), n); size += n; } }
        break;
    default: /* truncate */
        size = at;
    }
    return size;
}

static int load_seeds(const char *path, input *seeds, int max) {
    DIR *d = opendir(path);
    struct dirent *e;
    int n = 0;
    if (!d) { FILE *f = fopen(path, "rb"); if (!f) return 0; seeds[0] = read_file(f); fclose(f); return 1; }
    while ((e = readdir(d)) && n < max) {
        char name[4096];
        FILE *f;
        if (e->d_name[0] == '.') continue;
        snprintf(name, sizeof name, "%s/%s", path, e->d_name);
        if ((f = fopen(name, "rb"))) { seeds[n++] = read_file(f); fclose(f); }
    }
    closedir(d);
    return n;
}

int main(int argc, char **argv) {
    static input seeds[4096];
    int nseeds = 0, i;
    long long runs = 0;
#ifdef HAVE_DEATH_CALLBACK
    __sanitizer_set_death_callback(save_current);
#endif
    if (argc >= 3 && !strcmp(argv[1], "-seconds")) {
        double seconds = atof(argv[2]);
        time_t start = time(NULL);
        size_t cap = 1 << 20;
        unsigned char *buf = malloc(cap);
        for (i = 3; i < argc; i++) nseeds += load_seeds(argv[i], seeds + nseeds, 4096 - nseeds);
        if (!nseeds || !buf) { fputs("usage: fuzz_reader -seconds N SEED_DIR... (no seeds found)\n", stderr); return 2; }
        rng ^= (unsigned long long)start;
        while (difftime(time(NULL), start) < seconds) {
            int s;
            for (s = 0; s < 256; s++, runs++) {
                const input *seed = &seeds[below((size_t)nseeds)];
                size_t size = seed->size < cap ? seed->size : cap, m, edits = 1 + below(8);
                memcpy(buf, seed->data, size);
                for (m = 0; m < edits; m++) size = mutate(buf, size, cap);
                current.data = malloc(size ? size : 1); /* exactly sized: an over-read is caught */
                if (!current.data) { fputs("fuzz: out of memory\n", stderr); return 2; }
                memcpy(current.data, buf, size);
                current.size = size;
                LLVMFuzzerTestOneInput(current.data, size);
                free(current.data);
                current.data = NULL;
            }
        }
        free(buf);
        for (i = 0; i < nseeds; i++) free(seeds[i].data);
        printf("fuzz: %lld inputs in %.0f s from %d seeds: no finding\n", runs, seconds, nseeds);
        return 0;
    }
    if (argc < 2) { /* one input on stdin */
        current = read_file(stdin);
        LLVMFuzzerTestOneInput(current.data, current.size);
        free(current.data);
        return 0;
    }
    for (i = 1; i < argc; i++) { /* replay files */
        FILE *f = fopen(argv[i], "rb");
        if (!f) { fprintf(stderr, "fuzz: cannot open %s\n", argv[i]); return 2; }
        current = read_file(f);
        fclose(f);
        LLVMFuzzerTestOneInput(current.data, current.size);
        free(current.data);
        current.data = NULL;
    }
    return 0;
}
#endif
