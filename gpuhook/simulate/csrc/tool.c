/*
 * A stand-in for the driver's binaries (nvidia-smi, nvidia-debugdump, ...), built
 * statically by `gpuhook simulate` so it runs in any container, even one with no libc.
 *
 * Without arguments it reports what a real tool would depend on: which NVIDIA device nodes
 * the container has and what open(2) says about each. ENXIO means the device cgroup allows
 * the node but no driver is behind it (the simulated GPU is reachable); EPERM means the
 * cgroup denies it.
 *
 * `nvidia-smi --gpu-reset -i ID` (or -r) resets a simulated GPU in the NVML state file the
 * simulated libnvidia-ml reads (simstate.c), including the failure modes tests inject.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "simstate.h"

static const char *errno_name(int err)
{
    switch (err) {
    case 0: return "OK";
    case ENXIO: return "ENXIO";
    case EPERM: return "EPERM";
    case EACCES: return "EACCES";
    case ENOENT: return "ENOENT";
    case ENODEV: return "ENODEV";
    default: return strerror(err);
    }
}

static int by_name(const struct dirent **a, const struct dirent **b)
{
    return strcmp((*a)->d_name, (*b)->d_name);
}

/* `--gpu-reset -i ID`, `-r -i ID`, `--id=ID` in any order; exit status 2 on bad usage, as
 * nvidia-smi does. */
static int reset_command(int argc, char **argv)
{
    const char *id = NULL;
    int reset = 0, i;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--gpu-reset") == 0 || strcmp(argv[i], "-r") == 0)
            reset = 1;
        else if ((strcmp(argv[i], "-i") == 0 || strcmp(argv[i], "--id") == 0) && i + 1 < argc)
            id = argv[++i];
        else if (strncmp(argv[i], "--id=", 5) == 0)
            id = argv[i] + 5;
        else
            goto usage;
    }
    if (reset && id != NULL && *id != '\0')
        return sim_reset_gpu(sim_state_path(), id, stdout, stderr);
usage:
    fprintf(stderr, "Invalid combination of input arguments. The simulated nvidia-smi knows only "
                    "\"--gpu-reset -i <uuid|index|pci bus id>\" and no arguments.\n");
    return 2;
}

int main(int argc, char **argv)
{
    const char *name = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    struct dirent **entries;
    int n, i, found = 0;

    if (argc > 1)
        return reset_command(argc, argv);
    printf("%s (simulated by gpuhook, driver %s)\n", name, SIM_DRIVER_VERSION);
    n = scandir("/dev", &entries, NULL, by_name);
    for (i = 0; i < n; i++) {
        char path[300];
        struct stat st;
        int fd, err;

        if (strncmp(entries[i]->d_name, "nvidia", 6) != 0)
            goto next;
        snprintf(path, sizeof path, "/dev/%s", entries[i]->d_name);
        if (stat(path, &st) != 0 || !S_ISCHR(st.st_mode))
            goto next;
        fd = open(path, O_RDWR);
        err = fd < 0 ? errno : 0;
        if (fd >= 0)
            close(fd);
        printf("  %-22s c %3u:%-3u  open: %s%s\n", path, major(st.st_rdev), minor(st.st_rdev),
               errno_name(err), err == ENXIO ? " (allowed; no real driver)" :
               err == EPERM ? " (denied by the device cgroup)" : "");
        found++;
    next:
        free(entries[i]);
    }
    if (n >= 0)
        free(entries);
    if (!found)
        printf("  no NVIDIA device nodes in /dev\n");
    return 0;
}
