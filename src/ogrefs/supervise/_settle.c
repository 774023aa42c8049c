/* The settled supervisor's loop in C: every stopped call let go, no Python per call.
 *
 * Once the box is complete (docs/mount.md, "What it costs") the supervisor
 * has nothing left to check: each path call of the job is received and
 * answered "go on" (SECCOMP_USER_NOTIF_FLAG_CONTINUE). In Python that is a
 * poll, two ioctls and the interpreter between them, about 20 us a call on
 * two cores; here it is the three system calls alone, with the GIL released.
 *
 * pass_calls(fd, ms) -> (passed, hung_up): answers calls on the listener
 * `fd` for at most `ms` milliseconds of wall time, then returns so that the
 * caller can reap its children and run its signal handlers (a signal that
 * interrupts poll() returns at once). hung_up: no process with the filter is
 * left (POLLHUP). A caller killed before its answer (ENOENT) is no error.
 * Owns nothing: the listener is the caller's, this only reads and answers it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>

/* The kernel's ABI (include/uapi/linux/seccomp.h, Linux 5.0/5.5), spelled out so that the build needs no
 * particular kernel headers; seccomp.py packs the same structures. */
struct og_seccomp_data {
    int32_t nr;
    uint32_t arch;
    uint64_t instruction_pointer;
    uint64_t args[6];
};

struct og_seccomp_notif {
    uint64_t id;
    uint32_t pid;
    uint32_t flags;
    struct og_seccomp_data data;
};

struct og_seccomp_notif_resp {
    uint64_t id;
    int64_t val;
    int32_t error;
    uint32_t flags;
};

#define OG_IOC(dir, nr, size) (((unsigned long)(dir) << 30) | ((unsigned long)(size) << 16) | ('!' << 8) | (nr))
#define OG_NOTIF_RECV OG_IOC(3, 0, sizeof(struct og_seccomp_notif))
#define OG_NOTIF_SEND OG_IOC(3, 1, sizeof(struct og_seccomp_notif_resp))
#define OG_FLAG_CONTINUE 1u

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static PyObject *pass_calls(PyObject *self, PyObject *args)
{
    int fd, ms;
    (void)self;
    if (!PyArg_ParseTuple(args, "ii", &fd, &ms))
        return NULL;
    unsigned long long passed = 0;
    int hung_up = 0, err = 0;
    Py_BEGIN_ALLOW_THREADS
    double deadline = now_ms() + ms;
    for (;;) {
        int left = (int)(deadline - now_ms());
        if (left < 0)
            break;
        struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
        int r = poll(&p, 1, left);
        if (r < 0) {
            if (errno != EINTR)
                err = errno;
            break; /* a signal: the caller's handlers run */
        }
        if (r == 0)
            break;
        if (p.revents & POLLIN) {
            struct og_seccomp_notif n;
            memset(&n, 0, sizeof n); /* the kernel refuses a buffer that is not zeroed */
            if (ioctl(fd, OG_NOTIF_RECV, &n) < 0) {
                if (errno == ENOENT)
                    continue; /* its caller was killed meanwhile */
                if (errno != EINTR)
                    err = errno;
                break;
            }
            struct og_seccomp_notif_resp resp = {.id = n.id, .val = 0, .error = 0, .flags = OG_FLAG_CONTINUE};
            if (ioctl(fd, OG_NOTIF_SEND, &resp) < 0 && errno != ENOENT) {
                err = errno;
                break;
            }
            passed++;
            continue;
        }
        if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) {
            hung_up = 1;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(Ki)", passed, hung_up);
}

static PyMethodDef methods[] = {
    {"pass_calls", pass_calls, METH_VARARGS,
     "pass_calls(fd, ms) -> (passed, hung_up): let every stopped call of the listener go on, for at most ms."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_settle", "The settled supervisor's loop, without Python per call.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__settle(void)
{
    return PyModule_Create(&module);
}
