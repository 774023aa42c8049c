// An LD_PRELOAD shim that counts the path calls it sees (open*, fopen*, *stat*, statx), to compare with strace.
// Evidence for docs/mount.md, not shipped. Build and run: scripts/supervise_evidence/run
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
static long n_open, n_stat;
static void report(void) __attribute__((destructor));
static void report(void) { char *f = getenv("SHIM_OUT"); if (!f) return; FILE *o = fopen(f, "a"); if (o) { fprintf(o, "%d open %ld stat %ld\n", getpid(), n_open, n_stat); fclose(o);} }
typedef int (*open_t)(const char *, int, ...);
typedef int (*openat_t)(int, const char *, int, ...);
int open(const char *p, int f, ...) { va_list a; va_start(a, f); int m = va_arg(a, int); va_end(a); n_open++; return ((open_t)dlsym(RTLD_NEXT, "open"))(p, f, m); }
int open64(const char *p, int f, ...) { va_list a; va_start(a, f); int m = va_arg(a, int); va_end(a); n_open++; return ((open_t)dlsym(RTLD_NEXT, "open64"))(p, f, m); }
int openat(int d, const char *p, int f, ...) { va_list a; va_start(a, f); int m = va_arg(a, int); va_end(a); n_open++; return ((openat_t)dlsym(RTLD_NEXT, "openat"))(d, p, f, m); }
int openat64(int d, const char *p, int f, ...) { va_list a; va_start(a, f); int m = va_arg(a, int); va_end(a); n_open++; return ((openat_t)dlsym(RTLD_NEXT, "openat64"))(d, p, f, m); }
int __open_2(const char *p, int f) { n_open++; return ((int(*)(const char*,int))dlsym(RTLD_NEXT, "__open_2"))(p, f); }
int __open64_2(const char *p, int f) { n_open++; return ((int(*)(const char*,int))dlsym(RTLD_NEXT, "__open64_2"))(p, f); }
int __openat64_2(int d, const char *p, int f) { n_open++; return ((int(*)(int,const char*,int))dlsym(RTLD_NEXT, "__openat64_2"))(d, p, f); }
FILE *fopen(const char *p, const char *m) { n_open++; return ((FILE*(*)(const char*,const char*))dlsym(RTLD_NEXT, "fopen"))(p, m); }
FILE *fopen64(const char *p, const char *m) { n_open++; return ((FILE*(*)(const char*,const char*))dlsym(RTLD_NEXT, "fopen64"))(p, m); }
int stat(const char *p, struct stat *s) { n_stat++; return ((int(*)(const char*,struct stat*))dlsym(RTLD_NEXT, "stat"))(p, s); }
int stat64(const char *p, struct stat64 *s) { n_stat++; return ((int(*)(const char*,struct stat64*))dlsym(RTLD_NEXT, "stat64"))(p, s); }
int lstat(const char *p, struct stat *s) { n_stat++; return ((int(*)(const char*,struct stat*))dlsym(RTLD_NEXT, "lstat"))(p, s); }
int lstat64(const char *p, struct stat64 *s) { n_stat++; return ((int(*)(const char*,struct stat64*))dlsym(RTLD_NEXT, "lstat64"))(p, s); }
int fstatat(int d, const char *p, struct stat *s, int f) { if (*p) n_stat++; return ((int(*)(int,const char*,struct stat*,int))dlsym(RTLD_NEXT, "fstatat"))(d, p, s, f); }
int fstatat64(int d, const char *p, struct stat64 *s, int f) { if (*p) n_stat++; return ((int(*)(int,const char*,struct stat64*,int))dlsym(RTLD_NEXT, "fstatat64"))(d, p, s, f); }
int statx(int d, const char *p, int f, unsigned m, struct statx *s) { if (*p) n_stat++; return ((int(*)(int,const char*,int,unsigned,struct statx*))dlsym(RTLD_NEXT, "statx"))(d, p, f, m, s); }
