/*
 * CUDA driver double: host memory, not a GPU.
 * The machine model both doubles share (gpu_double.h says what and why).
 */
#define _GNU_SOURCE
#include "gpu_double.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static long env_long(const char *name, long fallback) {
    const char *v = getenv(name);
    if (v == NULL || *v == '\0')
        return fallback;
    char *end;
    long n = strtol(v, &end, 10);
    return *end == '\0' && n >= 0 ? n : fallback;
}

int gd_device_count(void) {
    long n = env_long("UNDERSTUDY_CUDA_DOUBLE_DEVICES", 2);
    return n > GD_MAX_DEVICES ? GD_MAX_DEVICES : (int)n;
}

uint64_t gd_device_memory(void) {
    const char *v = getenv("UNDERSTUDY_CUDA_DOUBLE_MEMORY");
    if (v != NULL && *v != '\0') {
        char *end;
        unsigned long long n = strtoull(v, &end, 10);
        if (*end == '\0' && n > 0)
            return n;
    }
    return (uint64_t)16 << 30;
}

const char *gd_machine(void) {
    const char *v = getenv("UNDERSTUDY_CUDA_DOUBLE_MACHINE");
    return v != NULL && *v != '\0' ? v : "default";
}

/* FNV-1a over the machine name and the device: stable across processes. */
void gd_uuid(int device, unsigned char out[16]) {
    uint64_t h = 1469598103934665603ULL;
    const char *m = gd_machine();
    for (int round = 0; round < 2; round++) {
        for (const char *p = m; *p; p++)
            h = (h ^ (unsigned char)*p) * 1099511628211ULL;
        h = (h ^ (unsigned)device) * 1099511628211ULL;
        h = (h ^ (unsigned)round) * 1099511628211ULL;
        for (int i = 0; i < 8; i++)
            out[round * 8 + i] = (unsigned char)(h >> (8 * i));
    }
}

void gd_uuid_string(int device, char *out, size_t len) {
    unsigned char u[16];
    gd_uuid(device, u);
    snprintf(out, len,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
             u[12], u[13], u[14], u[15]);
}

void gd_name_prefix(int device, char *out, size_t len) {
    snprintf(out, len, "%s:%s:%d:", GD_NAME_PREFIX, gd_machine(), device);
}

/* --- accounting: distinct memfds of a device, anywhere ------------------- */

struct seen {
    unsigned long *inodes;
    size_t n, cap;
};

static int seen_add(struct seen *s, unsigned long ino) {
    for (size_t i = 0; i < s->n; i++)
        if (s->inodes[i] == ino)
            return 0;
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        unsigned long *grown = realloc(s->inodes, cap * sizeof *grown);
        if (grown == NULL)
            return 0;
        s->inodes = grown;
        s->cap = cap;
    }
    s->inodes[s->n++] = ino;
    return 1;
}

/* "/memfd:<prefix><size> (deleted)" -> size, or 0 if not ours. */
static uint64_t our_size(const char *path, const char *prefix) {
    static const char memfd[] = "/memfd:";
    if (strncmp(path, memfd, sizeof memfd - 1) != 0)
        return 0;
    path += sizeof memfd - 1;
    size_t plen = strlen(prefix);
    if (strncmp(path, prefix, plen) != 0)
        return 0;
    return strtoull(path + plen, NULL, 10);
}

uint64_t gd_used_bytes(int device) {
    char prefix[256];
    gd_name_prefix(device, prefix, sizeof prefix);
    struct seen seen = {0};
    uint64_t total = 0;
    DIR *proc = opendir("/proc");
    if (proc == NULL)
        return 0;
    struct dirent *pe;
    char path[1024], link[512];
    while ((pe = readdir(proc)) != NULL) {
        if (pe->d_name[0] < '0' || pe->d_name[0] > '9')
            continue;
        snprintf(path, sizeof path, "/proc/%s/fd", pe->d_name);
        DIR *fds = opendir(path);
        if (fds != NULL) {
            struct dirent *fe;
            while ((fe = readdir(fds)) != NULL) {
                if (fe->d_name[0] == '.')
                    continue;
                snprintf(path, sizeof path, "/proc/%s/fd/%s", pe->d_name, fe->d_name);
                ssize_t n = readlink(path, link, sizeof link - 1);
                if (n <= 0)
                    continue;
                link[n] = '\0';
                uint64_t size = our_size(link, prefix);
                struct stat st;
                if (size && stat(path, &st) == 0 && seen_add(&seen, st.st_ino))
                    total += size;
            }
            closedir(fds);
        }
        snprintf(path, sizeof path, "/proc/%s/maps", pe->d_name);
        FILE *maps = fopen(path, "re");
        if (maps == NULL)
            continue;
        char line[1024];
        while (fgets(line, sizeof line, maps) != NULL) {
            char *name = strstr(line, "/memfd:");
            if (name == NULL)
                continue;
            unsigned long ino = 0;
            /* start-end perms offset dev inode path */
            if (sscanf(line, "%*s %*s %*s %*s %lu", &ino) != 1)
                continue;
            uint64_t size = our_size(name, prefix);
            if (size && seen_add(&seen, ino))
                total += size;
        }
        fclose(maps);
    }
    closedir(proc);
    free(seen.inodes);
    return total;
}

/* --- runtime control ------------------------------------------------------ */

void gd_read_control(int device, struct gd_control *out) {
    memset(out, 0, sizeof *out);
    const char *dir = getenv("UNDERSTUDY_CUDA_DOUBLE_CONTROL");
    if (dir == NULL || *dir == '\0')
        return;
    char path[512];
    snprintf(path, sizeof path, "%s/gpu%d", dir, device);
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return;
    char line[256];
    while (fgets(line, sizeof line, f) != NULL) {
        unsigned long long v;
        if (sscanf(line, "xid=%llu", &v) == 1) {
            if (out->n_xid < (int)(sizeof out->xid / sizeof out->xid[0]))
                out->xid[out->n_xid++] = (unsigned)v;
        } else if (sscanf(line, "ecc_uncorrected=%llu", &v) == 1) {
            out->ecc_uncorrected = v;
        } else if (sscanf(line, "ecc_corrected=%llu", &v) == 1) {
            out->ecc_corrected = v;
        } else if (sscanf(line, "retired_pending=%llu", &v) == 1) {
            out->retired_pending = v != 0;
        } else if (sscanf(line, "lost=%llu", &v) == 1) {
            out->lost = v != 0;
        }
    }
    fclose(f);
}

/* --- fault injection -------------------------------------------------------- */

static void parse_faults(struct gd_faults *faults, const char *env,
                         const struct gd_code *codes) {
    faults->parsed = 1;
    const char *spec = getenv(env);
    if (spec == NULL)
        return;
    char buf[2048];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item != NULL;
         item = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(item, ':');
        if (colon == NULL || faults->n == (int)(sizeof faults->rules / sizeof faults->rules[0])) {
            fprintf(stderr, "%s: ignoring rule %s\n", env, item);
            continue;
        }
        *colon = '\0';
        char *err = colon + 1;
        unsigned long from = 1;
        int only = 0;
        char *at = strpbrk(err, "@#");
        if (at != NULL) {
            only = *at == '#';
            *at = '\0';
            from = strtoul(at + 1, NULL, 10);
            if (from == 0)
                from = 1;
        }
        int code = -1;
        for (const struct gd_code *c = codes; c->name != NULL; c++)
            if (strcmp(c->name, err) == 0)
                code = c->code;
        if (code < 0) {
            char *end;
            long n = strtol(err, &end, 10);
            if (*end == '\0' && n > 0)
                code = (int)n;
        }
        if (code <= 0) {
            fprintf(stderr, "%s: unknown error %s in rule for %s\n", env, err, item);
            continue;
        }
        struct gd_rule *r = &faults->rules[faults->n++];
        snprintf(r->fn, sizeof r->fn, "%s", item);
        r->code = code;
        r->from_call = from;
        r->only = only;
        r->calls = 0;
    }
}

int gd_fault(struct gd_faults *faults, const char *env, const struct gd_code *codes,
             const char *fn) {
    if (!faults->parsed)
        parse_faults(faults, env, codes);
    for (int i = 0; i < faults->n; i++) {
        struct gd_rule *r = &faults->rules[i];
        if (strcmp(r->fn, fn) != 0)
            continue;
        r->calls++;
        if (r->only)
            return r->calls == r->from_call ? r->code : 0;
        return r->calls >= r->from_call ? r->code : 0;
    }
    return 0;
}

void gd_trace(const char *lib, const char *fn, int result) {
    static int enabled = -1;
    if (enabled < 0)
        enabled = env_long("UNDERSTUDY_CUDA_DOUBLE_TRACE", 0) != 0;
    if (enabled)
        fprintf(stderr, "%s double pid=%d %s -> %d\n", lib, (int)getpid(), fn, result);
}
