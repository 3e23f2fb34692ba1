/* Stand-ins for the host's ldconfig, built static (gpuhook runs no other kind). One of:
 *   -DHANG  never finishes, and leaves a child that never finishes either;
 *   -DFAIL  prints a line and exits 3;
 *   (none)  a spy: prints what it can see of its environment, credentials, limits and
 *           filesystem, then writes a minimal ld.so.cache where -C says. When the image
 *           has /etc/escape-targets ("PID SOCKET SHMKEY": a host process, a host abstract
 *           UNIX socket name, a host SysV shared-memory key), it also tries to signal that
 *           process, connect to that socket and attach that segment, and says how it went.
 * The spy's output reaches gpuhook's log only, which is what the tests read. */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <linux/capability.h>
#include <stdio.h>
#include <string.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

extern char **environ;

static const char *cache_path(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "-C") == 0)
            return argv[i + 1];
    return "/etc/ld.so.cache";
}

static void try_open(const char *path) {
    FILE *f = fopen(path, "r");
    printf("OPEN %s %s\n", path, f ? "ok" : strerror(errno));
    if (f)
        fclose(f);
}

static void try_escape(void) {
    FILE *f = fopen("/etc/escape-targets", "r");
    long pid;
    char name[100];
    int key;
    if (!f)
        return;
    int got = fscanf(f, "%ld %99s %d", &pid, name, &key);
    fclose(f);
    if (got != 3)
        return;
    printf("PID %d\n", (int)getpid());
    printf("KILL %s\n", kill((pid_t)pid, SIGTERM) == 0 ? "ok" : strerror(errno));
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path + 1, name, strlen(name));  /* abstract: a leading NUL */
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    int done = s >= 0 && connect(s, (struct sockaddr *)&addr,
                                 (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name))) == 0;
    printf("CONNECT %s\n", done ? "ok" : strerror(errno));
    printf("SHM %s\n", shmget((key_t)key, 0, 0) >= 0 ? "ok" : strerror(errno));
}

/* What a compromised ldconfig would use against the host's shared kernel state (attacker pass
 * 13): root's keyrings, new processes, memory outside its address space, a user namespace. */
static void try_shared_kernel_state(void) {
    long key = syscall(SYS_add_key, "user", "gpuhook-spy", "x", 1, -4 /* KEY_SPEC_USER_KEYRING */);
    printf("ADD_KEY %s\n", key >= 0 ? "ok" : strerror(errno));
    long found = syscall(SYS_request_key, "user", "gpuhook-spy", NULL, 0);
    printf("REQUEST_KEY %s\n", found >= 0 ? "ok" : strerror(errno));
    long joined = syscall(SYS_keyctl, 1 /* KEYCTL_JOIN_SESSION_KEYRING */, NULL);
    printf("KEYCTL %s\n", joined >= 0 ? "ok" : strerror(errno));
    pid_t child = fork();
    if (child == 0)
        _exit(0);
    printf("FORK %s\n", child >= 0 ? "ok" : strerror(errno));
    long memfd = syscall(SYS_memfd_create, "spy", 0);
    printf("MEMFD %s\n", memfd >= 0 ? "ok" : strerror(errno));
    printf("UNSHARE_USER %s\n", unshare(CLONE_NEWUSER) == 0 ? "ok" : strerror(errno));
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    printf("SOCKET %s\n", s >= 0 ? "ok" : strerror(errno));
    /* attacker pass 14: outliving the hook, host-wide kernel memory and quotas, locks */
    printf("PDEATHSIG %s\n", prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0) == 0 ? "ok" : strerror(errno));
    printf("SEMGET %s\n", syscall(SYS_semget, 0 /* IPC_PRIVATE */, 1, 01000 | 0600) >= 0 ? "ok" : strerror(errno));
    printf("INOTIFY %s\n", syscall(SYS_inotify_init1, 0) >= 0 ? "ok" : strerror(errno));
    printf("FLOCK %s\n", syscall(SYS_flock, 0, 1 /* LOCK_SH */) == 0 ? "ok" : strerror(errno));
    char host[65] = "";
    gethostname(host, sizeof host - 1);
    printf("HOSTNAME %s\n", host);
}

int main(int argc, char **argv) {
#if defined(HANG)
    (void)argc; (void)argv;
    if (fork() == 0)
        for (;;) pause();
    for (;;) pause();
#elif defined(FAIL)
    (void)argc; (void)argv;
    fprintf(stderr, "ldconfig: cannot do it\n");
    return 3;
#else
    for (char **e = environ; *e; e++)
        printf("ENV %s\n", *e);
    char cwd[256];
    printf("CWD %s\n", getcwd(cwd, sizeof cwd) ? cwd : "?");
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    syscall(SYS_capget, &header, data);
    printf("CAPS %x %x %x %x %x %x\n", data[0].effective, data[1].effective, data[0].permitted,
           data[1].permitted, data[0].inheritable, data[1].inheritable);
    printf("BOUNDING_SYS_ADMIN %d\n", prctl(PR_CAPBSET_READ, CAP_SYS_ADMIN, 0, 0, 0));
    printf("NO_NEW_PRIVS %d\n", prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0));
    struct rlimit limit;
    getrlimit(RLIMIT_AS, &limit);
    printf("RLIMIT_AS %llu\n", (unsigned long long)limit.rlim_cur);
    getrlimit(RLIMIT_CPU, &limit);
    printf("RLIMIT_CPU %llu\n", (unsigned long long)limit.rlim_cur);
    try_open("/proc/1/root/etc/hostname");
    try_open("/proc/self/mountinfo");
    try_open("/sys/kernel/uevent_seqnum");
    try_open("/dev/zero");
    try_escape();
    try_shared_kernel_state();
    FILE *w = fopen("/etc/written-by-ldconfig", "w");
    printf("WRITE_ROOTFS %s\n", w ? "ok" : strerror(errno));
    FILE *cache = fopen(cache_path(argc, argv), "w");
    if (!cache) {
        printf("CACHE %s\n", strerror(errno));
        return 1;
    }
    fputs("glibc-ld.so.cache1.1", cache);
    fwrite("\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 1, 28, cache);
    fclose(cache);
    return 0;
#endif
}
