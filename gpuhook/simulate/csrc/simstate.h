/*
 * The simulated GPU host's NVML state: the JSON file `gpuhook simulate` writes (DIR/nvml.json)
 * and tests edit, read by the simulated libnvidia-ml and changed by the simulated
 * `nvidia-smi --gpu-reset`. docs/simulated-host.md documents every field.
 *
 * Where the file is: $GPUHOOK_NVML_STATE if set and not empty, else SIM_STATE_PATH, which
 * `gpuhook simulate` compiles in (DIR/nvml.json). Writers replace the file atomically
 * (rename) while holding an flock on "<file>.lock", so readers never see half a file and
 * concurrent read-modify-write cycles (parallel resets of different GPUs) lose nothing.
 */
#ifndef GPUHOOK_SIMSTATE_H
#define GPUHOOK_SIMSTATE_H

#include <stdio.h>

#include "simjson.h"

#define SIM_STATE_ENV "GPUHOOK_NVML_STATE"
#define SIM_FORMAT 1
#define SIM_MAX_GPUS 64
#define SIM_MAX_MIG 7            /* NVML's maximum number of MIG devices per GPU (A100/H100) */
#define SIM_MAX_PROCESSES 256
#define SIM_TEXT_LEN 96          /* NVML_DEVICE_UUID_V2_BUFFER_SIZE and _NAME_V2_BUFFER_SIZE */
#define SIM_NOT_AVAILABLE 0xFFFFFFFFu
#define SIM_MESSAGE_LEN 4608      /* room for a full path and the reason */
#define SIM_MAX_PEERS 16          /* NVLink peers a GPU must be reset with (an 8- or 16-GPU board) */
#define SIM_CLIENTS_SUFFIX ".clients"  /* <state>.clients-test: resets take turns testing for clients */

/* NVML's nvmlBrandType_t values, by the tokens NVIDIA_REQUIRE_* constraints use. */
extern const char *const sim_brand_names[];
extern const unsigned sim_brand_count;

struct sim_process {
    unsigned pid;
    unsigned long long used_memory;
    unsigned gpu_instance_id;      /* SIM_NOT_AVAILABLE when not on a MIG device */
    unsigned compute_instance_id;
    int stale;                     /* reported even when the pid no longer exists */
};

struct sim_mig {
    unsigned gpu_instance_id;
    unsigned compute_instance_id;
    char uuid[SIM_TEXT_LEN];
    char profile[32];
    unsigned long long memory_total;
    unsigned long long memory_used;
};

struct sim_gpu {
    char uuid[SIM_TEXT_LEN];
    char name[SIM_TEXT_LEN];
    unsigned brand;
    unsigned minor;
    unsigned domain, bus, device, function;
    unsigned pci_device_id, pci_subsystem_id;
    int cc_major, cc_minor;
    unsigned long long memory_total, memory_used;
    unsigned long long memory_reserved;  /* the driver's own reserve: "used" to v1, "reserved" to v2 */
    int persistence_mode;
    char reset_peers[SIM_MAX_PEERS][SIM_TEXT_LEN];  /* GPU UUIDs a reset must include (NVLink) */
    unsigned npeers;
    struct sim_process *compute;
    unsigned ncompute;
    struct sim_process *graphics;
    unsigned ngraphics;
    int ecc_enabled;
    unsigned long long ecc[2][2];  /* [counter: 0 volatile, 1 aggregate][type: 0 corrected, 1 uncorrected] */
    unsigned retired_single_bit, retired_double_bit;
    int retired_pending;
    unsigned remapped_correctable, remapped_uncorrectable;
    int remapped_pending, remapped_failure;
    int lost;
    int mig_capable, mig_mode, mig_mode_pending;
    struct sim_mig mig[SIM_MAX_MIG];
    unsigned nmig;
    unsigned handle_latency_ms;
    int reset_fails, reset_hangs, reset_does_not_fix;
    unsigned reset_latency_ms;
};

struct sim_state {
    char driver_version[80];
    char nvml_version[80];
    int cuda_version;              /* NVML encoding: major * 1000 + minor * 10 */
    unsigned call_latency_ms;
    unsigned init_latency_ms;
    struct sim_gpu *gpus;
    unsigned ngpus;
    struct sj *doc;                /* the parsed file, kept so a writer preserves every field */
};

/* The state file's path ($GPUHOOK_NVML_STATE or the compiled-in default). */
const char *sim_state_path(void);

/*
 * Read and validate the state file. Returns 0, or -1 with a message in err: errno_out is
 * the errno when the file could not be read (ENOENT: no simulated driver), 0 when it was
 * read but is not a valid state.
 */
int sim_state_load(const char *path, struct sim_state *state, int *errno_out, char *err, size_t errlen);
void sim_state_free(struct sim_state *state);

/* PCI bus id as NVML prints it ("%08X:%02X:%02X.0"). */
void sim_bus_id(const struct sim_gpu *gpu, char *out, size_t len);

/* Parse "domain:bus:device.function" (and NVML's shorter forms); 0 on success. */
int sim_parse_bus_id(const char *text, unsigned *domain, unsigned *bus, unsigned *device, unsigned *function);

/* Whether a process entry is one the driver would still report: `stale`, or its pid holds
 * its files (sim_pid_holds_files). */
int sim_process_present(const struct sim_process *process);

/*
 * Whether process `pid` still holds its open files, GPU contexts included: it exists and at
 * least one of its threads has not exited. A process closes its files when its last thread
 * exits, before it becomes a zombie, so a zombie holds nothing; a thread-group leader that
 * exited while other threads run shows as a zombie but still holds everything.
 */
int sim_pid_holds_files(unsigned pid);

/*
 * Mark this process as an NVML client for as long as the returned descriptor stays open (a
 * shared flock on the state file's directory, close-on-exec): the simulated nvidia-smi
 * refuses to reset while any client exists, as the driver does. Returns the descriptor or -1.
 */
int sim_client_attach(const char *path);

/* Set a boolean field of the GPU named `uuid` in the state file under the state lock; 0 or -1
 * with a message in err. */
int sim_set_gpu_bool(const char *path, const char *uuid, const char *key, int value, char *err, size_t errlen);

/* Sleep for `ms` milliseconds, resuming after signals. */
void sim_sleep_ms(unsigned ms);

/*
 * `nvidia-smi --gpu-reset -i ID[,ID...]` (ID = UUID, index or PCI bus id) against the state
 * file: the GPUs named are reset together. Prints what nvidia-smi would to `out`/`err` and
 * returns its exit status.
 */
int sim_reset_gpu(const char *path, const char *ids, FILE *out, FILE *err);

#endif
