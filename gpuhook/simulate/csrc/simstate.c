/*
 * Reading, validating and resetting the simulated NVML state; see simstate.h.
 */
#define _GNU_SOURCE
#include "simstate.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <dirent.h>
#include <unistd.h>

#ifndef SIM_STATE_PATH
#error "SIM_STATE_PATH must name the default state file (gpuhook simulate sets it)"
#endif

#define MAX_FILE_SIZE (16 << 20)

const char *const sim_brand_names[] = {
    "unknown", "quadro", "tesla", "nvs", "grid", "geforce", "titan", "nvidiavapps", "nvidiavpc",
    "nvidiavcs", "nvidiavws", "nvidiacloudgaming", "quadrortx", "nvidiartx", "nvidia",
    "geforcertx", "titanrtx",
};
const unsigned sim_brand_count = sizeof sim_brand_names / sizeof sim_brand_names[0];

static const char *const top_keys[] = {
    "format", "driver_version", "cuda_version", "nvml_version", "call_latency_ms",
    "init_latency_ms", "gpus", NULL,
};
static const char *const gpu_keys[] = {
    "uuid", "name", "brand", "minor", "bus_id", "pci_device_id", "pci_subsystem_id",
    "compute_capability", "memory_total", "memory_used", "memory_reserved", "persistence_mode",
    "reset_peers", "compute_processes",
    "graphics_processes", "ecc_enabled", "ecc_volatile_corrected", "ecc_volatile_uncorrected",
    "ecc_aggregate_corrected", "ecc_aggregate_uncorrected", "retired_pages_single_bit",
    "retired_pages_double_bit", "retired_pages_pending", "remapped_rows_correctable",
    "remapped_rows_uncorrectable", "remapped_rows_pending", "remapped_rows_failure", "lost",
    "mig_capable", "mig_mode", "mig_mode_pending", "mig_devices", "handle_latency_ms",
    "reset_fails", "reset_hangs", "reset_does_not_fix", "reset_latency_ms", "reset_count",
    "reset_overlaps", NULL,
};
static const char *const process_keys[] = {
    "pid", "used_memory", "gpu_instance_id", "compute_instance_id", "stale", NULL,
};
static const char *const mig_keys[] = {
    "gpu_instance_id", "compute_instance_id", "uuid", "profile", "memory_total", "memory_used", NULL,
};

const char *sim_state_path(void)
{
    const char *path = getenv(SIM_STATE_ENV);

    return path != NULL && *path != '\0' ? path : SIM_STATE_PATH;
}

void sim_sleep_ms(unsigned ms)
{
    struct timespec left = {ms / 1000, (long)(ms % 1000) * 1000000L};

    while (nanosleep(&left, &left) != 0 && errno == EINTR)
        ;
}

/* Validation helpers: each records the first problem as "<where>.<key>: <what>". */
struct check {
    char *err;
    size_t errlen;
    int failed;
};

static void bad(struct check *c, const char *where, const char *key, const char *fmt, ...)
{
    char what[200];
    va_list ap;

    if (c->failed)
        return;
    c->failed = 1;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(c->err, c->errlen, "%s%s%s: %s", where, *where && key ? "." : "", key ? key : "", what);
}

static void only_known(struct check *c, const struct sj *object, const char *const *known, const char *where)
{
    const struct sj *member;
    size_t i;

    for (member = object->child; member != NULL; member = member->next) {
        for (i = 0; known[i] != NULL; i++)
            if (strcmp(known[i], member->key) == 0)
                break;
        if (known[i] == NULL)
            bad(c, where, member->key, "unknown field (docs/simulated-host.md lists them)");
    }
}

static unsigned long long get_u64(struct check *c, const struct sj *object, const char *key,
                                  unsigned long long fallback, unsigned long long max, const char *where)
{
    const struct sj *v = sj_get(object, key);

    if (v == NULL)
        return fallback;
    if (v->type != SJ_NUMBER || !v->is_integer || v->integer < 0) {
        bad(c, where, key, "must be a whole number >= 0");
        return fallback;
    }
    if ((unsigned long long)v->integer > max) {
        bad(c, where, key, "must be at most %llu", max);
        return fallback;
    }
    return (unsigned long long)v->integer;
}

static unsigned get_uint(struct check *c, const struct sj *object, const char *key, unsigned fallback,
                         unsigned max, const char *where)
{
    return (unsigned)get_u64(c, object, key, fallback, max, where);
}

static int get_bool(struct check *c, const struct sj *object, const char *key, int fallback, const char *where)
{
    const struct sj *v = sj_get(object, key);

    if (v == NULL)
        return fallback;
    if (v->type != SJ_BOOL) {
        bad(c, where, key, "must be true or false");
        return fallback;
    }
    return v->boolean;
}

/* A string member; required ones must exist. Returns NULL when absent or bad. */
static const char *get_string(struct check *c, const struct sj *object, const char *key, int required,
                              size_t max_len, const char *where)
{
    const struct sj *v = sj_get(object, key);

    if (v == NULL) {
        if (required)
            bad(c, where, key, "is required");
        return NULL;
    }
    if (v->type != SJ_STRING || v->string[0] == '\0') {
        bad(c, where, key, "must be a non-empty string");
        return NULL;
    }
    if (strlen(v->string) >= max_len) {
        bad(c, where, key, "must be shorter than %zu bytes", max_len);
        return NULL;
    }
    return v->string;
}

/* "12.4" -> 12 and 4. */
static int parse_major_minor(const char *text, int *major, int *minor)
{
    char *end;
    long a, b;

    if (text[0] < '0' || text[0] > '9')
        return -1;
    a = strtol(text, &end, 10);
    if (*end != '.' || end[1] < '0' || end[1] > '9')
        return -1;
    b = strtol(end + 1, &end, 10);
    if (*end != '\0' || a > 999 || b > 99)
        return -1;
    *major = (int)a;
    *minor = (int)b;
    return 0;
}

int sim_parse_bus_id(const char *text, unsigned *domain, unsigned *bus, unsigned *device, unsigned *function)
{
    int n = -1;

    *function = 0;
    if (sscanf(text, "%x:%x:%x.%x%n", domain, bus, device, function, &n) == 4 && n == (int)strlen(text))
        goto check;
    n = -1;
    if (sscanf(text, "%x:%x:%x%n", domain, bus, device, &n) == 3 && n == (int)strlen(text))
        goto check;
    n = -1;
    *domain = 0;
    if (sscanf(text, "%x:%x.%x%n", bus, device, function, &n) == 3 && n == (int)strlen(text))
        goto check;
    return -1;
check:
    return *bus <= 0xff && *device <= 0x1f && *function <= 7 ? 0 : -1;
}

void sim_bus_id(const struct sim_gpu *gpu, char *out, size_t len)
{
    snprintf(out, len, "%08X:%02X:%02X.%X", gpu->domain, gpu->bus, gpu->device, gpu->function);
}

static struct sim_process *load_processes(struct check *c, const struct sj *gpu, const char *key,
                                          unsigned *count, const char *where)
{
    const struct sj *list = sj_get(gpu, key), *item;
    struct sim_process *out;
    char here[96];
    unsigned i = 0;

    *count = 0;
    if (list == NULL)
        return NULL;
    if (list->type != SJ_ARRAY) {
        bad(c, where, key, "must be a list of {\"pid\": N, \"used_memory\": BYTES}");
        return NULL;
    }
    if (sj_length(list) > SIM_MAX_PROCESSES) {
        bad(c, where, key, "lists more than %d processes", SIM_MAX_PROCESSES);
        return NULL;
    }
    if (sj_length(list) == 0)
        return NULL;
    if ((out = calloc(sj_length(list), sizeof *out)) == NULL) {
        bad(c, where, key, "out of memory");
        return NULL;
    }
    for (item = list->child; item != NULL; item = item->next, i++) {
        snprintf(here, sizeof here, "%s.%s[%u]", where, key, i);
        if (item->type != SJ_OBJECT) {
            bad(c, here, NULL, "must be an object");
            break;
        }
        only_known(c, item, process_keys, here);
        if (sj_get(item, "pid") == NULL)
            bad(c, here, "pid", "is required");
        out[i].pid = get_uint(c, item, "pid", 0, INT_MAX, here);
        out[i].used_memory = get_u64(c, item, "used_memory", 0, LLONG_MAX, here);
        out[i].gpu_instance_id = get_uint(c, item, "gpu_instance_id", SIM_NOT_AVAILABLE, SIM_NOT_AVAILABLE, here);
        out[i].compute_instance_id = get_uint(c, item, "compute_instance_id", SIM_NOT_AVAILABLE,
                                              SIM_NOT_AVAILABLE, here);
        out[i].stale = get_bool(c, item, "stale", 0, here);
    }
    *count = i;
    return out;
}

static void load_mig(struct check *c, const struct sj *gpu, struct sim_gpu *g, const char *where)
{
    const struct sj *list = sj_get(gpu, "mig_devices"), *item;
    char here[96];
    const char *s;
    unsigned i = 0, j;

    if (list == NULL)
        return;
    if (list->type != SJ_ARRAY) {
        bad(c, where, "mig_devices", "must be a list of MIG devices");
        return;
    }
    if (sj_length(list) > SIM_MAX_MIG) {
        bad(c, where, "mig_devices", "lists more than %d MIG devices", SIM_MAX_MIG);
        return;
    }
    for (item = list->child; item != NULL; item = item->next, i++) {
        struct sim_mig *m = &g->mig[i];

        snprintf(here, sizeof here, "%s.mig_devices[%u]", where, i);
        if (item->type != SJ_OBJECT) {
            bad(c, here, NULL, "must be an object");
            return;
        }
        only_known(c, item, mig_keys, here);
        if (sj_get(item, "gpu_instance_id") == NULL)
            bad(c, here, "gpu_instance_id", "is required");
        m->gpu_instance_id = get_uint(c, item, "gpu_instance_id", 0, 14, here);
        m->compute_instance_id = get_uint(c, item, "compute_instance_id", 0, 7, here);
        if ((s = get_string(c, item, "uuid", 1, sizeof m->uuid, here)) != NULL) {
            if (strncmp(s, "MIG-", 4) != 0)
                bad(c, here, "uuid", "must start with MIG-");
            strcpy(m->uuid, s);
        }
        if ((s = get_string(c, item, "profile", 1, sizeof m->profile, here)) != NULL)
            strcpy(m->profile, s);
        m->memory_total = get_u64(c, item, "memory_total", 0, LLONG_MAX, here);
        m->memory_used = get_u64(c, item, "memory_used", 0, LLONG_MAX, here);
        for (j = 0; j < i; j++)
            if (g->mig[j].gpu_instance_id == m->gpu_instance_id &&
                g->mig[j].compute_instance_id == m->compute_instance_id)
                bad(c, here, NULL, "GPU instance %u compute instance %u is listed twice",
                    m->gpu_instance_id, m->compute_instance_id);
    }
    g->nmig = i;
}

/* "reset_peers": the GPU UUIDs the driver resets only together with this GPU (NVLink). */
static void load_peers(struct check *c, const struct sj *gpu, struct sim_gpu *g, const char *where)
{
    const struct sj *list = sj_get(gpu, "reset_peers"), *item;

    g->npeers = 0;
    if (list == NULL)
        return;
    if (list->type != SJ_ARRAY || sj_length(list) > SIM_MAX_PEERS) {
        bad(c, where, "reset_peers", "must be a list of at most %d GPU UUIDs", SIM_MAX_PEERS);
        return;
    }
    for (item = list->child; item != NULL; item = item->next) {
        if (item->type != SJ_STRING || strncmp(item->string, "GPU-", 4) != 0 ||
            strlen(item->string) >= SIM_TEXT_LEN) {
            bad(c, where, "reset_peers", "must list GPU UUIDs (GPU-...)");
            return;
        }
        strcpy(g->reset_peers[g->npeers++], item->string);
    }
}

static void load_gpu(struct check *c, const struct sj *node, struct sim_gpu *g, const char *where)
{
    const char *s;

    if (node->type != SJ_OBJECT) {
        bad(c, where, NULL, "must be an object");
        return;
    }
    only_known(c, node, gpu_keys, where);
    if ((s = get_string(c, node, "uuid", 1, sizeof g->uuid, where)) != NULL) {
        if (strncmp(s, "GPU-", 4) != 0)
            bad(c, where, "uuid", "must start with GPU-");
        strcpy(g->uuid, s);
    }
    if ((s = get_string(c, node, "name", 1, sizeof g->name, where)) != NULL)
        strcpy(g->name, s);
    g->brand = 0;
    if ((s = get_string(c, node, "brand", 0, 32, where)) != NULL) {
        for (g->brand = 0; g->brand < sim_brand_count; g->brand++)
            if (strcmp(s, sim_brand_names[g->brand]) == 0)
                break;
        if (g->brand == sim_brand_count)
            bad(c, where, "brand", "unknown brand '%s'", s);
    }
    if (sj_get(node, "minor") == NULL)
        bad(c, where, "minor", "is required");
    g->minor = get_uint(c, node, "minor", 0, 253, where);
    if ((s = get_string(c, node, "bus_id", 1, 32, where)) != NULL &&
        sim_parse_bus_id(s, &g->domain, &g->bus, &g->device, &g->function) != 0)
        bad(c, where, "bus_id", "must look like 00000000:18:00.0, not '%s'", s);
    g->pci_device_id = get_uint(c, node, "pci_device_id", 0x233010DE, UINT_MAX, where);
    g->pci_subsystem_id = get_uint(c, node, "pci_subsystem_id", 0, UINT_MAX, where);
    g->cc_major = 9;
    g->cc_minor = 0;
    if ((s = get_string(c, node, "compute_capability", 0, 16, where)) != NULL &&
        parse_major_minor(s, &g->cc_major, &g->cc_minor) != 0)
        bad(c, where, "compute_capability", "must look like 9.0, not '%s'", s);
    g->memory_total = get_u64(c, node, "memory_total", 0, LLONG_MAX, where);
    g->memory_used = get_u64(c, node, "memory_used", 0, LLONG_MAX, where);
    g->memory_reserved = get_u64(c, node, "memory_reserved", 0, LLONG_MAX, where);
    g->persistence_mode = get_bool(c, node, "persistence_mode", 0, where);
    load_peers(c, node, g, where);
    g->compute = load_processes(c, node, "compute_processes", &g->ncompute, where);
    g->graphics = load_processes(c, node, "graphics_processes", &g->ngraphics, where);
    g->ecc_enabled = get_bool(c, node, "ecc_enabled", 1, where);
    g->ecc[0][0] = get_u64(c, node, "ecc_volatile_corrected", 0, LLONG_MAX, where);
    g->ecc[0][1] = get_u64(c, node, "ecc_volatile_uncorrected", 0, LLONG_MAX, where);
    g->ecc[1][0] = get_u64(c, node, "ecc_aggregate_corrected", 0, LLONG_MAX, where);
    g->ecc[1][1] = get_u64(c, node, "ecc_aggregate_uncorrected", 0, LLONG_MAX, where);
    g->retired_single_bit = get_uint(c, node, "retired_pages_single_bit", 0, 4096, where);
    g->retired_double_bit = get_uint(c, node, "retired_pages_double_bit", 0, 4096, where);
    g->retired_pending = get_bool(c, node, "retired_pages_pending", 0, where);
    g->remapped_correctable = get_uint(c, node, "remapped_rows_correctable", 0, UINT_MAX, where);
    g->remapped_uncorrectable = get_uint(c, node, "remapped_rows_uncorrectable", 0, UINT_MAX, where);
    g->remapped_pending = get_bool(c, node, "remapped_rows_pending", 0, where);
    g->remapped_failure = get_bool(c, node, "remapped_rows_failure", 0, where);
    g->lost = get_bool(c, node, "lost", 0, where);
    g->mig_capable = get_bool(c, node, "mig_capable", 0, where);
    g->mig_mode = get_bool(c, node, "mig_mode", 0, where);
    g->mig_mode_pending = get_bool(c, node, "mig_mode_pending", g->mig_mode, where);
    if ((g->mig_mode || g->mig_mode_pending) && !g->mig_capable)
        bad(c, where, "mig_mode", "needs \"mig_capable\": true");
    load_mig(c, node, g, where);
    g->handle_latency_ms = get_uint(c, node, "handle_latency_ms", 0, 3600000, where);
    g->reset_fails = get_bool(c, node, "reset_fails", 0, where);
    g->reset_hangs = get_bool(c, node, "reset_hangs", 0, where);
    g->reset_does_not_fix = get_bool(c, node, "reset_does_not_fix", 0, where);
    g->reset_latency_ms = get_uint(c, node, "reset_latency_ms", 0, 3600000, where);
    (void)get_uint(c, node, "reset_count", 0, UINT_MAX, where);
    (void)get_uint(c, node, "reset_overlaps", 0, UINT_MAX, where);
}

static void validate_unique(struct check *c, const struct sim_state *s)
{
    unsigned i, j, k;
    char where[32];

    for (i = 0; i < s->ngpus; i++) {
        snprintf(where, sizeof where, "gpus[%u]", i);
        for (k = 0; k < s->gpus[i].npeers; k++) {
            for (j = 0; j < s->ngpus; j++)
                if (j != i && strcmp(s->gpus[j].uuid, s->gpus[i].reset_peers[k]) == 0)
                    break;
            if (j == s->ngpus)
                bad(c, where, "reset_peers", "%s is not another GPU of this host", s->gpus[i].reset_peers[k]);
        }
        for (j = 0; j < i; j++) {
            if (strcmp(s->gpus[i].uuid, s->gpus[j].uuid) == 0)
                bad(c, where, "uuid", "same as gpus[%u]", j);
            if (s->gpus[i].minor == s->gpus[j].minor)
                bad(c, where, "minor", "same as gpus[%u]", j);
            if (s->gpus[i].domain == s->gpus[j].domain && s->gpus[i].bus == s->gpus[j].bus &&
                s->gpus[i].device == s->gpus[j].device && s->gpus[i].function == s->gpus[j].function)
                bad(c, where, "bus_id", "same as gpus[%u]", j);
            for (k = 0; k < s->gpus[i].nmig; k++) {
                unsigned m;
                for (m = 0; m < s->gpus[j].nmig; m++)
                    if (strcmp(s->gpus[i].mig[k].uuid, s->gpus[j].mig[m].uuid) == 0)
                        bad(c, where, "mig_devices", "MIG uuid %s is also on gpus[%u]", s->gpus[i].mig[k].uuid, j);
            }
        }
    }
}

static char *read_file(const char *path, size_t *len, int *errno_out, char *err, size_t errlen)
{
    struct stat st;
    char *text = NULL;
    size_t done = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    if (fd < 0) {
        *errno_out = errno;
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return NULL;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > MAX_FILE_SIZE) {
        *errno_out = errno ? errno : EINVAL;
        snprintf(err, errlen, "%s: not a regular file of at most %d bytes", path, MAX_FILE_SIZE);
        goto out;
    }
    if ((text = malloc((size_t)st.st_size + 1)) == NULL) {
        *errno_out = ENOMEM;
        snprintf(err, errlen, "%s: out of memory", path);
        goto out;
    }
    while (done < (size_t)st.st_size) {
        ssize_t n = read(fd, text + done, (size_t)st.st_size - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            *errno_out = n < 0 ? errno : EIO;
            snprintf(err, errlen, "%s: %s", path, n < 0 ? strerror(errno) : "file shrank while reading");
            free(text);
            text = NULL;
            goto out;
        }
        done += (size_t)n;
    }
    text[done] = '\0';
    *len = done;
out:
    close(fd);
    return text;
}

int sim_state_load(const char *path, struct sim_state *s, int *errno_out, char *err, size_t errlen)
{
    struct check c = {err, errlen, 0};
    char perr[200], where[32];
    const struct sj *gpus, *item;
    const char *text_value;
    size_t len = 0;
    char *text;
    unsigned i = 0;
    int major = 0, minor = 0;

    memset(s, 0, sizeof *s);
    *errno_out = 0;
    if ((text = read_file(path, &len, errno_out, err, errlen)) == NULL)
        return -1;
    s->doc = sj_parse(text, len, perr, sizeof perr);
    free(text);
    if (s->doc == NULL) {
        snprintf(err, errlen, "%s: not valid JSON: %s", path, perr);
        return -1;
    }
    if (s->doc->type != SJ_OBJECT) {
        snprintf(err, errlen, "%s: the state must be a JSON object", path);
        goto fail;
    }
    only_known(&c, s->doc, top_keys, "");
    if (get_uint(&c, s->doc, "format", SIM_FORMAT, UINT_MAX, "") != SIM_FORMAT)
        bad(&c, "", "format", "this library reads format %d", SIM_FORMAT);
    if ((text_value = get_string(&c, s->doc, "driver_version", 1, 64, "")) != NULL)
        strcpy(s->driver_version, text_value);
    if ((text_value = get_string(&c, s->doc, "cuda_version", 1, 16, "")) != NULL) {
        if (parse_major_minor(text_value, &major, &minor) != 0)
            bad(&c, "", "cuda_version", "must look like 12.4, not '%s'", text_value);
        else
            s->cuda_version = major * 1000 + minor * 10;
    }
    if ((text_value = get_string(&c, s->doc, "nvml_version", 0, sizeof s->nvml_version, "")) != NULL)
        strcpy(s->nvml_version, text_value);
    else
        snprintf(s->nvml_version, sizeof s->nvml_version, "%d.%.63s", major, s->driver_version);
    s->call_latency_ms = get_uint(&c, s->doc, "call_latency_ms", 0, 3600000, "");
    s->init_latency_ms = get_uint(&c, s->doc, "init_latency_ms", 0, 3600000, "");
    gpus = sj_get(s->doc, "gpus");
    if (gpus == NULL || gpus->type != SJ_ARRAY)
        bad(&c, "", "gpus", "must be a list of GPUs");
    else if (sj_length(gpus) > SIM_MAX_GPUS)
        bad(&c, "", "gpus", "lists more than %d GPUs", SIM_MAX_GPUS);
    else if (sj_length(gpus) > 0 && (s->gpus = calloc(sj_length(gpus), sizeof *s->gpus)) == NULL)
        bad(&c, "", "gpus", "out of memory");
    else
        for (item = gpus->child; item != NULL && !c.failed; item = item->next, i++) {
            snprintf(where, sizeof where, "gpus[%u]", i);
            s->ngpus = i + 1;  /* so sim_state_free releases what load_gpu allocated */
            load_gpu(&c, item, &s->gpus[i], where);
        }
    if (!c.failed)
        validate_unique(&c, s);
    if (c.failed) {
        char why[SIM_MESSAGE_LEN];
        snprintf(why, sizeof why, "%s", err);
        snprintf(err, errlen, "%s: %s", path, why);
        goto fail;
    }
    return 0;
fail:
    sim_state_free(s);
    return -1;
}

void sim_state_free(struct sim_state *s)
{
    unsigned i;

    for (i = 0; i < s->ngpus; i++) {
        free(s->gpus[i].compute);
        free(s->gpus[i].graphics);
    }
    free(s->gpus);
    sj_free(s->doc);
    memset(s, 0, sizeof *s);
}

/* The state letter of /proc/<path>/stat ('R', 'S', 'Z', ...), or 0 when it cannot be read. */
static char stat_state(const char *path)
{
    char text[512], *paren;
    ssize_t n;
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    if (fd < 0)
        return 0;
    n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return 0;
    text[n] = '\0';
    /* "pid (comm) S ...": the command may hold spaces and parentheses; the state follows the last ')'. */
    if ((paren = strrchr(text, ')')) == NULL || paren[1] != ' ')
        return 0;
    return paren[2];
}

int sim_pid_holds_files(unsigned pid)
{
    char path[64];
    struct dirent *entry;
    DIR *tasks;
    char state;
    int live = 0;

    if (pid == 0 || pid > INT_MAX)
        return 0;
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    state = stat_state(path);
    if (state == 0)
        return 0;
    if (state != 'Z' && state != 'X')
        return 1;
    /* A zombie leader: do other threads of its group still run? */
    snprintf(path, sizeof path, "/proc/%u/task", pid);
    if ((tasks = opendir(path)) == NULL)
        return 0;
    while (!live && (entry = readdir(tasks)) != NULL) {
        char task[300];

        if (entry->d_name[0] == '.')
            continue;
        snprintf(task, sizeof task, "/proc/%u/task/%s/stat", pid, entry->d_name);
        state = stat_state(task);
        live = state != 0 && state != 'Z' && state != 'X';
    }
    closedir(tasks);
    return live;
}

int sim_process_present(const struct sim_process *p)
{
    /* The driver drops a process's contexts when its device files are closed, that is when
     * its last thread exits: a zombie is no longer reported. `stale` keeps an entry anyway
     * (a context left behind). */
    return p->stale || sim_pid_holds_files(p->pid);
}

/* The directory of the state file, opened for an flock: the clients' lock lives on it, so an
 * NVML client creates no file (a real driver's clients leave none either). */
static int open_state_dir(const char *path)
{
    char dir[4096];
    char *slash;

    if ((size_t)snprintf(dir, sizeof dir, "%s", path) >= sizeof dir)
        return -1;
    if ((slash = strrchr(dir, '/')) == NULL)
        snprintf(dir, sizeof dir, ".");
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    return open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

int sim_client_attach(const char *path)
{
    int fd = open_state_dir(path);

    if (fd < 0)
        return -1;
    /* Blocks only while a reset holds it exclusively: NVML waits for a reset to end. */
    while (flock(fd, LOCK_SH) != 0) {
        if (errno != EINTR) {
            close(fd);
            return -1;
        }
    }
    return fd;
}

/* An flock on "<path><suffix>"; returns the fd, -1 with errno set (EWOULDBLOCK if busy). */
static int lock_file(const char *path, const char *suffix, int nonblocking)
{
    char name[4096];
    int fd;

    if ((size_t)snprintf(name, sizeof name, "%s%s", path, suffix) >= sizeof name) {
        errno = ENAMETOOLONG;
        return -1;
    }
    if ((fd = open(name, O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0)
        return -1;
    while (flock(fd, LOCK_EX | (nonblocking ? LOCK_NB : 0)) != 0) {
        int saved = errno;

        if (saved == EINTR)
            continue;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

/* Replace the state file with `doc`, atomically. */
static int write_doc(const char *path, const struct sj *doc, char *err, size_t errlen)
{
    char tmp[4096];
    FILE *f;
    int fd;

    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= sizeof tmp) {
        snprintf(err, errlen, "%s: path too long", path);
        return -1;
    }
    if ((fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0 || (f = fdopen(fd, "w")) == NULL) {
        snprintf(err, errlen, "%s: %s", tmp, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    if (sj_write(f, doc) != 0 || fflush(f) != 0 || fsync(fileno(f)) != 0) {
        snprintf(err, errlen, "%s: %s", tmp, strerror(errno));
        fclose(f);
        unlink(tmp);
        return -1;
    }
    fclose(f);
    if (rename(tmp, path) != 0) {
        snprintf(err, errlen, "rename %s: %s", tmp, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* The GPU named by a UUID, an index or a PCI bus id; -1 when none matches. */
static int find_gpu(const struct sim_state *s, const char *id)
{
    unsigned i, domain, bus, device, function;
    char *end;
    long index;

    for (i = 0; i < s->ngpus; i++)
        if (strcasecmp(s->gpus[i].uuid, id) == 0)
            return (int)i;
    index = strtol(id, &end, 10);
    if (*id != '\0' && *end == '\0')
        return index >= 0 && index < (long)s->ngpus ? (int)index : -1;
    if (sim_parse_bus_id(id, &domain, &bus, &device, &function) == 0)
        for (i = 0; i < s->ngpus; i++)
            if (s->gpus[i].domain == domain && s->gpus[i].bus == bus && s->gpus[i].device == device &&
                s->gpus[i].function == function)
                return (int)i;
    return -1;
}

static struct sj *gpu_node(const struct sim_state *s, int index)
{
    struct sj *item = sj_get(s->doc, "gpus")->child;

    while (index-- > 0)
        item = item->next;
    return item;
}

static long long get_count(const struct sj *gpu, const char *key)
{
    const struct sj *v = sj_get(gpu, key);

    return v != NULL && v->type == SJ_NUMBER && v->is_integer ? v->integer : 0;
}

/* Count a reset that overlapped another one on the same GPU (for tests of the per-GPU locks, docs/health.md). */
static void record_overlap(const char *path, const char *uuid, FILE *err)
{
    struct sim_state s;
    char msg[SIM_MESSAGE_LEN];
    int lock, e, index;

    if ((lock = lock_file(path, ".lock", 0)) < 0)
        return;
    if (sim_state_load(path, &s, &e, msg, sizeof msg) == 0) {
        if ((index = find_gpu(&s, uuid)) >= 0) {
            struct sj *gpu = gpu_node(&s, index);
            if (sj_set_integer(gpu, "reset_overlaps", get_count(gpu, "reset_overlaps") + 1) != 0 ||
                write_doc(path, s.doc, msg, sizeof msg) != 0)
                fprintf(err, "nvidia-smi (simulated): could not record the overlapping reset: %s\n", msg);
        }
        sim_state_free(&s);
    }
    close(lock);
}

int sim_set_gpu_bool(const char *path, const char *uuid, const char *key, int value, char *err, size_t errlen)
{
    struct sim_state s;
    int lock, e, index, status = -1;

    if ((lock = lock_file(path, ".lock", 0)) < 0) {
        snprintf(err, errlen, "%s.lock: %s", path, strerror(errno));
        return -1;
    }
    if (sim_state_load(path, &s, &e, err, errlen) == 0) {
        if ((index = find_gpu(&s, uuid)) < 0)
            snprintf(err, errlen, "no GPU %s in %s", uuid, path);
        else if (sj_set_bool(gpu_node(&s, index), key, value) != 0)
            snprintf(err, errlen, "out of memory");
        else
            status = write_doc(path, s.doc, err, errlen);
        sim_state_free(&s);
    }
    close(lock);
    return status;
}

/* NVIDIA's words when a GPU to reset has another client (an NVML session, persistence mode,
 * a process): the listing nvidia-smi prints, as NVIDIA's gpu-operator and NVSentinel issues
 * quote it. */
static void print_in_use(FILE *err, const char *bus)
{
    fprintf(err, "The following GPUs could not be reset:\n  GPU %s: In use by another client\n\n"
                 "1 device is currently being used by one or more other processes (e.g. Fabric Manager, CUDA "
                 "application, graphics application such as an X server, or a monitoring application such as "
                 "another instance of nvidia-smi). Please first kill all processes using this device and all "
                 "compute applications running in the system.\n", bus);
}

/* Whether another process is an NVML client (holds the state file's directory shared).
 * Concurrent resets take turns at this test (a blocking lock), so one reset's test never
 * reads as another's client. */
static int other_clients(const char *path)
{
    int fd, turn, busy = 0;

    if ((turn = lock_file(path, SIM_CLIENTS_SUFFIX "-test", 0)) < 0)
        return 0;
    if ((fd = open_state_dir(path)) >= 0) {
        while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            if (errno == EINTR)
                continue;
            busy = errno == EWOULDBLOCK;
            break;
        }
        close(fd);
    }
    close(turn);
    return busy;
}

#define SIM_MAX_RESET SIM_MAX_GPUS

/* Reset one GPU in the loaded document `s` (its index `index`): clear what a reset clears. */
static int apply_reset(struct sim_state *s, int index)
{
    struct sim_gpu *g = &s->gpus[index];
    struct sj *gpu = gpu_node(s, index), *mig;
    int rc = 0;

    if (!g->reset_does_not_fix) {
        /* What a reset clears: volatile ECC counts, memory, processes; it applies pending row
         * remaps, page retirements and MIG mode changes, and destroys MIG GPU and compute
         * instances (they do not survive a reset). Aggregate counts survive. */
        rc |= sj_set_integer(gpu, "ecc_volatile_corrected", 0);
        rc |= sj_set_integer(gpu, "ecc_volatile_uncorrected", 0);
        rc |= sj_set_bool(gpu, "retired_pages_pending", 0);
        rc |= sj_set_bool(gpu, "remapped_rows_pending", 0);
        rc |= sj_set_integer(gpu, "memory_used", 0);
        rc |= sj_set_empty_array(gpu, "compute_processes");
        rc |= sj_set_empty_array(gpu, "graphics_processes");
        rc |= sj_set_bool(gpu, "mig_mode", g->mig_mode_pending);
        if ((mig = sj_get(gpu, "mig_devices")) != NULL && mig->type == SJ_ARRAY && mig->child != NULL)
            rc |= sj_set_empty_array(gpu, "mig_devices");
    }
    rc |= sj_set_integer(gpu, "reset_count", get_count(gpu, "reset_count") + 1);
    return rc;
}

int sim_reset_gpu(const char *path, const char *ids, FILE *out, FILE *err)
{
    struct sim_state s;
    char msg[SIM_MESSAGE_LEN], bus[32], list[1024];
    char uuids[SIM_MAX_RESET][SIM_TEXT_LEN];
    int chosen[SIM_MAX_GPUS] = {0};
    int locks[SIM_MAX_RESET];
    int e, n = 0, i, j, state_lock = -1, status = 255, fails = 0;
    unsigned k, latency = 0;
    const char *p = ids;

    if (sim_state_load(path, &s, &e, msg, sizeof msg) != 0) {
        fprintf(err, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver "
                     "(simulated: %s)\n", msg);
        return 9;
    }
    /* -i takes a comma-separated list, as nvidia-smi's does. */
    while (*p != '\0') {
        char id[SIM_TEXT_LEN];
        size_t len = strcspn(p, ",");
        int index;

        if (len == 0 || len >= sizeof id || n >= SIM_MAX_RESET) {
            fprintf(err, "Invalid combination of input arguments.\n");
            sim_state_free(&s);
            return 2;
        }
        memcpy(id, p, len);
        id[len] = '\0';
        p += len + (p[len] == ',');
        if ((index = find_gpu(&s, id)) < 0) {
            fprintf(err, "No devices were found matching \"%s\"\n", id);
            sim_state_free(&s);
            return 6;
        }
        if (!chosen[index]) {
            chosen[index] = 1;
            strcpy(uuids[n++], s.gpus[index].uuid);
        }
    }
    for (i = 0; i < (int)s.ngpus; i++) {
        struct sim_gpu *g = &s.gpus[i];

        if (!chosen[i])
            continue;
        sim_bus_id(g, bus, sizeof bus);
        if (g->lost) {
            fprintf(err, "Unable to reset GPU %s: GPU is lost\n", bus);
            sim_state_free(&s);
            return 15;
        }
        /* NVLink: "Any GPUs with NVLink connections to a GPU being reset must also be reset in
         * the same command ... this command will issue an error identifying the additional
         * GPUs" (nvidia-smi(1), -r). The wording here is the simulation's own. */
        list[0] = '\0';
        for (k = 0; k < g->npeers; k++) {
            for (j = 0; j < (int)s.ngpus && strcmp(s.gpus[j].uuid, g->reset_peers[k]) != 0; j++)
                ;
            if (j < (int)s.ngpus && !chosen[j]) {
                char peer[32];

                sim_bus_id(&s.gpus[j], peer, sizeof peer);
                snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", list[0] ? ", " : "", peer);
            }
        }
        if (list[0]) {
            fprintf(err, "Unable to reset GPU %s: it is connected through NVLink to GPUs that must be reset in "
                         "the same command: %s\n", bus, list);
            goto refuse;
        }
        if (g->persistence_mode) {
            print_in_use(err, bus);  /* persistence mode attaches the driver to the GPU */
            goto refuse;
        }
        for (k = 0; k < g->ncompute + g->ngraphics; k++) {
            const struct sim_process *proc = k < g->ncompute ? &g->compute[k] : &g->graphics[k - g->ncompute];
            if (sim_pid_holds_files(proc->pid)) {
                fprintf(err, "Unable to reset this GPU because it's being used by some other process "
                             "(e.g. CUDA application, graphics application like X server, monitoring "
                             "application like other instance of nvidia-smi). Please first kill all "
                             "processes using this GPU and all compute applications running in the "
                             "system. (simulated: pid %u is alive)\n", proc->pid);
                goto refuse;
            }
        }
        if (g->reset_hangs) {
            /* A reset that never returns: whoever runs it must bound it with a timeout. */
            fprintf(out, "Resetting GPU %s ...\n", bus);
            fflush(out);
            sim_state_free(&s);
            for (;;)
                pause();
        }
        latency = g->reset_latency_ms > latency ? g->reset_latency_ms : latency;
        fails |= g->reset_fails;
    }
    for (i = 0; i < (int)s.ngpus; i++)
        if (chosen[i]) {
            sim_bus_id(&s.gpus[i], bus, sizeof bus);
            break;
        }
    sim_state_free(&s);
    /* An NVML client anywhere (gpuhook's own sessions included) keeps the GPUs attached. */
    if (other_clients(path)) {
        print_in_use(err, bus);
        return 255;
    }

    /* The driver refuses a second reset of a GPU while one is in progress. */
    for (i = 0; i < n; i++)
        locks[i] = -1;
    for (i = 0; i < n; i++) {
        snprintf(msg, sizeof msg, ".reset-%.*s.lock", SIM_TEXT_LEN - 1, uuids[i]);
        if ((locks[i] = lock_file(path, msg, 1)) < 0) {
            if (errno == EWOULDBLOCK) {
                record_overlap(path, uuids[i], err);
                fprintf(err, "Unable to reset GPU %s: a reset of this GPU is already in progress\n", bus);
            } else {
                fprintf(err, "Unable to reset GPU %s: simulated reset lock: %s\n", bus, strerror(errno));
            }
            goto out;
        }
    }
    sim_sleep_ms(latency);
    if (fails) {
        fprintf(err, "Unable to reset GPU %s: Unknown Error\n", bus);
        goto out;
    }
    if ((state_lock = lock_file(path, ".lock", 0)) < 0) {
        fprintf(err, "Unable to reset GPU %s: simulated state lock: %s\n", bus, strerror(errno));
        goto out;
    }
    /* Read again under the lock: the file may have changed while the reset "ran". */
    if (sim_state_load(path, &s, &e, msg, sizeof msg) != 0) {
        fprintf(err, "Unable to reset GPU %s: %s\n", bus, msg);
        goto out;
    }
    for (i = 0; i < n; i++) {
        int index = find_gpu(&s, uuids[i]);

        if (index < 0) {
            fprintf(err, "Unable to reset GPU %s: it disappeared from %s\n", bus, path);
            goto free_state;
        }
        for (k = 0; k < s.gpus[index].ncompute + s.gpus[index].ngraphics; k++) {
            const struct sim_gpu *g = &s.gpus[index];
            const struct sim_process *proc = k < g->ncompute ? &g->compute[k] : &g->graphics[k - g->ncompute];
            if (sim_pid_holds_files(proc->pid)) {
                fprintf(err, "Unable to reset this GPU because it's being used by some other process "
                             "(simulated: pid %u is alive)\n", proc->pid);
                goto free_state;
            }
        }
        if (apply_reset(&s, index) != 0) {
            fprintf(err, "Unable to reset GPU %s: out of memory\n", bus);
            goto free_state;
        }
    }
    if (write_doc(path, s.doc, msg, sizeof msg) != 0) {
        fprintf(err, "Unable to reset GPU %s: %s\n", bus, msg);
        goto free_state;
    }
    for (i = 0; i < n; i++) {
        int index = find_gpu(&s, uuids[i]);

        sim_bus_id(&s.gpus[index], bus, sizeof bus);
        fprintf(out, "GPU %s was successfully reset.\n", bus);
    }
    fprintf(out, "All done.\n");
    status = 0;
free_state:
    sim_state_free(&s);
out:
    if (state_lock >= 0)
        close(state_lock);
    for (i = 0; i < n; i++)
        if (locks[i] >= 0)
            close(locks[i]);
    return status;
refuse:
    sim_state_free(&s);
    return 255;
}
