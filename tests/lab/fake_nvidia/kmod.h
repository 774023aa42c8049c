/* The "kernel module" check the real NVIDIA userspace makes, for the lab's fakes.
 *
 * The real libcuda, libnvidia-ml and nvidia-smi read the loaded module's version
 * from /proc/driver/nvidia/version and refuse to work with a module of another
 * version.  A container or chroot cannot fake procfs, so the fakes read the same
 * line from NVIDIA_LAB_KMOD_FILE (a file on /run, which belongs to the running
 * box and is never snapshotted) and fall back to /proc/driver/nvidia/version.
 * DRIVER_VERSION is the userspace's own version, given with -D at build time. */
#ifndef LAB_KMOD_H
#define LAB_KMOD_H
#include <stdio.h>
#include <string.h>

#define NVIDIA_LAB_KMOD_FILE "/run/nvidia-lab/version"

enum kmod_state { KMOD_MATCH, KMOD_MISMATCH, KMOD_ABSENT };

/* Version token after "Kernel Module" in a line such as
 * "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..." */
static int kmod_version(char *out, size_t size) {
    const char *paths[] = {NVIDIA_LAB_KMOD_FILE, "/proc/driver/nvidia/version"};
    char line[512];
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        FILE *f = fopen(paths[i], "r");
        if (!f) continue;
        char *got = fgets(line, sizeof line, f);
        fclose(f);
        const char *p = got ? strstr(line, "Kernel Module") : NULL;
        if (!p) continue;
        if (sscanf(p + strlen("Kernel Module"), " %63s", out) == 1 && strlen(out) < size) return 0;
    }
    return -1;
}

static enum kmod_state kmod_check(void) {
    char v[64];
    if (kmod_version(v, sizeof v) != 0) return KMOD_ABSENT;
    return strcmp(v, DRIVER_VERSION) == 0 ? KMOD_MATCH : KMOD_MISMATCH;
}
#endif
