/* Fake libcuda.so.1: the driver API entry points a CUDA program calls first.
 * cuInit refuses a kernel module of another version with 803
 * (CUDA_ERROR_SYSTEM_DRIVER_MISMATCH), like the real library. */
#include "kmod.h"

typedef int CUresult;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_INITIALIZED = 3, CUDA_ERROR_NO_DEVICE = 100,
       CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803 };

static int initialized;

CUresult cuInit(unsigned int flags) {
    (void)flags;
    switch (kmod_check()) {
    case KMOD_ABSENT: return CUDA_ERROR_NO_DEVICE;
    case KMOD_MISMATCH: return CUDA_ERROR_SYSTEM_DRIVER_MISMATCH;
    default: initialized = 1; return CUDA_SUCCESS;
    }
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return 1;
    *version = CUDA_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *count = 0;
    return CUDA_SUCCESS;
}
