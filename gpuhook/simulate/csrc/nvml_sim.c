/*
 * A simulated libnvidia-ml (NVML), built by `gpuhook simulate` as the driver root's
 * libnvidia-ml.so.<driver version> with soname libnvidia-ml.so.1.
 *
 * It exports NVML's real entry points, versioned names included (nvmlInit_v2,
 * nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetComputeRunningProcesses_v3, ...), with nvml.h's
 * struct layouts, so unmodified NVML clients (nvidia-ml-py above all) run against it. The GPUs
 * and their faults come from the state file (simstate.h, docs/simulated-host.md), which is
 * re-read whenever it changes, so a test can change a GPU between two calls of one session,
 * just as a real GPU changes under a running NVML client.
 *
 * Device handles point into static tables (one slot per GPU and per MIG device) and stay valid
 * across re-reads. Every entry point sleeps the state's call_latency_ms before answering,
 * outside the lock, so concurrent callers wait in parallel, as with a slow real driver.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nvml_sim.h"
#include "simstate.h"

/* The driver branch whose entry points this library exports (gpuhook simulate passes the
 * branch of --driver-version): NVML grew versioned entry points over time, and a client that
 * calls one the installed driver lacks gets NVML_ERROR_FUNCTION_NOT_FOUND. Which branch
 * brought which: docs/simulated-host.md ("Entry points by driver branch"). */
#ifndef SIM_DRIVER_BRANCH
#define SIM_DRIVER_BRANCH 9999
#endif
#define SIM_HAS(branch) (SIM_DRIVER_BRANCH >= (branch))

/* A handle is the address of a slot in gpu_handles or mig_handles; the slot's position says
 * which GPU (and MIG device) it names, so handles stay valid when the state is re-read. */
struct nvmlDevice_st {
    char slot;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned init_count;
static int client_fd = -1;                      /* held while NVML is initialised (sim_client_attach) */
static char state_path[4096];
static struct sim_state state;
static int loaded;
static struct stat loaded_stat;
static char reported[SIM_MESSAGE_LEN];          /* last problem printed, so a bad file is reported once */
static struct nvmlDevice_st gpu_handles[SIM_MAX_GPUS];
static struct nvmlDevice_st mig_handles[SIM_MAX_GPUS][SIM_MAX_MIG];

static void report(const char *message)
{
    if (strcmp(message, reported) == 0)
        return;
    snprintf(reported, sizeof reported, "%s", message);
    fprintf(stderr, "gpuhook simulated NVML: %s\n", message);
}

static int same_file(const struct stat *a, const struct stat *b)
{
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* Re-read the state file if it changed. Call with the lock held. A missing file reads as "no
 * driver"; a damaged one as an uninitialized library, with the reason on stderr. */
static nvmlReturn_t refresh(void)
{
    struct sim_state fresh;
    struct stat st;
    char message[SIM_MESSAGE_LEN];
    int err;

    if (stat(state_path, &st) != 0) {
        err = errno;
        snprintf(message, sizeof message, "state file %s: %s", state_path, strerror(err));
        report(message);
        return err == ENOENT ? NVML_ERROR_DRIVER_NOT_LOADED : NVML_ERROR_UNINITIALIZED;
    }
    if (loaded && same_file(&st, &loaded_stat))
        return NVML_SUCCESS;
    if (sim_state_load(state_path, &fresh, &err, message, sizeof message) != 0) {
        report(message);
        return err == ENOENT ? NVML_ERROR_DRIVER_NOT_LOADED : NVML_ERROR_UNINITIALIZED;
    }
    if (loaded)
        sim_state_free(&state);
    state = fresh;
    loaded = 1;
    loaded_stat = st;
    reported[0] = '\0';
    return NVML_SUCCESS;
}

/* Start an entry point: check initialization, sleep the per-call latency unlocked, then take
 * the lock with a fresh state. On success the caller holds the lock and must call finish(). */
static nvmlReturn_t begin(void)
{
    nvmlReturn_t r;
    unsigned latency;

    pthread_mutex_lock(&lock);
    if (init_count == 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    r = refresh();
    latency = state.call_latency_ms;
    pthread_mutex_unlock(&lock);
    if (r != NVML_SUCCESS)
        return r;
    sim_sleep_ms(latency);
    pthread_mutex_lock(&lock);
    r = init_count == 0 ? NVML_ERROR_UNINITIALIZED : refresh();
    if (r != NVML_SUCCESS)
        pthread_mutex_unlock(&lock);
    return r;
}

static nvmlReturn_t finish(nvmlReturn_t r)
{
    pthread_mutex_unlock(&lock);
    return r;
}

/* The GPU (and MIG device, or NULL) behind a handle. */
struct target {
    struct sim_gpu *gpu;
    struct sim_mig *mig;
    unsigned index;
};

/* Which GPU and MIG device (-1: none) a handle names; -1 if it is not one of ours. */
static int decode(nvmlDevice_t device, unsigned *gpu, int *mig)
{
    uintptr_t p = (uintptr_t)device, g = (uintptr_t)gpu_handles, m = (uintptr_t)mig_handles;
    const size_t size = sizeof(struct nvmlDevice_st);

    if (p >= g && p < g + sizeof gpu_handles && (p - g) % size == 0) {
        *gpu = (unsigned)((p - g) / size);
        *mig = -1;
        return 0;
    }
    if (p >= m && p < m + sizeof mig_handles && (p - m) % size == 0) {
        *gpu = (unsigned)((p - m) / size / SIM_MAX_MIG);
        *mig = (int)((p - m) / size % SIM_MAX_MIG);
        return 0;
    }
    return -1;
}

/* begin() for a device entry point. `mig_ok`: whether the call accepts a MIG device handle
 * (those that do not answer NOT_SUPPORTED for one, as NVML does). */
static nvmlReturn_t begin_device(nvmlDevice_t device, int mig_ok, struct target *t)
{
    nvmlReturn_t r;
    unsigned gpu;
    int mig;

    if ((r = begin()) != NVML_SUCCESS)
        return r;
    if (decode(device, &gpu, &mig) != 0 || gpu >= state.ngpus)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    t->index = gpu;
    t->gpu = &state.gpus[gpu];
    t->mig = NULL;
    if (t->gpu->lost)
        return finish(NVML_ERROR_GPU_IS_LOST);
    if (mig >= 0) {
        if (!t->gpu->mig_mode || (unsigned)mig >= t->gpu->nmig)
            return finish(NVML_ERROR_INVALID_ARGUMENT);
        if (!mig_ok)
            return finish(NVML_ERROR_NOT_SUPPORTED);
        t->mig = &t->gpu->mig[mig];
    }
    return NVML_SUCCESS;
}

static nvmlDevice_t gpu_handle(unsigned index)
{
    return &gpu_handles[index];
}

static nvmlDevice_t mig_handle(unsigned gpu, unsigned mig)
{
    return &mig_handles[gpu][mig];
}

/* Finish a handle lookup: the GPU's attach latency is slept after unlocking. */
static nvmlReturn_t found(unsigned index, nvmlDevice_t handle, nvmlDevice_t *out)
{
    unsigned latency = state.gpus[index].handle_latency_ms;

    if (state.gpus[index].lost)
        return finish(NVML_ERROR_GPU_IS_LOST);
    *out = handle;
    pthread_mutex_unlock(&lock);
    sim_sleep_ms(latency);
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_text(const char *text, char *out, unsigned length)
{
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

/* ---- initialization ---------------------------------------------------------------- */

NVML_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    nvmlReturn_t r = NVML_SUCCESS;
    unsigned latency = 0;

    (void)flags;  /* NO_GPUS / NO_ATTACH change nothing for simulated GPUs */
    pthread_mutex_lock(&lock);
    if (init_count == 0) {
        snprintf(state_path, sizeof state_path, "%s", sim_state_path());
        reported[0] = '\0';  /* each new session reports a bad state file again */
    }
    if ((r = refresh()) == NVML_SUCCESS) {
        /* Like NVML: only the first initialisation of a process attaches to the driver (the
         * slow part without persistence mode); nested ones only count. Attached, this process
         * is a client that keeps the simulated nvidia-smi from resetting any GPU. */
        latency = (init_count == 0 ? state.init_latency_ms : 0) + state.call_latency_ms;
        if (init_count == 0)
            client_fd = sim_client_attach(state_path);
        init_count++;
    }
    pthread_mutex_unlock(&lock);
    sim_sleep_ms(latency);
    return r;
}

NVML_API nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

NVML_API nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

NVML_API nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&lock);
    if (init_count == 0)
        return finish(NVML_ERROR_UNINITIALIZED);
    if (--init_count == 0) {
        if (loaded) {
            sim_state_free(&state);
            loaded = 0;
        }
        if (client_fd >= 0) {
            close(client_fd);
            client_fd = -1;
        }
    }
    return finish(NVML_SUCCESS);
}

NVML_API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED:
        return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources for request";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not Ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    default: return "Unknown Error";
    }
}

/* ---- system ------------------------------------------------------------------------ */

NVML_API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = begin();

    return r != NVML_SUCCESS ? r : finish(copy_text(state.driver_version, version, length));
}

NVML_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = begin();

    return r != NVML_SUCCESS ? r : finish(copy_text(state.nvml_version, version, length));
}

NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    nvmlReturn_t r = begin();

    if (r != NVML_SUCCESS)
        return r;
    if (cudaDriverVersion == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *cudaDriverVersion = state.cuda_version;
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ---- device lookup ----------------------------------------------------------------- */

NVML_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t r = begin();

    if (r != NVML_SUCCESS)
        return r;
    if (deviceCount == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *deviceCount = state.ngpus;
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t r = begin();

    if (r != NVML_SUCCESS)
        return r;
    if (device == NULL || index >= state.ngpus)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    return found(index, gpu_handle(index), device);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t r = begin();
    unsigned i, m;

    if (r != NVML_SUCCESS)
        return r;
    if (uuid == NULL || device == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    for (i = 0; i < state.ngpus; i++) {
        const struct sim_gpu *g = &state.gpus[i];
        if (strcmp(g->uuid, uuid) == 0)
            return found(i, gpu_handle(i), device);
        for (m = 0; g->mig_mode && m < g->nmig; m++)
            if (strcmp(g->mig[m].uuid, uuid) == 0)
                return found(i, mig_handle(i, m), device);
    }
    return finish(NVML_ERROR_NOT_FOUND);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    nvmlReturn_t r = begin();
    unsigned domain, bus, dev, function, i;

    if (r != NVML_SUCCESS)
        return r;
    if (pciBusId == NULL || device == NULL || sim_parse_bus_id(pciBusId, &domain, &bus, &dev, &function) != 0)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    for (i = 0; i < state.ngpus; i++) {
        const struct sim_gpu *g = &state.gpus[i];
        if (g->domain == domain && g->bus == bus && g->device == dev && g->function == function)
            return found(i, gpu_handle(i), device);
    }
    return finish(NVML_ERROR_NOT_FOUND);
}

NVML_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ---- identity ---------------------------------------------------------------------- */

NVML_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (index == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *index = t.index;
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct target t;
    char text[SIM_TEXT_LEN + 48];
    nvmlReturn_t r = begin_device(device, 1, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (t.mig != NULL)  /* NVML names a MIG device after its parent and profile */
        snprintf(text, sizeof text, "%s MIG %s", t.gpu->name, t.mig->profile);
    else
        snprintf(text, sizeof text, "%s", t.gpu->name);
    return finish(copy_text(text, name, length));
}

NVML_API nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 1, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (type == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *type = t.gpu->brand;
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 1, &t);

    if (r != NVML_SUCCESS)
        return r;
    return finish(copy_text(t.mig != NULL ? t.mig->uuid : t.gpu->uuid, uuid, length));
}

NVML_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (minorNumber == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *minorNumber = t.gpu->minor;
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (pci == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    pci->domain = t.gpu->domain;
    pci->bus = t.gpu->bus;
    pci->device = t.gpu->device;
    pci->pciDeviceId = t.gpu->pci_device_id;
    pci->pciSubSystemId = t.gpu->pci_subsystem_id;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", t.gpu->domain & 0xFFFF,
             t.gpu->bus, t.gpu->device);
    sim_bus_id(t.gpu, pci->busId, sizeof pci->busId);
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

NVML_API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

NVML_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 1, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (major == NULL || minor == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *major = t.gpu->cc_major;
    *minor = t.gpu->cc_minor;
    return finish(NVML_SUCCESS);
}

/* ---- processes and memory ---------------------------------------------------------- */

/* Whether a process belongs to the target: all of a GPU's, or one MIG device's. */
static int process_on(const struct target *t, const struct sim_process *p)
{
    if (!sim_process_present(p))
        return 0;
    return t->mig == NULL ||
           (p->gpu_instance_id == t->mig->gpu_instance_id && p->compute_instance_id == t->mig->compute_instance_id);
}

static unsigned long long used_memory(const struct target *t)
{
    unsigned long long used = t->mig != NULL ? t->mig->memory_used : t->gpu->memory_used;
    unsigned i;

    /* Memory a process holds is freed when it exits, so only present processes count. */
    for (i = 0; i < t->gpu->ncompute; i++)
        if (process_on(t, &t->gpu->compute[i]))
            used += t->gpu->compute[i].used_memory;
    for (i = 0; i < t->gpu->ngraphics; i++)
        if (process_on(t, &t->gpu->graphics[i]))
            used += t->gpu->graphics[i].used_memory;
    for (i = 0; t->mig == NULL && t->gpu->mig_mode && i < t->gpu->nmig; i++)
        used += t->gpu->mig[i].memory_used;
    return used;
}

NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 1, &t);
    unsigned long long total, used;

    if (r != NVML_SUCCESS)
        return r;
    if (memory == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    total = t.mig != NULL ? t.mig->memory_total : t.gpu->memory_total;
    /* Version 1 counts the driver's reserve as used (on an idle H200: 615 MiB used, while
     * version 2 says 615 reserved and 0 used). */
    used = used_memory(&t) + (t.mig != NULL ? 0 : t.gpu->memory_reserved);
    memory->total = total;
    memory->used = used;
    memory->free = used < total ? total - used : 0;
    return finish(NVML_SUCCESS);
}

#if SIM_HAS(510)
NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    struct target t;
    nvmlReturn_t r;
    unsigned long long total, reserved, used;

    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if ((r = begin_device(device, 1, &t)) != NVML_SUCCESS)
        return r;
    total = t.mig != NULL ? t.mig->memory_total : t.gpu->memory_total;
    reserved = t.mig != NULL ? 0 : t.gpu->memory_reserved;
    used = used_memory(&t);
    memory->total = total;
    memory->reserved = reserved;
    memory->used = used;
    memory->free = used + reserved < total ? total - used - reserved : 0;
    return finish(NVML_SUCCESS);
}
#endif

/* The running-processes calls of every version: size query, then fill. */
static nvmlReturn_t running_processes(nvmlDevice_t device, int graphics, unsigned *count, void *infos,
                                      int with_instances)
{
    struct target t;
    const struct sim_process *list;
    unsigned n = 0, i, total;
    nvmlReturn_t r = begin_device(device, 1, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (count == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    list = graphics ? t.gpu->graphics : t.gpu->compute;
    total = graphics ? t.gpu->ngraphics : t.gpu->ncompute;
    for (i = 0; i < total; i++)
        n += process_on(&t, &list[i]);
    if (*count < n) {
        *count = n;
        return finish(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (n > 0 && infos == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *count = n;
    for (i = 0, n = 0; i < total; i++) {
        if (!process_on(&t, &list[i]))
            continue;
        if (with_instances) {
            nvmlProcessInfo_v2_t *out = (nvmlProcessInfo_v2_t *)infos + n;
            out->pid = list[i].pid;
            out->usedGpuMemory = list[i].used_memory;
            out->gpuInstanceId = list[i].gpu_instance_id;
            out->computeInstanceId = list[i].compute_instance_id;
        } else {
            nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + n;
            out->pid = list[i].pid;
            out->usedGpuMemory = list[i].used_memory;
        }
        n++;
    }
    return finish(NVML_SUCCESS);
}

#if SIM_HAS(510)
NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    return running_processes(d, 0, c, p, 1);
}
#endif

#if SIM_HAS(455)
NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v2_t *p)
{
    return running_processes(d, 0, c, p, 1);
}
#endif

NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v1_t *p)
{
    return running_processes(d, 0, c, p, 0);
}

#if SIM_HAS(510)
NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_t *p)
{
    return running_processes(d, 1, c, p, 1);
}
#endif

#if SIM_HAS(455)
NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v2_t *p)
{
    return running_processes(d, 1, c, p, 1);
}
#endif

NVML_API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t d, unsigned int *c, nvmlProcessInfo_v1_t *p)
{
    return running_processes(d, 1, c, p, 0);
}

/* ---- memory errors ----------------------------------------------------------------- */

NVML_API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                                  nvmlEccCounterType_t counterType, unsigned long long *eccCounts)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (eccCounts == NULL || (unsigned)errorType > 1 || (unsigned)counterType > 1)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    if (!t.gpu->ecc_enabled)
        return finish(NVML_ERROR_NOT_SUPPORTED);
    *eccCounts = t.gpu->ecc[counterType][errorType];
    return finish(NVML_SUCCESS);
}

/* Page retirement exists up to Volta; Ampere and later remap rows instead (nvml.h). */
static nvmlReturn_t retired_pages(nvmlDevice_t device, nvmlPageRetirementCause_t cause, unsigned *count,
                                  unsigned long long *addresses, unsigned long long *timestamps)
{
    struct target t;
    unsigned n, i;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (count == NULL || (unsigned)cause > 1)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    if (t.gpu->cc_major >= 8 || !t.gpu->ecc_enabled)
        return finish(NVML_ERROR_NOT_SUPPORTED);
    n = cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR ? t.gpu->retired_double_bit
                                                                : t.gpu->retired_single_bit;
    if (*count < n) {
        *count = n;
        return finish(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (n > 0 && addresses == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *count = n;
    for (i = 0; i < n; i++) {
        /* Page addresses the simulation makes up: distinct per cause, 4 KiB apart. */
        addresses[i] = (cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR ? 0x2000000ULL : 0x1000000ULL) +
                       0x1000ULL * i;
        if (timestamps != NULL)
            timestamps[i] = 1700000000ULL + i;
    }
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                                unsigned int *pageCount, unsigned long long *addresses)
{
    return retired_pages(device, cause, pageCount, addresses, NULL);
}

NVML_API nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, nvmlPageRetirementCause_t cause,
                                                   unsigned int *pageCount, unsigned long long *addresses,
                                                   unsigned long long *timestamps)
{
    return retired_pages(device, cause, pageCount, addresses, timestamps);
}

NVML_API nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (isPending == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    if (t.gpu->cc_major >= 8 || !t.gpu->ecc_enabled)
        return finish(NVML_ERROR_NOT_SUPPORTED);
    *isPending = t.gpu->retired_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                                unsigned int *isPending, unsigned int *failureOccurred)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (corrRows == NULL || uncRows == NULL || isPending == NULL || failureOccurred == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    /* Row remapping exists from Ampere on, and NVML does not report it while MIG is on. */
    if (t.gpu->cc_major < 8 || t.gpu->mig_mode)
        return finish(NVML_ERROR_NOT_SUPPORTED);
    *corrRows = t.gpu->remapped_correctable;
    *uncRows = t.gpu->remapped_uncorrectable;
    *isPending = (unsigned)t.gpu->remapped_pending;
    *failureOccurred = (unsigned)t.gpu->remapped_failure;
    return finish(NVML_SUCCESS);
}

/* ---- persistence mode -------------------------------------------------------------- */

NVML_API nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (mode == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *mode = t.gpu->persistence_mode ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return finish(NVML_SUCCESS);
}

/* Root only, as NVML's; written to the state file, where the simulated nvidia-smi sees it. */
NVML_API nvmlReturn_t nvmlDeviceSetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t mode)
{
    struct target t;
    char uuid[SIM_TEXT_LEN], message[SIM_MESSAGE_LEN];
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (mode != NVML_FEATURE_ENABLED && mode != NVML_FEATURE_DISABLED)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    if (geteuid() != 0)
        return finish(NVML_ERROR_NO_PERMISSION);
    snprintf(uuid, sizeof uuid, "%s", t.gpu->uuid);
    if (sim_set_gpu_bool(state_path, uuid, "persistence_mode", mode == NVML_FEATURE_ENABLED, message,
                         sizeof message) != 0) {
        report(message);
        return finish(NVML_ERROR_UNKNOWN);
    }
    return finish(refresh());
}

/* ---- MIG --------------------------------------------------------------------------- */

NVML_API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (currentMode == NULL || pendingMode == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    if (!t.gpu->mig_capable)
        return finish(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = t.gpu->mig_mode ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    *pendingMode = t.gpu->mig_mode_pending ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 0, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (count == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *count = t.gpu->mig_mode ? SIM_MAX_MIG : 0;  /* "zero if MIG is not supported or enabled" */
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                          nvmlDevice_t *migDevice)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 1, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (migDevice == NULL || t.mig != NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    if (!t.gpu->mig_capable)
        return finish(NVML_ERROR_NOT_SUPPORTED);
    if (!t.gpu->mig_mode || index >= SIM_MAX_MIG)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    if (index >= t.gpu->nmig)
        return finish(NVML_ERROR_NOT_FOUND);
    *migDevice = mig_handle(t.index, index);
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 1, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (isMigDevice == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = t.mig != NULL;
    return finish(NVML_SUCCESS);
}

static nvmlReturn_t instance_id(nvmlDevice_t device, unsigned *id, int compute)
{
    struct target t;
    nvmlReturn_t r = begin_device(device, 1, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (id == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    if (t.mig == NULL)
        return finish(NVML_ERROR_NOT_SUPPORTED);
    *id = compute ? t.mig->compute_instance_id : t.mig->gpu_instance_id;
    return finish(NVML_SUCCESS);
}

NVML_API nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return instance_id(device, id, 0);
}

NVML_API nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return instance_id(device, id, 1);
}

NVML_API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    struct target t;
    nvmlReturn_t r = begin_device(migDevice, 1, &t);

    if (r != NVML_SUCCESS)
        return r;
    if (device == NULL || t.mig == NULL)
        return finish(NVML_ERROR_INVALID_ARGUMENT);
    *device = gpu_handle(t.index);
    return finish(NVML_SUCCESS);
}

/* ---- queries a simulated GPU has no answer for -------------------------------------- */

/* Monitoring tools call these; they answer NOT_SUPPORTED (after the usual handle and lost-GPU
 * checks) instead of being absent, which clients would see as FUNCTION_NOT_FOUND. Their other
 * parameters are unused by design. */
#pragma GCC diagnostic ignored "-Wunused-parameter"
#define NOT_SUPPORTED_QUERY(name, ...)                      \
    NVML_API nvmlReturn_t name(nvmlDevice_t device, __VA_ARGS__) \
    {                                                       \
        struct target t;                                    \
        nvmlReturn_t r = begin_device(device, 1, &t);       \
        return r != NVML_SUCCESS ? r : finish(NVML_ERROR_NOT_SUPPORTED); \
    }

NOT_SUPPORTED_QUERY(nvmlDeviceGetTemperature, unsigned int sensorType, unsigned int *temp)
NOT_SUPPORTED_QUERY(nvmlDeviceGetPowerUsage, unsigned int *power)
NOT_SUPPORTED_QUERY(nvmlDeviceGetUtilizationRates, nvmlUtilization_t *utilization)
NOT_SUPPORTED_QUERY(nvmlDeviceGetFanSpeed, unsigned int *speed)
NOT_SUPPORTED_QUERY(nvmlDeviceGetClockInfo, unsigned int type, unsigned int *clock)
NOT_SUPPORTED_QUERY(nvmlDeviceGetSerial, char *serial, unsigned int length)
NOT_SUPPORTED_QUERY(nvmlDeviceGetVbiosVersion, char *version, unsigned int length)
NOT_SUPPORTED_QUERY(nvmlDeviceGetPerformanceState, unsigned int *pState)
