/*
 * CUDA driver double: host memory, not a GPU.
 *
 * What libcuda.so.1 and libnvidia-ml.so.1 of the double share: the model of
 * the "machine" (how many devices, their names, UUIDs and memory), the
 * accounting of device memory across processes, the runtime control files
 * (Xid events, ECC counters) and the fault-injection parser.
 *
 * Every allocation of the double is a memfd named
 *     understudy-cuda-double:<machine>:<device>:<size>
 * so the kernel does the cross-process reference counting (an allocation
 * lives while any process holds an fd to it or maps it), and the memory in
 * use on a device is the sum over the distinct memfds of that name found in
 * /proc/<pid>/fd and /proc/<pid>/maps: the truth, also after kill -9.
 *
 * Environment (read when a library first needs it):
 *   UNDERSTUDY_CUDA_DOUBLE_DEVICES   number of devices (default 2; 0: none)
 *   UNDERSTUDY_CUDA_DOUBLE_MEMORY    bytes per device (default 16 GiB)
 *   UNDERSTUDY_CUDA_DOUBLE_MACHINE   names this "machine": processes with the
 *                                    same value see the same devices and
 *                                    memory accounting (default "default")
 *   UNDERSTUDY_CUDA_DOUBLE_CONTROL   a directory; file gpu<N> in it holds
 *                                    runtime faults, one key=value a line:
 *                                    xid=<n> (one Xid event per line, in
 *                                    order), ecc_uncorrected=<n>,
 *                                    ecc_corrected=<n>, retired_pending=1,
 *                                    lost=1 (the GPU fell off the bus)
 *   UNDERSTUDY_CUDA_DOUBLE_FAIL      CUDA calls that fail, e.g.
 *                                    cuMemCreate:OUT_OF_MEMORY@3,cuMemMap:OUT_OF_MEMORY
 *                                    (name:ERROR[@N]: fails from the N-th
 *                                    call of this process on, default 1;
 *                                    name:ERROR#N fails the N-th call only)
 *   UNDERSTUDY_NVML_DOUBLE_FAIL      the same for NVML calls
 *                                    (nvmlInit:DRIVER_NOT_LOADED)
 *   UNDERSTUDY_CUDA_DOUBLE_TRACE     1: one stderr line per call
 */
#ifndef UNDERSTUDY_GPU_DOUBLE_H
#define UNDERSTUDY_GPU_DOUBLE_H

#include <stddef.h>
#include <stdint.h>

#define GD_MAX_DEVICES 16
#define GD_NAME_PREFIX "understudy-cuda-double"
#define GD_DEVICE_NAME "Understudy CUDA driver double (host memory, not a GPU)"
#define GD_GRANULARITY ((size_t)2 << 20)

int gd_device_count(void);
uint64_t gd_device_memory(void);
const char *gd_machine(void);
void gd_uuid(int device, unsigned char out[16]);
void gd_uuid_string(int device, char *out, size_t len); /* GPU-xxxxxxxx-... */

/* Bytes of memfd allocations of `device` alive anywhere (any process). */
uint64_t gd_used_bytes(int device);

/* "understudy-cuda-double:<machine>:<device>:" for this machine. */
void gd_name_prefix(int device, char *out, size_t len);

/* Runtime control: gpu<device> in UNDERSTUDY_CUDA_DOUBLE_CONTROL. */
struct gd_control {
    uint64_t ecc_uncorrected;
    uint64_t ecc_corrected;
    int retired_pending;
    int lost;
    int n_xid;
    unsigned xid[256];
};
void gd_read_control(int device, struct gd_control *out);

/* Fault injection. A rule list parsed once from an environment variable;
 * gd_fault returns the error code to inject into this call of `fn`, or 0.
 * `codes` maps error names (without their CUDA_ERROR_/NVML_ERROR_ prefix)
 * to numbers. */
struct gd_code {
    const char *name;
    int code;
};
struct gd_rule {
    char fn[64];
    int code;
    unsigned long from_call;
    int only; /* fail the from_call-th call only */
    unsigned long calls;
};
struct gd_faults {
    int parsed;
    int n;
    struct gd_rule rules[32];
};
int gd_fault(struct gd_faults *faults, const char *env, const struct gd_code *codes,
             const char *fn);

void gd_trace(const char *lib, const char *fn, int result);

#endif
