/*
 * CUDA driver double: host memory, not a GPU.
 *
 * A libcuda.so.1 that implements the driver calls Understudy's cuda backend
 * makes (gms/src/understudy/gms/backends/cuda_vmm.py) and the test helpers
 * use, with the semantics of CUDA's virtual memory management as we model
 * it over host memory:
 *
 *   cuMemCreate            a memfd of the (granularity-aligned) size, named
 *                          understudy-cuda-double:<machine>:<device>:<size>;
 *                          fails with OUT_OF_MEMORY past the device's memory,
 *                          counted across every process (gpu_double.c)
 *   cuMemExportToShareableHandle   POSIX fd: a dup of the memfd
 *   cuMemImportFromShareableHandle a new handle over a dup of that fd (the
 *                          caller keeps its fd); a foreign fd is refused
 *   cuMemAddressReserve    PROT_NONE address space, aligned
 *   cuMemMap               the memfd MAP_FIXED into the reservation, with no
 *                          host access (PROT_NONE: dereferencing a device
 *                          pointer on the host faults, as on a GPU), plus a
 *                          private "device-side" view the copies go through
 *   cuMemSetAccess         per-device access flags, checked by the copies
 *   cuMemUnmap             back to a PROT_NONE reservation (same address
 *                          can be mapped again)
 *   cuMemRelease / cuMemAddressFree   give the handle / the range back
 *
 * Reference counting is the kernel's: memory lives while any process holds
 * a handle (an fd) or a mapping, and goes with the last of them, including
 * after kill -9. Contexts: one primary context per device, retained and
 * released with a count, current per thread. Copies and cuMemGetInfo need a
 * current context; the VMM calls do not (UNDERSTUDY_CUDA_DOUBLE_CONTEXT_REQUIRED
 * lists calls that should). Faults: UNDERSTUDY_CUDA_DOUBLE_FAIL (gpu_double.h).
 *
 * Error codes: the driver's documented ones. Where its documentation names
 * none, the double's choice: a map over an already mapped range, an address
 * free of a range still mapped, an unmap or access change that is not whole
 * mappings, a copy touching unmapped memory, the import of an fd that is not
 * this machine's device memory: CUDA_ERROR_INVALID_VALUE; a copy without the
 * access it needs: CUDA_ERROR_ILLEGAL_ADDRESS (not sticky, unlike a GPU's
 * fault); a device attribute the double does not model: INVALID_VALUE
 * rather than an invented value.
 *
 * Not modeled: kernels, streams, events, sticky errors, peer mappings of
 * another device's memory, partial unmaps, handle types other than POSIX fds.
 * It proves our calls against this model of the driver, not against the driver.
 *
 * cuda-python 13 dlopens "libcuda.so.1", takes cuGetProcAddress_v2 by dlsym
 * and resolves every other entry point through it, with the CUDA version
 * that picks an ABI (e.g. cuMemcpyHtoD at 3020 is the 64-bit _v2 one); the
 * table below answers with the ABI implemented here.
 */
#define _GNU_SOURCE
#include "gpu_double.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct ctx *CUcontext;
typedef struct {
    char bytes[16];
} CUuuid;
typedef struct {
    int type;
    int id;
} CUmemLocation;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_ECC_UNCORRECTABLE = 214,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

enum { HANDLE_TYPE_POSIX_FD = 1, ALLOCATION_TYPE_PINNED = 1, LOCATION_TYPE_DEVICE = 1 };
enum { ACCESS_NONE = 0, ACCESS_READ = 1, ACCESS_READWRITE = 3 };

static const struct gd_code codes[] = {
    {"INVALID_VALUE", CUDA_ERROR_INVALID_VALUE},
    {"OUT_OF_MEMORY", CUDA_ERROR_OUT_OF_MEMORY},
    {"NOT_INITIALIZED", CUDA_ERROR_NOT_INITIALIZED},
    {"DEINITIALIZED", CUDA_ERROR_DEINITIALIZED},
    {"NO_DEVICE", CUDA_ERROR_NO_DEVICE},
    {"INVALID_DEVICE", CUDA_ERROR_INVALID_DEVICE},
    {"INVALID_CONTEXT", CUDA_ERROR_INVALID_CONTEXT},
    {"ECC_UNCORRECTABLE", CUDA_ERROR_ECC_UNCORRECTABLE},
    {"OPERATING_SYSTEM", CUDA_ERROR_OPERATING_SYSTEM},
    {"INVALID_HANDLE", CUDA_ERROR_INVALID_HANDLE},
    {"NOT_FOUND", CUDA_ERROR_NOT_FOUND},
    {"ILLEGAL_ADDRESS", CUDA_ERROR_ILLEGAL_ADDRESS},
    {"NOT_PERMITTED", CUDA_ERROR_NOT_PERMITTED},
    {"NOT_SUPPORTED", CUDA_ERROR_NOT_SUPPORTED},
    {"UNKNOWN", CUDA_ERROR_UNKNOWN},
    {NULL, 0},
};

static const struct {
    int code;
    const char *name;
    const char *text;
} messages[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_ECC_UNCORRECTABLE, "CUDA_ERROR_ECC_UNCORRECTABLE",
     "uncorrectable ECC error encountered"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

/* --- process state ------------------------------------------------------------ */

struct ctx {
    int device;
    int refcount;
};

struct handle {
    uint64_t id;
    int fd;
    size_t size;
    int device;
    int types;
};

struct reservation {
    uintptr_t base;
    size_t size;
};

struct mapping {
    uintptr_t va;
    size_t size;
    int device;
    void *view; /* the "device-side" view the copies use */
    unsigned char access[GD_MAX_DEVICES];
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static struct ctx primary[GD_MAX_DEVICES];
static __thread struct ctx *current;
static uint64_t next_handle = 0x5ca1ab1e0001ULL;
static struct handle *handles;
static size_t n_handles, cap_handles;
static struct reservation *reservations;
static size_t n_res, cap_res;
static struct mapping *mappings;
static size_t n_maps, cap_maps;
static struct gd_faults faults;

#define GROW(arr, n, cap)                                                          \
    do {                                                                           \
        if ((n) == (cap)) {                                                        \
            size_t c_ = (cap) ? (cap) * 2 : 16;                                    \
            void *g_ = realloc((arr), c_ * sizeof *(arr));                         \
            if (g_ == NULL) {                                                      \
                rc = CUDA_ERROR_OUT_OF_MEMORY;                                     \
                goto out;                                                          \
            }                                                                      \
            (arr) = g_;                                                            \
            (cap) = c_;                                                            \
        }                                                                          \
    } while (0)

static int listed(const char *env, const char *fn) {
    const char *v = getenv(env);
    if (v == NULL)
        return 0;
    size_t len = strlen(fn);
    for (const char *p = v; (p = strstr(p, fn)) != NULL; p += len)
        if ((p == v || p[-1] == ',') && (p[len] == '\0' || p[len] == ','))
            return 1;
    return 0;
}

static int context_ok(void) { return current != NULL && current->refcount > 0; }

/* Lock, then refuse before cuInit, inject a fault, demand a context if told. */
static CUresult begin(const char *fn, int need_init) {
    pthread_mutex_lock(&mu);
    if (need_init && !initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    int injected = gd_fault(&faults, "UNDERSTUDY_CUDA_DOUBLE_FAIL", codes, fn);
    if (injected)
        return injected;
    if (listed("UNDERSTUDY_CUDA_DOUBLE_CONTEXT_REQUIRED", fn) && !context_ok())
        return CUDA_ERROR_INVALID_CONTEXT;
    return CUDA_SUCCESS;
}

static CUresult finish(const char *fn, CUresult rc) {
    pthread_mutex_unlock(&mu);
    gd_trace("cuda", fn, rc);
    return rc;
}

#define BEGIN(name, need_init)                                                     \
    static const char fn_[] = name;                                                \
    CUresult rc = begin(fn_, need_init);                                           \
    if (rc != CUDA_SUCCESS)                                                        \
        goto out
#define FAIL(code)                                                                 \
    do {                                                                           \
        rc = (code);                                                               \
        goto out;                                                                  \
    } while (0)
#define END                                                                        \
    out:                                                                           \
    return finish(fn_, rc)

static int valid_device(CUdevice dev) { return dev >= 0 && dev < gd_device_count(); }

static struct handle *find_handle(uint64_t id) {
    for (size_t i = 0; i < n_handles; i++)
        if (handles[i].id == id)
            return &handles[i];
    return NULL;
}

static struct reservation *find_reservation(uintptr_t p, size_t size) {
    for (size_t i = 0; i < n_res; i++)
        if (p >= reservations[i].base && size <= reservations[i].size &&
            p - reservations[i].base <= reservations[i].size - size)
            return &reservations[i];
    return NULL;
}

static struct mapping *find_mapping(uintptr_t p) {
    for (size_t i = 0; i < n_maps; i++)
        if (p >= mappings[i].va && p - mappings[i].va < mappings[i].size)
            return &mappings[i];
    return NULL;
}

static int overlaps_mapping(uintptr_t p, size_t size) {
    for (size_t i = 0; i < n_maps; i++)
        if (p < mappings[i].va + mappings[i].size && mappings[i].va < p + size)
            return 1;
    return 0;
}

/* The mappings [p, p+size) consists of, whole and contiguous; -1 if it does not. */
static long whole_mappings(uintptr_t p, size_t size, size_t *idx, size_t max) {
    long n = 0;
    uintptr_t at = p;
    while (at < p + size) {
        struct mapping *m = find_mapping(at);
        if (m == NULL || m->va != at || m->size > p + size - at || (size_t)n == max)
            return -1;
        idx[n++] = (size_t)(m - mappings);
        at += m->size;
    }
    return n;
}

static CUresult check_prop(const CUmemAllocationProp *prop) {
    if (prop == NULL || prop->type != ALLOCATION_TYPE_PINNED ||
        prop->location.type != LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_device(prop->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    if (prop->requestedHandleTypes & ~HANDLE_TYPE_POSIX_FD)
        return CUDA_ERROR_NOT_SUPPORTED;
    return CUDA_SUCCESS;
}

/* --- errors, init, devices ---------------------------------------------------- */

CUresult cuGetErrorString(CUresult error, const char **str) {
    for (size_t i = 0; i < sizeof messages / sizeof messages[0]; i++)
        if (messages[i].code == error) {
            *str = messages[i].text;
            return CUDA_SUCCESS;
        }
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult error, const char **str) {
    for (size_t i = 0; i < sizeof messages / sizeof messages[0]; i++)
        if (messages[i].code == error) {
            *str = messages[i].name;
            return CUDA_SUCCESS;
        }
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuInit(unsigned int flags) {
    BEGIN("cuInit", 0);
    if (flags != 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (gd_device_count() == 0)
        FAIL(CUDA_ERROR_NO_DEVICE);
    for (int d = 0; d < GD_MAX_DEVICES; d++)
        primary[d].device = d;
    initialized = 1;
    END;
}

CUresult cuDriverGetVersion(int *version) {
    BEGIN("cuDriverGetVersion", 0);
    if (version == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    *version = 13000;
    END;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    BEGIN("cuDeviceGet", 1);
    if (dev == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(ordinal))
        FAIL(CUDA_ERROR_INVALID_DEVICE);
    *dev = ordinal;
    END;
}

CUresult cuDeviceGetCount(int *count) {
    BEGIN("cuDeviceGetCount", 1);
    if (count == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    *count = gd_device_count();
    END;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    BEGIN("cuDeviceGetName", 1);
    if (name == NULL || len <= 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(dev))
        FAIL(CUDA_ERROR_INVALID_DEVICE);
    snprintf(name, (size_t)len, "%s", GD_DEVICE_NAME);
    END;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    BEGIN("cuDeviceGetUuid", 1);
    if (uuid == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(dev))
        FAIL(CUDA_ERROR_INVALID_DEVICE);
    gd_uuid(dev, (unsigned char *)uuid->bytes);
    END;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    BEGIN("cuDeviceTotalMem", 1);
    if (bytes == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(dev))
        FAIL(CUDA_ERROR_INVALID_DEVICE);
    *bytes = (size_t)gd_device_memory();
    END;
}

CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev) {
    BEGIN("cuDeviceGetAttribute", 1);
    if (value == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(dev))
        FAIL(CUDA_ERROR_INVALID_DEVICE);
    switch (attrib) {
    case 33: /* PCI_BUS_ID */
        *value = dev;
        break;
    case 34: /* PCI_DEVICE_ID */
    case 50: /* PCI_DOMAIN_ID */
        *value = 0;
        break;
    case 41: /* UNIFIED_ADDRESSING */
    case 102: /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
        *value = 1;
        break;
    case 75: /* COMPUTE_CAPABILITY_MAJOR */
        *value = 9;
        break;
    case 76: /* COMPUTE_CAPABILITY_MINOR */
        *value = 0;
        break;
    default: /* not modeled: say so rather than invent a value */
        FAIL(CUDA_ERROR_INVALID_VALUE);
    }
    END;
}

/* --- contexts ----------------------------------------------------------------------- */

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    BEGIN("cuDevicePrimaryCtxRetain", 1);
    if (pctx == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(dev))
        FAIL(CUDA_ERROR_INVALID_DEVICE);
    primary[dev].refcount++;
    *pctx = &primary[dev];
    END;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    BEGIN("cuDevicePrimaryCtxRelease", 1);
    if (!valid_device(dev))
        FAIL(CUDA_ERROR_INVALID_DEVICE);
    if (primary[dev].refcount == 0)
        FAIL(CUDA_ERROR_INVALID_CONTEXT);
    primary[dev].refcount--;
    END;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    BEGIN("cuDevicePrimaryCtxGetState", 1);
    if (flags == NULL || active == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!valid_device(dev))
        FAIL(CUDA_ERROR_INVALID_DEVICE);
    *flags = 0;
    *active = primary[dev].refcount > 0;
    END;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    BEGIN("cuCtxSetCurrent", 1);
    if (ctx != NULL && (ctx < primary || ctx >= primary + GD_MAX_DEVICES ||
                        !valid_device(ctx->device) || ctx->refcount == 0))
        FAIL(CUDA_ERROR_INVALID_CONTEXT);
    current = ctx;
    END;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    BEGIN("cuCtxGetCurrent", 1);
    if (pctx == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    *pctx = current;
    END;
}

CUresult cuCtxGetDevice(CUdevice *dev) {
    BEGIN("cuCtxGetDevice", 1);
    if (dev == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!context_ok())
        FAIL(CUDA_ERROR_INVALID_CONTEXT);
    *dev = current->device;
    END;
}

CUresult cuCtxSynchronize(void) {
    BEGIN("cuCtxSynchronize", 1);
    if (!context_ok())
        FAIL(CUDA_ERROR_INVALID_CONTEXT);
    END;
}

/* --- physical memory ------------------------------------------------------------------ */

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       int option) {
    BEGIN("cuMemGetAllocationGranularity", 1);
    if (granularity == NULL || (option != 0 && option != 1))
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if ((rc = check_prop(prop)) != CUDA_SUCCESS)
        goto out;
    *granularity = GD_GRANULARITY;
    END;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *out_handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
    BEGIN("cuMemCreate", 1);
    if (out_handle == NULL || size == 0 || size % GD_GRANULARITY != 0 || flags != 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if ((rc = check_prop(prop)) != CUDA_SUCCESS)
        goto out;
    int dev = prop->location.id;
    uint64_t total = gd_device_memory();
    if (size > total || gd_used_bytes(dev) > total - size)
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    GROW(handles, n_handles, cap_handles);
    char name[256];
    gd_name_prefix(dev, name, sizeof name);
    snprintf(name + strlen(name), sizeof name - strlen(name), "%zu", size);
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        FAIL(errno == EMFILE || errno == ENFILE ? CUDA_ERROR_OPERATING_SYSTEM
                                                : CUDA_ERROR_OUT_OF_MEMORY);
    if (ftruncate(fd, (off_t)size) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
        close(fd);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    struct handle *h = &handles[n_handles++];
    h->id = next_handle++;
    h->fd = fd;
    h->size = size;
    h->device = dev;
    h->types = prop->requestedHandleTypes;
    *out_handle = h->id;
    END;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    BEGIN("cuMemRelease", 1);
    struct handle *h = find_handle(handle);
    if (h == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    close(h->fd);
    *h = handles[--n_handles];
    END;
}

CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle,
                                      int type, unsigned long long flags) {
    BEGIN("cuMemExportToShareableHandle", 1);
    struct handle *h = find_handle(handle);
    if (shareable == NULL || h == NULL || flags != 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (type != HANDLE_TYPE_POSIX_FD || !(h->types & HANDLE_TYPE_POSIX_FD))
        FAIL(CUDA_ERROR_INVALID_VALUE);
    int fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        FAIL(CUDA_ERROR_OPERATING_SYSTEM);
    *(int *)shareable = fd;
    END;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *out_handle,
                                        void *os_handle, int type) {
    BEGIN("cuMemImportFromShareableHandle", 1);
    if (out_handle == NULL || type != HANDLE_TYPE_POSIX_FD)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    int theirs = (int)(intptr_t)os_handle;
    char path[64], link[512];
    snprintf(path, sizeof path, "/proc/self/fd/%d", theirs);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n <= 0)
        FAIL(CUDA_ERROR_INVALID_VALUE); /* not an open fd */
    link[n] = '\0';
    /* "/memfd:understudy-cuda-double:<machine>:<device>:<size> (deleted)" */
    char prefix[256];
    int dev = -1;
    for (int d = 0; d < gd_device_count(); d++) {
        gd_name_prefix(d, prefix, sizeof prefix);
        if (strncmp(link, "/memfd:", 7) == 0 && strncmp(link + 7, prefix, strlen(prefix)) == 0)
            dev = d;
    }
    struct stat st;
    if (dev < 0 || fstat(theirs, &st) != 0 || st.st_size <= 0)
        FAIL(CUDA_ERROR_INVALID_VALUE); /* not memory of this machine's devices */
    GROW(handles, n_handles, cap_handles);
    int fd = fcntl(theirs, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        FAIL(CUDA_ERROR_OPERATING_SYSTEM);
    struct handle *h = &handles[n_handles++];
    h->id = next_handle++;
    h->fd = fd;
    h->size = (size_t)st.st_size;
    h->device = dev;
    h->types = HANDLE_TYPE_POSIX_FD;
    *out_handle = h->id;
    END;
}

/* --- virtual memory --------------------------------------------------------------------- */

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    BEGIN("cuMemAddressReserve", 1);
    if (ptr == NULL || size == 0 || size % GD_GRANULARITY != 0 || flags != 0 ||
        (alignment & (alignment - 1)) != 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    GROW(reservations, n_res, cap_res);
    size_t align = alignment > GD_GRANULARITY ? alignment : GD_GRANULARITY;
    int mflags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    void *got = MAP_FAILED;
    if (addr != 0 && addr % align == 0) { /* a hint, as for the driver */
        got = mmap((void *)(uintptr_t)addr, size, PROT_NONE, mflags | MAP_FIXED_NOREPLACE, -1, 0);
        if (got != MAP_FAILED && (uintptr_t)got != addr) {
            munmap(got, size);
            got = MAP_FAILED;
        }
    }
    if (got == MAP_FAILED) {
        void *raw = mmap(NULL, size + align, PROT_NONE, mflags, -1, 0);
        if (raw == MAP_FAILED)
            FAIL(CUDA_ERROR_OUT_OF_MEMORY);
        uintptr_t base = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
        if (base > (uintptr_t)raw)
            munmap(raw, base - (uintptr_t)raw);
        uintptr_t end = (uintptr_t)raw + size + align;
        if (end > base + size)
            munmap((void *)(base + size), end - (base + size));
        got = (void *)base;
    }
    reservations[n_res].base = (uintptr_t)got;
    reservations[n_res].size = size;
    n_res++;
    *ptr = (CUdeviceptr)(uintptr_t)got;
    END;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    BEGIN("cuMemAddressFree", 1);
    size_t i;
    for (i = 0; i < n_res; i++)
        if (reservations[i].base == ptr && reservations[i].size == size)
            break;
    if (i == n_res || overlaps_mapping((uintptr_t)ptr, size))
        FAIL(CUDA_ERROR_INVALID_VALUE);
    munmap((void *)(uintptr_t)ptr, size);
    reservations[i] = reservations[--n_res];
    END;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                  CUmemGenericAllocationHandle handle, unsigned long long flags) {
    BEGIN("cuMemMap", 1);
    struct handle *h = find_handle(handle);
    uintptr_t p = (uintptr_t)ptr;
    if (h == NULL || flags != 0 || size == 0 || p % GD_GRANULARITY != 0 ||
        size % GD_GRANULARITY != 0 || offset % GD_GRANULARITY != 0 || offset > h->size ||
        size > h->size - offset)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (find_reservation(p, size) == NULL || overlaps_mapping(p, size))
        FAIL(CUDA_ERROR_INVALID_VALUE);
    GROW(mappings, n_maps, cap_maps);
    void *view = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, h->fd, (off_t)offset);
    if (view == MAP_FAILED)
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    /* The range itself: the memory, with no host access. */
    if (mmap((void *)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset) ==
        MAP_FAILED) {
        munmap(view, size);
        mmap((void *)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
             -1, 0);
        FAIL(CUDA_ERROR_OUT_OF_MEMORY);
    }
    struct mapping *m = &mappings[n_maps++];
    memset(m, 0, sizeof *m);
    m->va = p;
    m->size = size;
    m->device = h->device;
    m->view = view;
    END;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    BEGIN("cuMemUnmap", 1);
    size_t idx[256];
    long n = size ? whole_mappings((uintptr_t)ptr, size, idx, 256) : -1;
    if (n <= 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    uintptr_t vas[256]; /* by address: removing one moves the last into its slot */
    for (long k = 0; k < n; k++)
        vas[k] = mappings[idx[k]].va;
    for (long k = 0; k < n; k++) {
        struct mapping *m = find_mapping(vas[k]);
        mmap((void *)m->va, m->size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        munmap(m->view, m->size);
        *m = mappings[--n_maps];
    }
    END;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                        size_t count) {
    BEGIN("cuMemSetAccess", 1);
    if (desc == NULL || count == 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    for (size_t d = 0; d < count; d++) {
        int f = desc[d].flags;
        if (desc[d].location.type != LOCATION_TYPE_DEVICE ||
            (f != ACCESS_NONE && f != ACCESS_READ && f != ACCESS_READWRITE))
            FAIL(CUDA_ERROR_INVALID_VALUE);
        if (!valid_device(desc[d].location.id))
            FAIL(CUDA_ERROR_INVALID_DEVICE);
    }
    size_t idx[256];
    long n = size ? whole_mappings((uintptr_t)ptr, size, idx, 256) : -1;
    if (n <= 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    for (long k = 0; k < n; k++)
        for (size_t d = 0; d < count; d++)
            mappings[idx[k]].access[desc[d].location.id] = (unsigned char)desc[d].flags;
    END;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    BEGIN("cuMemGetInfo", 1);
    if (free_bytes == NULL || total_bytes == NULL)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    if (!context_ok())
        FAIL(CUDA_ERROR_INVALID_CONTEXT);
    uint64_t total = gd_device_memory(), used = gd_used_bytes(current->device);
    *total_bytes = (size_t)total;
    *free_bytes = (size_t)(used > total ? 0 : total - used);
    END;
}

/* Copy between host memory and [p, p+n) through the mappings' device-side views. */
static CUresult copy(uintptr_t p, void *host, size_t n, int to_device) {
    if (!context_ok())
        return CUDA_ERROR_INVALID_CONTEXT;
    int dev = current->device;
    int need = to_device ? ACCESS_READWRITE : ACCESS_READ;
    for (uintptr_t at = p; at < p + n;) { /* check the whole range first */
        struct mapping *m = find_mapping(at);
        if (m == NULL)
            return CUDA_ERROR_INVALID_VALUE;
        if ((m->access[dev] & need) != need)
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        at = m->va + m->size;
    }
    unsigned char *h = host;
    for (uintptr_t at = p; at < p + n;) {
        struct mapping *m = find_mapping(at);
        size_t chunk = m->va + m->size - at;
        if (chunk > p + n - at)
            chunk = p + n - at;
        unsigned char *d = (unsigned char *)m->view + (at - m->va);
        if (to_device)
            memcpy(d, h, chunk);
        else
            memcpy(h, d, chunk);
        h += chunk;
        at += chunk;
    }
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    BEGIN("cuMemcpyHtoD", 1);
    if (src == NULL && n > 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    rc = copy((uintptr_t)dst, (void *)src, n, 1);
    END;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    BEGIN("cuMemcpyDtoH", 1);
    if (dst == NULL && n > 0)
        FAIL(CUDA_ERROR_INVALID_VALUE);
    rc = copy((uintptr_t)src, dst, n, 0);
    END;
}

/* The unversioned names, for a caller that dlsyms them directly. */
CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev) __attribute__((alias("cuDeviceTotalMem_v2")));
CUresult cuDevicePrimaryCtxRelease(CUdevice dev) __attribute__((alias("cuDevicePrimaryCtxRelease_v2")));
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) __attribute__((alias("cuDeviceGetUuid")));
CUresult cuMemGetInfo(size_t *f, size_t *t) __attribute__((alias("cuMemGetInfo_v2")));
CUresult cuMemcpyHtoD(CUdeviceptr d, const void *s, size_t n) __attribute__((alias("cuMemcpyHtoD_v2")));
CUresult cuMemcpyDtoH(void *d, CUdeviceptr s, size_t n) __attribute__((alias("cuMemcpyDtoH_v2")));

/* --- entry points ------------------------------------------------------------------------ */

static const struct {
    const char *name;
    void *fn;
    int since; /* the CUDA version whose ABI this implements; older asks get NOT_FOUND */
} table[] = {
    {"cuGetErrorString", (void *)cuGetErrorString, 0},
    {"cuGetErrorName", (void *)cuGetErrorName, 0},
    {"cuInit", (void *)cuInit, 0},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion, 0},
    {"cuDeviceGet", (void *)cuDeviceGet, 0},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount, 0},
    {"cuDeviceGetName", (void *)cuDeviceGetName, 0},
    {"cuDeviceGetUuid", (void *)cuDeviceGetUuid, 0},
    {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2, 3020},
    {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute, 0},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain, 0},
    {"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease_v2, 11000},
    {"cuDevicePrimaryCtxGetState", (void *)cuDevicePrimaryCtxGetState, 0},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent, 0},
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent, 0},
    {"cuCtxGetDevice", (void *)cuCtxGetDevice, 0},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize, 0},
    {"cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity, 0},
    {"cuMemCreate", (void *)cuMemCreate, 0},
    {"cuMemRelease", (void *)cuMemRelease, 0},
    {"cuMemExportToShareableHandle", (void *)cuMemExportToShareableHandle, 0},
    {"cuMemImportFromShareableHandle", (void *)cuMemImportFromShareableHandle, 0},
    {"cuMemAddressReserve", (void *)cuMemAddressReserve, 0},
    {"cuMemAddressFree", (void *)cuMemAddressFree, 0},
    {"cuMemMap", (void *)cuMemMap, 0},
    {"cuMemUnmap", (void *)cuMemUnmap, 0},
    {"cuMemSetAccess", (void *)cuMemSetAccess, 0},
    {"cuMemGetInfo", (void *)cuMemGetInfo_v2, 3020},
    {"cuMemcpyHtoD", (void *)cuMemcpyHtoD_v2, 3020},
    {"cuMemcpyDtoH", (void *)cuMemcpyDtoH_v2, 3020},
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
                             unsigned long long flags, int *status) {
    (void)flags;
    if (symbol == NULL || pfn == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(table[i].name, symbol) != 0)
            continue;
        if (cuda_version < table[i].since) {
            *pfn = NULL;
            if (status)
                *status = 2; /* CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT */
            return CUDA_ERROR_NOT_FOUND;
        }
        *pfn = table[i].fn;
        if (status)
            *status = 0; /* CU_GET_PROC_ADDRESS_SUCCESS */
        return CUDA_SUCCESS;
    }
    *pfn = NULL;
    if (status)
        *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
                          unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, NULL);
}

/* Lets a test tell the double from a driver: dlsym(handle, "understudy_cuda_double"). */
const char understudy_cuda_double[] = "CUDA driver double: host memory, not a GPU";
