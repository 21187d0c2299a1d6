/*
 * CUDA driver double: host memory, not a GPU. This is its NVML half.
 *
 * A libnvidia-ml.so.1 for nvidia-ml-py (pynvml CDLLs "libnvidia-ml.so.1" and
 * looks every function up by name) that describes the same devices as the
 * CUDA double: the same count, names and UUIDs, and memory in use counted
 * from the same memfds. Health comes from the control file gpu<N> in
 * UNDERSTUDY_CUDA_DOUBLE_CONTROL (gpu_double.h): each xid=<n> line is one
 * Xid event, delivered once to every event set registered for Xid events
 * before it was written (as NVML delivers only events after registration);
 * ecc_uncorrected/ecc_corrected are the volatile ECC counters,
 * retired_pending=1 a pending page retirement, lost=1 makes every call on
 * the device return GPU_IS_LOST. Faults: UNDERSTUDY_NVML_DOUBLE_FAIL.
 */
#define _GNU_SOURCE
#include "gpu_double.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
typedef struct device *nvmlDevice_t;
typedef struct event_set *nvmlEventSet_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};
#define EVENT_XID 0x8ULL
#define EVENT_DBE 0x2ULL
#define EVENT_SBE 0x1ULL

static const struct gd_code codes[] = {
    {"UNINITIALIZED", NVML_ERROR_UNINITIALIZED},
    {"INVALID_ARGUMENT", NVML_ERROR_INVALID_ARGUMENT},
    {"NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED},
    {"NOT_FOUND", NVML_ERROR_NOT_FOUND},
    {"DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED},
    {"TIMEOUT", NVML_ERROR_TIMEOUT},
    {"GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST},
    {"UNKNOWN", NVML_ERROR_UNKNOWN},
    {NULL, 0},
};

struct device {
    int index;
};

struct event_set {
    int live;
    unsigned long long types[GD_MAX_DEVICES];
    int seen_xid[GD_MAX_DEVICES]; /* xid lines already delivered (or there before) */
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static struct device devices[GD_MAX_DEVICES];
static struct gd_faults faults;

static nvmlReturn_t begin(const char *fn) {
    pthread_mutex_lock(&mu);
    int injected = gd_fault(&faults, "UNDERSTUDY_NVML_DOUBLE_FAIL", codes, fn);
    if (injected)
        return injected;
    return init_count > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

static nvmlReturn_t finish(const char *fn, nvmlReturn_t rc) {
    pthread_mutex_unlock(&mu);
    gd_trace("nvml", fn, rc);
    return rc;
}

#define BEGIN(name)                                                                \
    static const char fn_[] = name;                                                \
    nvmlReturn_t rc = begin(fn_);                                                  \
    if (rc != NVML_SUCCESS)                                                        \
        goto out
#define FAIL(code)                                                                 \
    do {                                                                           \
        rc = (code);                                                               \
        goto out;                                                                  \
    } while (0)
#define END                                                                        \
    out:                                                                           \
    return finish(fn_, rc)

/* A valid handle of a device that is still on the bus. */
static nvmlReturn_t check(nvmlDevice_t dev) {
    if (dev < devices || dev >= devices + gd_device_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    struct gd_control c;
    gd_read_control(dev->index, &c);
    return c.lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

#define CHECK(dev)                                                                 \
    do {                                                                           \
        if ((rc = check(dev)) != NVML_SUCCESS)                                     \
            goto out;                                                              \
    } while (0)

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    static const char fn_[] = "nvmlInit";
    (void)flags;
    pthread_mutex_lock(&mu);
    nvmlReturn_t rc = gd_fault(&faults, "UNDERSTUDY_NVML_DOUBLE_FAIL", codes, fn_);
    if (rc == NVML_SUCCESS) {
        for (int i = 0; i < GD_MAX_DEVICES; i++)
            devices[i].index = i;
        init_count++;
    }
    return finish(fn_, rc);
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    BEGIN("nvmlShutdown");
    init_count--;
    END;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
        return "Not Supported";
    case NVML_ERROR_NOT_FOUND:
        return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED:
        return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT:
        return "Timeout";
    case NVML_ERROR_GPU_IS_LOST:
        return "GPU is lost";
    default:
        return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    BEGIN("nvmlSystemGetDriverVersion");
    if (version == NULL || length < 8)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    snprintf(version, length, "double-0");
    END;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    BEGIN("nvmlDeviceGetCount");
    if (count == NULL)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned)gd_device_count();
    END;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    BEGIN("nvmlDeviceGetHandleByIndex");
    if (device == NULL || index >= (unsigned)gd_device_count())
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(&devices[index]);
    *device = &devices[index];
    END;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    BEGIN("nvmlDeviceGetHandleByUUID");
    if (uuid == NULL || device == NULL)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    char text[96];
    for (int i = 0; i < gd_device_count(); i++) {
        gd_uuid_string(i, text, sizeof text);
        if (strcmp(text, uuid) == 0) {
            CHECK(&devices[i]);
            *device = &devices[i];
            goto out;
        }
    }
    FAIL(NVML_ERROR_NOT_FOUND);
    END;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    BEGIN("nvmlDeviceGetIndex");
    if (index == NULL)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    *index = (unsigned)device->index;
    END;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    BEGIN("nvmlDeviceGetName");
    if (name == NULL || length == 0)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    if (length < sizeof GD_DEVICE_NAME)
        FAIL(NVML_ERROR_INSUFFICIENT_SIZE);
    snprintf(name, length, "%s", GD_DEVICE_NAME);
    END;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    BEGIN("nvmlDeviceGetUUID");
    if (uuid == NULL)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    if (length < 41)
        FAIL(NVML_ERROR_INSUFFICIENT_SIZE);
    gd_uuid_string(device->index, uuid, length);
    END;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    BEGIN("nvmlDeviceGetMemoryInfo");
    if (memory == NULL)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    uint64_t total = gd_device_memory(), used = gd_used_bytes(device->index);
    memory->total = total;
    memory->used = used;
    memory->free = used > total ? 0 : total - used;
    END;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    BEGIN("nvmlDeviceGetMemoryInfo_v2");
    if (memory == NULL)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    uint64_t total = gd_device_memory(), used = gd_used_bytes(device->index);
    memory->total = total;
    memory->reserved = 0;
    memory->used = used;
    memory->free = used > total ? 0 : total - used;
    END;
}

/* errorType: 0 corrected, 1 uncorrected; counterType: 0 volatile, 1 aggregate
 * (the double keeps one counter per type: aggregate == volatile). */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int error_type, int counter_type,
                                         unsigned long long *count) {
    BEGIN("nvmlDeviceGetTotalEccErrors");
    if (count == NULL || (error_type != 0 && error_type != 1) ||
        (counter_type != 0 && counter_type != 1))
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    struct gd_control c;
    gd_read_control(device->index, &c);
    *count = error_type == 1 ? c.ecc_uncorrected : c.ecc_corrected;
    END;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *pending) {
    BEGIN("nvmlDeviceGetRetiredPagesPendingStatus");
    if (pending == NULL)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    struct gd_control c;
    gd_read_control(device->index, &c);
    *pending = c.retired_pending;
    END;
}

/* One retired page per pending retirement, for the double-bit cause. */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause, unsigned int *count,
                                       unsigned long long *addresses) {
    BEGIN("nvmlDeviceGetRetiredPages");
    if (count == NULL || (cause != 0 && cause != 1))
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    struct gd_control c;
    gd_read_control(device->index, &c);
    unsigned have = cause == 1 && c.retired_pending ? 1 : 0;
    if (addresses == NULL || *count < have) {
        *count = have;
        FAIL(have ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS);
    }
    if (have)
        addresses[0] = 0x1000;
    *count = have;
    END;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    BEGIN("nvmlDeviceGetSupportedEventTypes");
    if (types == NULL)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    *types = EVENT_XID | EVENT_DBE | EVENT_SBE;
    END;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    BEGIN("nvmlEventSetCreate");
    if (set == NULL)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    struct event_set *s = calloc(1, sizeof *s);
    if (s == NULL)
        FAIL(NVML_ERROR_UNKNOWN);
    s->live = 1;
    *set = s;
    END;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                      nvmlEventSet_t set) {
    BEGIN("nvmlDeviceRegisterEvents");
    if (set == NULL || !set->live)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    CHECK(device);
    if (types & ~(EVENT_XID | EVENT_DBE | EVENT_SBE))
        FAIL(NVML_ERROR_NOT_SUPPORTED);
    struct gd_control c;
    gd_read_control(device->index, &c);
    set->types[device->index] |= types;
    set->seen_xid[device->index] = c.n_xid; /* only events from now on */
    END;
}

/* Deliver the oldest undelivered Xid of any registered device, or wait for
 * one (polling the control files) until the timeout. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                 unsigned int timeout_ms) {
    static const char fn_[] = "nvmlEventSetWait";
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        nvmlReturn_t rc = begin(fn_);
        if (rc != NVML_SUCCESS)
            return finish(fn_, rc);
        if (set == NULL || !set->live || data == NULL)
            return finish(fn_, NVML_ERROR_INVALID_ARGUMENT);
        for (int d = 0; d < gd_device_count(); d++) {
            if (!(set->types[d] & EVENT_XID))
                continue;
            struct gd_control c;
            gd_read_control(d, &c);
            if (c.lost)
                return finish(fn_, NVML_ERROR_GPU_IS_LOST);
            if (c.n_xid > set->seen_xid[d]) {
                memset(data, 0, sizeof *data);
                data->device = &devices[d];
                data->eventType = EVENT_XID;
                data->eventData = c.xid[set->seen_xid[d]++];
                data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
                return finish(fn_, NVML_SUCCESS);
            }
        }
        pthread_mutex_unlock(&mu);
        clock_gettime(CLOCK_MONOTONIC, &now);
        long elapsed = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (elapsed >= (long)timeout_ms) {
            gd_trace("nvml", fn_, NVML_ERROR_TIMEOUT);
            return NVML_ERROR_TIMEOUT;
        }
        struct timespec nap = {0, 10 * 1000 * 1000};
        nanosleep(&nap, NULL);
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    BEGIN("nvmlEventSetFree");
    if (set == NULL || !set->live)
        FAIL(NVML_ERROR_INVALID_ARGUMENT);
    set->live = 0; /* kept allocated: a stale handle stays detectable */
    END;
}

/* Lets a test tell the double from a driver. */
const char understudy_nvml_double[] = "NVML double: host memory, not a GPU";
