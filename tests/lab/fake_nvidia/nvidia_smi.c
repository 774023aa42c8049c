/* Fake nvidia-smi: loads libnvidia-ml.so.1 through the dynamic linker (its
 * cache and default paths, like the real one) and prints what the real tool
 * prints on success and on the two failures the lab provokes. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int (*init_fn)(void);
typedef int (*version_fn)(char *, unsigned int);
typedef const char *(*error_fn)(int);

int main(int argc, char **argv) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system.\n");
        return 12;
    }
    init_fn init = (init_fn)dlsym(lib, "nvmlInit_v2");
    version_fn version = (version_fn)dlsym(lib, "nvmlSystemGetDriverVersion");
    error_fn error = (error_fn)dlsym(lib, "nvmlErrorString");
    int rc = init ? init() : 1;
    if (rc == 9) {
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
               "Make sure that the latest NVIDIA driver is installed and running.\n");
        return 9;
    }
    if (rc != 0) {
        printf("Failed to initialize NVML: %s\n", error ? error(rc) : "Unknown Error");
        return rc;
    }
    char v[80] = "";
    version(v, sizeof v);
    if (argc > 1 && strncmp(argv[1], "--query-gpu=driver_version", 26) == 0) {
        printf("%s\n", v);
        return 0;
    }
    printf("NVIDIA-SMI %s    Driver Version: %s    CUDA Version: %s\n", v, v, CUDA_VERSION_TEXT);
    printf("No running processes found\n");
    return 0;
}
