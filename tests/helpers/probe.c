/*
 * probe: what a container sees at each path, as one JSON object per line.
 *
 * Built statically by the test suite and copied into busybox rootfses. For every path it
 * reports the file type, device numbers, mode, symlink target, whether open(2) for reading
 * and for writing succeeds (or the errno name: EPERM = device cgroup denies, ENXIO = allowed
 * but no driver, EROFS = read-only mount), and whether the path is on a read-only mount.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

static const char *name_of(int err)
{
    switch (err) {
    case 0: return "OK";
    case EPERM: return "EPERM";
    case ENOENT: return "ENOENT";
    case ENXIO: return "ENXIO";
    case EACCES: return "EACCES";
    case EROFS: return "EROFS";
    case EISDIR: return "EISDIR";
    case ENODEV: return "ENODEV";
    case ELOOP: return "ELOOP";
    case ETXTBSY: return "ETXTBSY";
    case ENOTDIR: return "ENOTDIR";
    default: return "OTHER";
    }
}

static const char *try_open(const char *path, int flags)
{
    int fd = open(path, flags | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return name_of(errno);
    close(fd);
    return "OK";
}

static const char *type_of(mode_t m)
{
    if (S_ISCHR(m)) return "chr";
    if (S_ISBLK(m)) return "blk";
    if (S_ISDIR(m)) return "dir";
    if (S_ISREG(m)) return "reg";
    if (S_ISLNK(m)) return "lnk";
    if (S_ISFIFO(m)) return "fifo";
    if (S_ISSOCK(m)) return "sock";
    return "other";
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *p = argv[i];
        struct stat st, lst;
        struct statvfs vfs;
        char link[4096] = "";
        if (lstat(p, &lst) != 0) {
            printf("{\"path\":\"%s\",\"exists\":false,\"errno\":\"%s\"}\n", p, name_of(errno));
            continue;
        }
        if (S_ISLNK(lst.st_mode)) {
            ssize_t n = readlink(p, link, sizeof link - 1);
            link[n > 0 ? n : 0] = 0;
        }
        int have = stat(p, &st) == 0;
        int ro = statvfs(p, &vfs) == 0 ? (vfs.f_flag & ST_RDONLY) != 0 : -1;
        printf("{\"path\":\"%s\",\"exists\":true,\"ltype\":\"%s\",\"type\":\"%s\",\"link\":\"%s\","
               "\"major\":%u,\"minor\":%u,\"mode\":\"%04o\",\"uid\":%u,\"gid\":%u,\"size\":%lld,"
               "\"read\":\"%s\",\"write\":\"%s\",\"readonly_mount\":%s}\n",
               p, type_of(lst.st_mode), have ? type_of(st.st_mode) : "dangling", link,
               have ? major(st.st_rdev) : 0, have ? minor(st.st_rdev) : 0,
               have ? (unsigned)(st.st_mode & 07777) : 0, have ? st.st_uid : 0, have ? st.st_gid : 0,
               have ? (long long)st.st_size : -1LL,
               try_open(p, O_RDONLY), try_open(p, O_WRONLY),
               ro < 0 ? "null" : (ro ? "true" : "false"));
    }
    return 0;
}
