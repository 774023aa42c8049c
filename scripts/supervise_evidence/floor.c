// The kernel's floor for one stopped call: a minimal supervisor in C (recv, CONTINUE, nothing else) over a child
// that calls stat("/") N times under a filter that stops newfstatat. Evidence for docs/mount.md, not shipped.
// Build and run: scripts/supervise_evidence/run
#include <linux/seccomp.h>
#include <linux/filter.h>
#include <linux/audit.h>
#include <sys/syscall.h>
#include <sys/prctl.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
#include <sys/stat.h>
#include <fcntl.h>
#define SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP 1
#define SECCOMP_IOCTL_NOTIF_SET_FLAGS SECCOMP_IOW(4, __u64)
int main(int argc, char **argv) {
  int n = atoi(argv[1]); int sync = argc > 2;
  int sv[2]; socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv);
  pid_t pid = fork();
  if (pid == 0) {
    struct sock_filter f[] = {
      BPF_STMT(BPF_LD|BPF_W|BPF_ABS, 0),
      BPF_JUMP(BPF_JMP|BPF_JEQ|BPF_K, __NR_newfstatat, 0, 1),
      BPF_STMT(BPF_RET|BPF_K, SECCOMP_RET_USER_NOTIF),
      BPF_STMT(BPF_RET|BPF_K, SECCOMP_RET_ALLOW)};
    struct sock_fprog p = {4, f};
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
    int fd = syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &p);
    char c = 0; struct iovec io = {&c, 1}; char buf[CMSG_SPACE(sizeof(int))];
    struct msghdr m = {0}; m.msg_iov = &io; m.msg_iovlen = 1; m.msg_control = buf; m.msg_controllen = sizeof buf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm->cmsg_level = SOL_SOCKET; cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int)); memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    sendmsg(sv[1], &m, 0); close(fd);
    struct timespec a, b; struct stat st; clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; i++) stat("/", &st);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.2f us/stat\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n / 1e3);
    fflush(stdout); _exit(0);
  }
  char c; struct iovec io = {&c, 1}; char buf[CMSG_SPACE(sizeof(int))];
  struct msghdr m = {0}; m.msg_iov = &io; m.msg_iovlen = 1; m.msg_control = buf; m.msg_controllen = sizeof buf;
  recvmsg(sv[0], &m, 0); int fd; memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&m)), sizeof fd);
  if (sync) { __u64 fl = SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP; if (ioctl(fd, SECCOMP_IOCTL_NOTIF_SET_FLAGS, fl)) perror("sync"); }
  struct seccomp_notif req; struct seccomp_notif_resp resp;
  for (;;) {
    memset(&req, 0, sizeof req);
    if (ioctl(fd, SECCOMP_IOCTL_NOTIF_RECV, &req)) { break; }
    resp.id = req.id; resp.val = 0; resp.error = 0; resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
    ioctl(fd, SECCOMP_IOCTL_NOTIF_SEND, &resp);
    int st; if (waitpid(pid, &st, WNOHANG) == pid) break;
  }
  return 0;
}
