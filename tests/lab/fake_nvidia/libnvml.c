/* Fake libnvidia-ml.so.1: what nvidia-smi and pynvml (ogrefs' GPU probe) call.
 * nvmlInit refuses a kernel module of another version with 18
 * (NVML_ERROR_LIB_RM_VERSION_MISMATCH); the box has no GPU (count 0). */
#include "kmod.h"

typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
       NVML_ERROR_INSUFFICIENT_SIZE = 7, NVML_ERROR_DRIVER_NOT_LOADED = 9,
       NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18 };

static int initialized;

nvmlReturn_t nvmlInit_v2(void) {
    switch (kmod_check()) {
    case KMOD_ABSENT: return NVML_ERROR_DRIVER_NOT_LOADED;
    case KMOD_MISMATCH: return NVML_ERROR_LIB_RM_VERSION_MISMATCH;
    default: initialized++; return NVML_SUCCESS;
    }
}
nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return nvmlInit_v2(); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    initialized--;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(DRIVER_VERSION) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(version, DRIVER_VERSION);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    *version = CUDA_VERSION;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    *count = 0;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "Driver/library version mismatch";
    default: return "Unknown Error";
    }
}
