/* gpuhook-prescan: the hook's no-GPU path without starting Python (a prototype; built by
 * native/build.py, measured by benchmarks/run.py's runc group, written up in
 * benchmarks/README.md, "The native prescan").
 *
 *     gpuhook-prescan PYTHON [FLAGS...] .../gpuhook/launch.py STAGE [--config FILE]
 *
 * argv[1..] is the Python hook's own command line, as hooks.d registers it today. This program
 * decides nothing gpuhook's Python does not: it exits 0 only when neither the OCI state (stdin)
 * nor the bundle's config.json contains any of gpuhook/prescan.py's MARKERS, nor a \u escape
 * that could spell one (markers.h is generated from prescan.py at build time), i.e. only where
 * gpuhook.entry would also exit 0 on its fast path. In every other case (a marker, anything it
 * cannot read or parse, an invocation other than a plain hook stage) it execs the Python hook,
 * handing it the state bytes it read as its stdin, on a memfd.
 *
 * Hostile input (the state and config.json come from whoever made the container): every read
 * is bounded by prescan.py's limits, the scanner never indexes past its buffer, config.json is
 * opened non-blocking and read only when it is a regular file, the bundle path is bounded and
 * must be plain ASCII. tests/unit/test_native_prescan.py runs prescan.py's corpus and random
 * mutations of it through this program.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "markers.h"

extern char **environ;

struct buf {
	unsigned char *data;
	size_t len;
};

/* Read fd until EOF or `limit` bytes; 0 on success, -1 on a read error. */
static int read_bounded(int fd, size_t limit, size_t hint, struct buf *out)
{
	size_t cap = hint ? hint + 1 : 65536;
	if (cap > limit)
		cap = limit;
	out->data = malloc(cap ? cap : 1);
	out->len = 0;
	if (!out->data)
		return -1;
	while (out->len < limit) {
		if (out->len == cap) {
			size_t next = cap * 2 > limit ? limit : cap * 2;
			unsigned char *grown = realloc(out->data, next);
			if (!grown)
				return -1;
			out->data = grown;
			cap = next;
		}
		ssize_t got = read(fd, out->data + out->len, cap - out->len);
		if (got < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		if (got == 0)
			break;
		out->len += (size_t)got;
	}
	return 0;
}

static int hexval(unsigned char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

static int is_marker_char(unsigned code)
{
	for (size_t i = 0; i < sizeof MARKER_CHARS; i++)
		if (MARKER_CHARS[i] == code)
			return 1;
	return 0;
}

/* 1 when `d` might carry a GPU request (a marker, or a \u escape that is not plain hex or
 * that spells a marker character), 0 when it certainly does not. */
static int may_request(const unsigned char *d, size_t n)
{
	for (size_t m = 0; m < MARKER_COUNT; m++)
		if (memmem(d, n, MARKERS[m], strlen(MARKERS[m])))
			return 1;
	const unsigned char *p = d, *end = d + n;
	while ((p = memmem(p, (size_t)(end - p), "\\u", 2)) != NULL) {
		if (end - p < 6)
			return 1;
		unsigned code = 0;
		for (int k = 2; k < 6; k++) {
			int v = hexval(p[k]);
			if (v < 0)
				return 1;
			code = code * 16 + (unsigned)v;
		}
		if (is_marker_char(code))
			return 1;
		p += 2;
	}
	return 0;
}

/* The raw value of the top-level "bundle" member of a JSON object, as prescan.py's
 * top_level_strings reads it (nested values skipped, escaped quotes honoured, the last of
 * duplicate keys wins). 1 found, 0 not there, -1 not a well-formed-looking object. */
static int top_level_bundle(const unsigned char *d, size_t n, const unsigned char **val, size_t *vlen)
{
	size_t i = 0, klen = 0;
	long depth = 0;
	int expecting_key = 0, have_key = 0, found = 0;
	const unsigned char *key = NULL;
	while (i < n) {
		unsigned char c = d[i];
		if (c == '"') {
			size_t j = i + 1;
			for (;;) {
				const unsigned char *q = j < n ? memchr(d + j, '"', n - j) : NULL;
				if (!q)
					return -1;
				j = (size_t)(q - d);
				size_t k = j;
				while (d[k - 1] == '\\')  /* stops at the opening quote, d[i] */
					k--;
				if ((j - k) % 2 == 0)
					break;
				j++;
			}
			if (depth == 1) {
				if (expecting_key) {
					key = d + i + 1;
					klen = j - i - 1;
					have_key = 1;
					expecting_key = 0;
				} else if (have_key) {
					if (klen == 6 && memcmp(key, "bundle", 6) == 0) {
						*val = d + i + 1;
						*vlen = j - i - 1;
						found = 1;
					}
					have_key = 0;
				}
			}
			i = j + 1;
			continue;
		}
		if (c == '{' || c == '[') {
			depth++;
			if (depth == 1) {
				if (c != '{')
					return -1;
				expecting_key = 1;
			} else if (depth == 2) {
				have_key = 0;
			}
		} else if (c == '}' || c == ']') {
			depth--;
			if (depth == 0)
				return found;
			if (depth < 0)
				return -1;
		} else if (c == ',' && depth == 1) {
			expecting_key = 1;
			have_key = 0;
		}
		i++;
	}
	return -1;
}

/* 1 when the hook would read config.json at `bundle` and find no request there: the
 * bundle path must be one prescan.bundle_of accepts (absolute, no escape, no control byte,
 * ASCII here: anything else is the Python hook's to judge). */
static int config_has_no_request(const unsigned char *bundle, size_t blen)
{
	static const char name[] = "/config.json";
	char path[4096];
	if (blen == 0 || bundle[0] != '/' || blen + sizeof name > sizeof path)
		return 0;
	for (size_t i = 0; i < blen; i++)
		if (bundle[i] == '\\' || bundle[i] < 0x20 || bundle[i] >= 0x80)
			return 0;
	memcpy(path, bundle, blen);
	memcpy(path + blen, name, sizeof name);
	/* Non-blocking: a FIFO planted there must not hold the runtime (prescan.read_regular_file). */
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return 0;
	struct stat st;
	struct buf spec = {0};
	int none = 0;
	if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
	    read_bounded(fd, MAX_CONFIG_BYTES + 1, (size_t)st.st_size, &spec) == 0 &&
	    spec.len <= MAX_CONFIG_BYTES)
		none = !may_request(spec.data, spec.len);
	free(spec.data);
	close(fd);
	return none;
}

/* argv as `PYTHON ... .../gpuhook/launch.py STAGE [--config F | --config=F]...`, the plain hook
 * invocation gpuhook.entry serves on its fast path (prescan.split_hook_args): the index of the
 * launcher in argv, or 0 for any other invocation. */
static int plain_hook_invocation(int argc, char **argv)
{
	int at = -1;
	for (int i = 2; i < argc; i++) {
		size_t len = strlen(argv[i]);
		if (len >= 18 && strcmp(argv[i] + len - 18, "/gpuhook/launch.py") == 0) {
			at = i;
			break;
		}
	}
	if (at < 0 || at + 1 >= argc)
		return 0;
	int stage = 0;
	for (size_t s = 0; s < STAGE_COUNT; s++)
		stage |= strcmp(argv[at + 1], HOOK_STAGES[s]) == 0;
	if (!stage)
		return 0;
	for (int i = at + 2; i < argc; i++) {
		if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
			i++;
		else if (strncmp(argv[i], "--config=", 9) != 0)
			return 0;
	}
	return at;
}

/* The only variables the Python hook is given (docs/security.md): the runtime's environment
 * may carry LD_PRELOAD, PYTHONPATH, PYTHONSTARTUP... that would run code in a root process. */
/* GPUHOOK_AGENT_SOCKET comes from the root-owned hook registration, as PATH does. */
static const char *const KEPT_VARIABLES[] = {"PATH=", "GPUHOOK_CONFIG=", "GPUHOOK_DOCKER_DATA_ROOT=", "GPUHOOK_AGENT_SOCKET="};
#define KEPT_COUNT (sizeof KEPT_VARIABLES / sizeof KEPT_VARIABLES[0])
static char *clean_environment[KEPT_COUNT + 2];  /* + FRONT_ENVIRONMENT */

/* Fill clean_environment with the first of each kept variable. Returns 2 with one line on
 * stderr for GPUHOOK_CONFIG set twice (which one wins differs between readers) or relative. */
static int keep_environment(void)
{
	size_t n = 0, configs = 0;
	for (char **e = environ; *e; e++) {
		for (size_t k = 0; k < KEPT_COUNT; k++) {
			size_t len = strlen(KEPT_VARIABLES[k]);
			if (strncmp(*e, KEPT_VARIABLES[k], len) != 0)
				continue;
			if (k == 1) {
				if (++configs > 1) {
					fputs("gpuhook: GPUHOOK_CONFIG is set more than once in the environment\n", stderr);
					return 2;
				}
				if ((*e)[len] != '\0' && (*e)[len] != '/') {
					fputs("gpuhook: GPUHOOK_CONFIG must be an absolute path\n", stderr);
					return 2;
				}
			}
			int seen = 0;
			for (size_t i = 0; i < n; i++)
				seen |= strncmp(clean_environment[i], KEPT_VARIABLES[k], len) == 0;
			if (!seen)
				clean_environment[n++] = *e;
		}
	}
	clean_environment[n++] = (char *)FRONT_ENVIRONMENT;  /* the protocol entry.check_front expects */
	clean_environment[n] = NULL;
	return 0;
}

/* A close-on-exec memfd holding exactly `state`, at offset 0; -1 on failure. */
static int state_memfd(const struct buf *state, unsigned flags)
{
	int fd = memfd_create("gpuhook-state", MFD_CLOEXEC | flags);
	size_t done = 0;
	if (fd < 0)
		return -1;
	while (done < state->len) {
		ssize_t put = write(fd, state->data + done, state->len - done);
		if (put < 0 && errno == EINTR)
			continue;
		if (put <= 0) {
			int saved = errno;
			close(fd);
			errno = saved;
			return -1;
		}
		done += (size_t)put;
	}
	if (lseek(fd, 0, SEEK_SET) != 0) {
		close(fd);
		return -1;
	}
	return fd;
}

/* Run the Python hook; with `state`, on a memfd holding exactly those bytes as its stdin.
 * `keep` >= 0: that fd (a detached stop's lock, stop_detached) becomes the hook's fd 3. */
static int hand_off_keeping(char **python, const struct buf *state, int keep)
{
	if (state) {
		int fd = state_memfd(state, 0);
		if (fd < 0 || dup2(fd, 0) != 0)  /* dup2: fd 0 is not close-on-exec */
			goto fail;
		close(fd);
	}
	unsigned first = 3;
	if (keep >= 0) {
		if (keep != 3 ? dup2(keep, 3) != 3 : fcntl(3, F_SETFD, 0) != 0)
			goto fail;
		first = 4;
	}
	/* Nothing the runtime left open reaches the Python hook (runc passes its own fds on). */
	if (syscall(SYS_close_range, first, ~0U, 0U) != 0)
		for (int fd = (int)first; fd < 1024; fd++)
			close(fd);
	execve(python[0], python, clean_environment);
fail:
	fprintf(stderr, "gpuhook: cannot start the hook %s: %s\n", python[0], strerror(errno));
	return 4;  /* gpuhook/errors.py: a host problem */
}

static int hand_off(char **python, const struct buf *state)
{
	return hand_off_keeping(python, state, -1);
}

/* ---- The resident agent (gpuhook/agent.py): the front is its client. ----
 *
 * Protocol AGENT_VERSION (gpuhook/agent.py's PROTOCOL, through markers.h) over AF_UNIX
 * SOCK_SEQPACKET (docs/agent.md). One request datagram: NUL-terminated tokens AGENT_VERSION, the
 * number of args, the args after the launcher, the number of environment entries, the entries
 * (the clean environment Python would get), with SCM_RIGHTS [state memfd, fd 1, fd 2], or for a
 * poststop [state memfd, its mount, PID, user and cgroup namespaces, a pidfd of the runtime]
 * (runc waits for its hook's stdout and stderr to close: a stop the agent carries out after
 * answering must not hold them; the agent checks a stop by these fds, its front gone). One reply datagram: "run" (the agent
 * declines: run the Python hook here), "exit N" (the hook ran there: exit N) or "signal N" (the
 * hook's process there was killed by signal N: one line, exit INTERNAL_ERROR). */
#define AGENT_REQUEST_MAX 65536u
#define AGENT_REPLY_TIMEOUT_S 120
#define INTERNAL_ERROR 70  /* gpuhook/errors.py */
#define STOP_EXTRA_FDS 5  /* a stop's fds after the memfd: its mount, PID, user and cgroup namespaces, the runtime */

enum agent_result { AGENT_UNUSED, AGENT_DECLINED, AGENT_EXITED, AGENT_NO_ANSWER };

static const char *kept_value(const char *prefix)
{
	size_t len = strlen(prefix);
	for (char **e = clean_environment; *e; e++)
		if (strncmp(*e, prefix, len) == 0)
			return *e + len;
	return NULL;
}

static const char *agent_socket_path(void)
{
	const char *path = kept_value("GPUHOOK_AGENT_SOCKET=");
	return path ? path : AGENT_DEFAULT_SOCKET;
}

/* 0 when the agent's socket (with `suffix`: "" for starts, STOP_SOCKET_SUFFIX for stops) may be
 * used: its directory a root-owned directory no group or other may write to, the socket a
 * root-owned socket (lstat: no symlink followed). Fills `addr` with the socket's address and
 * `dir` with its directory. */
static int agent_checked(const char *suffix, struct sockaddr_un *addr, char dir[sizeof addr->sun_path])
{
	char path[sizeof addr->sun_path];
	if ((size_t)snprintf(path, sizeof path, "%s%s", agent_socket_path(), suffix) >= sizeof path)
		return -1;
	size_t len = strlen(path);
	const char *slash = strrchr(path, '/');
	if (len == 0 || path[0] != '/' || !slash)
		return -1;
	size_t dlen = slash == path ? 1 : (size_t)(slash - path);
	memcpy(dir, path, dlen);
	dir[dlen] = '\0';
	struct stat st;
	if (lstat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != 0 || (st.st_mode & (S_IWGRP | S_IWOTH)))
		return -1;
	if (lstat(path, &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_uid != 0)
		return -1;
	*addr = (struct sockaddr_un){.sun_family = AF_UNIX};
	memcpy(addr->sun_path, path, len + 1);
	return 0;
}

/* A connected socket to the agent (`suffix` as agent_checked), or -1 when it must not or cannot
 * be used (agent_checked), or connect does not succeed within a second. */
static int agent_connect(const char *suffix)
{
	struct sockaddr_un addr;
	char dir[sizeof addr.sun_path];
	if (agent_checked(suffix, &addr, dir) != 0)
		return -1;
	int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (sock < 0)
		return -1;
	struct timeval second = {.tv_sec = 1, .tv_usec = 0};
	if (setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &second, sizeof second) != 0 ||
	    connect(sock, (struct sockaddr *)&addr, sizeof addr) != 0) {
		close(sock);
		return -1;
	}
	return sock;
}

/* Append `token` and its NUL to the request; -1 when it would pass AGENT_REQUEST_MAX. */
static int put_token(char *req, size_t *at, const char *token)
{
	size_t len = strlen(token) + 1;
	if (len > AGENT_REQUEST_MAX - *at)
		return -1;
	memcpy(req + *at, token, len);
	*at += len;
	return 0;
}

static long long monotonic_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Send the agent the request to run the hook (`args`: what follows the launcher): the
 * connected socket once the request is in the agent's queue, or -1 when it never went out
 * (run Python here). A start sends the state's memfd and fds 1 and 2; a stop the memfd and
 * `extra` (stop_fds). */
static int agent_send(int nargs, char **args, const struct buf *state, const int *extra, size_t nextra)
{
	static char req[AGENT_REQUEST_MAX];
	char number[24];
	size_t at = 0, nenv = 0;
	while (clean_environment[nenv])
		nenv++;
	if (put_token(req, &at, AGENT_VERSION) != 0)
		return -1;
	snprintf(number, sizeof number, "%d", nargs);
	if (put_token(req, &at, number) != 0)
		return -1;
	for (int i = 0; i < nargs; i++)
		if (put_token(req, &at, args[i]) != 0)
			return -1;
	snprintf(number, sizeof number, "%zu", nenv);
	if (put_token(req, &at, number) != 0)
		return -1;
	for (size_t i = 0; i < nenv; i++)
		if (put_token(req, &at, clean_environment[i]) != 0)
			return -1;

	/* A stop goes to the agent's stop socket: the agent takes it from there only once the
	 * runtime is done, or before a later start (docs/agent.md, "Stops"). */
	int sock = agent_connect(extra ? STOP_SOCKET_SUFFIX : "");
	if (sock < 0)
		return -1;
	/* Sealed: what the agent's child reads is exactly what the runtime gave this process. */
	int mfd = state_memfd(state, MFD_ALLOW_SEALING);
	if (mfd < 0 || fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
		if (mfd >= 0)
			close(mfd);
		close(sock);
		return -1;
	}
	int fds[1 + STOP_EXTRA_FDS] = {mfd, 1, 2};
	size_t nfds = 3;
	if (extra) {
		for (size_t i = 0; i < nextra && i < STOP_EXTRA_FDS; i++)
			fds[1 + i] = extra[i];
		nfds = 1 + (nextra < STOP_EXTRA_FDS ? nextra : STOP_EXTRA_FDS);
	}
	union {
		char buf[CMSG_SPACE(sizeof fds)];
		struct cmsghdr align;
	} control;
	memset(&control, 0, sizeof control);
	struct iovec iov = {.iov_base = req, .iov_len = at};
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf, .msg_controllen = sizeof control.buf};
	struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
	cmsg->cmsg_level = SOL_SOCKET;
	cmsg->cmsg_type = SCM_RIGHTS;
	msg.msg_controllen = CMSG_SPACE(nfds * sizeof fds[0]);
	cmsg->cmsg_len = CMSG_LEN(nfds * sizeof fds[0]);
	memcpy(CMSG_DATA(cmsg), fds, nfds * sizeof fds[0]);
	ssize_t sent;
	do
		sent = sendmsg(sock, &msg, MSG_NOSIGNAL);
	while (sent < 0 && errno == EINTR);
	close(mfd);
	if (sent < 0) {  /* nothing went out (EPIPE, ECONNRESET, a full queue past SO_SNDTIMEO) */
		close(sock);
		return -1;
	}
	return sock;
}

/* The agent's answer on `sock` (closed here), waited for up to `seconds`. AGENT_DECLINED: the
 * agent said "run"; AGENT_EXITED: *code is the exit status (the agent's, or INTERNAL_ERROR with
 * one line on stderr for "signal N"); AGENT_NO_ANSWER: none, or none valid, in time (*code
 * INTERNAL_ERROR, one line on stderr). The hook may be under way from the moment the request
 * went out: a start never runs it a second time unless declined. */
static enum agent_result agent_answer(int sock, int *code, int seconds)
{
	long long deadline = monotonic_ms() + seconds * 1000LL;
	struct pollfd pfd = {.fd = sock, .events = POLLIN};
	int ready;
	for (;;) {
		long long left = deadline - monotonic_ms();
		if (left <= 0) {
			ready = 0;
			break;
		}
		ready = poll(&pfd, 1, (int)left);
		if (ready >= 0 || errno != EINTR)
			break;
	}
	*code = INTERNAL_ERROR;
	if (ready == 0) {
		close(sock);
		fprintf(stderr, "gpuhook: the gpuhook agent did not answer in %d s\n", seconds);
		return AGENT_NO_ANSWER;
	}
	char reply[16];
	struct iovec riov = {.iov_base = reply, .iov_len = sizeof reply - 1};
	struct msghdr rmsg = {.msg_iov = &riov, .msg_iovlen = 1};
	ssize_t got = -1;
	if (ready > 0)
		do
			got = recvmsg(sock, &rmsg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		while (got < 0 && errno == EINTR);
	close(sock);
	if (got > 0 && !(rmsg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
		size_t n = (size_t)got;
		if (n == 3 && memcmp(reply, "run", 3) == 0)
			return AGENT_DECLINED;
		/* "exit N" (the hook's status), or "signal N": the hook's process was killed */
		size_t skip = n > 5 && memcmp(reply, "exit ", 5) == 0 ? 5 : n > 7 && memcmp(reply, "signal ", 7) == 0 ? 7 : 0;
		if (skip && n - skip >= 1 && n - skip <= 3 && (n - skip == 1 || reply[skip] != '0')) {
			int value = 0;
			size_t i = skip;
			for (; i < n && reply[i] >= '0' && reply[i] <= '9'; i++)
				value = value * 10 + (reply[i] - '0');
			if (i == n && value <= 255 && skip == 5) {
				*code = value;
				return AGENT_EXITED;
			}
			if (i == n && value >= 1 && value <= 64 && skip == 7) {
				fprintf(stderr, "gpuhook: internal error: the hook's process ended on signal %d\n", value);
				return AGENT_EXITED;  /* *code is INTERNAL_ERROR */
			}
		}
	}
	fputs("gpuhook: the gpuhook agent ended without an answer\n", stderr);
	return AGENT_NO_ANSWER;
}

/* Ask the agent to run the hook. AGENT_UNUSED: the request never went out, run Python here;
 * otherwise as agent_answer. */
static enum agent_result ask_agent(int nargs, char **args, const struct buf *state, int *code)
{
	int sock = agent_send(nargs, args, state, NULL, 0);
	if (sock < 0)
		return AGENT_UNUSED;
	enum agent_result r = agent_answer(sock, code, AGENT_REPLY_TIMEOUT_S);
	return r == AGENT_NO_ANSWER ? AGENT_EXITED : r;  /* *code is INTERNAL_ERROR, the line written */
}

static void no_op(int signum)
{
	(void)signum;
}

/* flock(`operation`) on the file `name` in the agent's directory (gpuhook/stoporder.py), opened
 * with `flags` (non-blocking, close-on-exec; a regular file only: a FIFO planted there must not
 * hold the runtime), waiting up to `seconds`: the fd, locked or not (whoever holds the lock is
 * at work, and no one waits without bound), or -1 when it cannot be opened. */
static int lock_in(const char *dir, const char *name, int flags, int operation, unsigned seconds)
{
	char path[sizeof ((struct sockaddr_un *)0)->sun_path + 64];
	if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path)
		return -1;
	int fd = open(path, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
	if (fd < 0)
		return -1;
	struct stat st;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		close(fd);
		return -1;
	}
	if (flock(fd, operation | LOCK_NB) == 0)
		return fd;
	/* A blocking flock, interrupted by SIGALRM (no SA_RESTART) when the time is up, and every
	 * 0.1 s after that: a signal that came before flock began does not leave it blocked. */
	struct sigaction alarm_action = {.sa_handler = no_op};
	sigemptyset(&alarm_action.sa_mask);
	struct itimerval timer = {.it_value = {.tv_sec = (time_t)seconds}, .it_interval = {.tv_usec = 100000}};
	struct itimerval off = {0};
	long long until = monotonic_ms() + (long long)seconds * 1000;
	if (sigaction(SIGALRM, &alarm_action, NULL) == 0 && setitimer(ITIMER_REAL, &timer, NULL) == 0) {
		while (flock(fd, operation) != 0 && errno == EINTR && monotonic_ms() < until)
			;
		setitimer(ITIMER_REAL, &off, NULL);
	}
	return fd;
}

/* The fds a stop sends after its memfd (STOP_EXTRA_FDS): this process's mount, PID, user and
 * cgroup namespaces (the agent compares them with its own: it checks a stop without its front,
 * which has exited by then) and a pidfd of the runtime that ran this hook (the agent's child
 * waits for it to end before the stop's work). 0, or -1 with none left open. */
static int stop_fds(int fds[STOP_EXTRA_FDS])
{
	static const char *const kinds[] = {"/proc/self/ns/mnt", "/proc/self/ns/pid", "/proc/self/ns/user",
	                                    "/proc/self/ns/cgroup"};
	size_t n = 0;
	for (; n < 4; n++)
		if ((fds[n] = open(kinds[n], O_RDONLY | O_CLOEXEC)) < 0)
			break;
	/* The runtime: still this process's parent once the pidfd is taken, so not a reused pid. */
	pid_t parent = getppid();
	if (n == 4 && parent > 1) {
		fds[4] = (int)syscall(SYS_pidfd_open, parent, 0U);
		if (fds[4] >= 0 && getppid() == parent)
			return 0;
		if (fds[4] >= 0)
			close(fds[4]);
	}
	while (n > 0)
		close(fds[--n]);
	return -1;
}

/* A stop (poststop) for the agent. The runtime's delete waits for none of gpuhook's cleanup:
 * this process sends the request and exits 0, and a child waits for the agent's answer
 * (docs/agent.md, "Stops"). The request is in the agent's queue before the runtime goes on,
 * so a later start is ordered after it, and it is carried out even if this process and its
 * child are killed the moment the runtime ends. The pending lock, taken shared before the
 * request goes out and held by the child until the answer, makes starts wait for a stop the
 * agent declines or never answers: the child then runs it in the Python hook, holding the
 * stop lock as the agent's stops do. 0: sent; -1: nothing went out, run the stop here as before;
 * otherwise the code of a hand-off that could not start the Python hook. */
static int stop_detached(int nargs, char **args, char **python, const struct buf *state)
{
	struct sockaddr_un addr;
	char dir[sizeof addr.sun_path];
	if (agent_checked(STOP_SOCKET_SUFFIX, &addr, dir) != 0)
		return -1;
	int null = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (null < 0)
		return -1;
	int extra[STOP_EXTRA_FDS];
	if (stop_fds(extra) != 0) {
		close(null);
		return -1;
	}
	int pending = lock_in(dir, STOP_PENDING_NAME, O_RDONLY | O_CREAT, LOCK_SH, 1);
	int sock = agent_send(nargs, args, state, extra, STOP_EXTRA_FDS);
	for (size_t i = 0; i < STOP_EXTRA_FDS; i++)
		close(extra[i]);
	if (sock < 0) {
		close(null);
		if (pending < 0)
			return -1;
		/* A start may wait on the pending lock already: one the agent declined because this
		 * stop was queued unread, the agent dropping it before the send came (attacker pass
		 * 22). The stop runs here, holding the stop lock as the child would, taken before the
		 * pending lock is let go: that start waits for it. */
		int held = lock_in(dir, STOP_LOCK_NAME, O_RDWR | O_CREAT, LOCK_EX, STOP_LOCK_WAIT_S);
		close(pending);
		return hand_off_keeping(python, state, held);
	}
	/* The runtime goes on once this process has exited and every copy of its stdin, stdout
	 * and stderr is closed: the child gets none of them. */
	int moved = dup2(null, 0) == 0 && dup2(null, 1) == 1 && dup2(null, 2) == 2;
	close(null);
	pid_t pid = moved ? fork() : -1;
	if (pid > 0)
		return 0;
	if (pid == 0)
		setsid();  /* a signal to the runtime's process group or session is not for the child */
	/* The child, or this process if it could not fork (then the runtime waits for it). */
	int code;
	/* Without an answer (the agent was killed before it had the stop, or hangs), the stop may
	 * never run: it runs here. Run twice (the agent handed it over and died before answering),
	 * it is done once: the second finds the first one's work done (gpuhook.apply.served). */
	if (agent_answer(sock, &code, STOP_LOCK_WAIT_S) == AGENT_EXITED)
		_exit(code & 0xFF);
	int held = lock_in(dir, STOP_LOCK_NAME, O_RDWR | O_CREAT, LOCK_EX, STOP_LOCK_WAIT_S);
	if (pending >= 0)
		close(pending);
	_exit(hand_off_keeping(python, state, held));
}

/* The Python hook for a plain invocation its prescan could not rule out: through the agent
 * when one is there and takes it, else here as before. Docker's launcher path
 * (GPUHOOK_DOCKER_DATA_ROOT) always stays with Python. */
static int run_hook(int argc, char **argv, int launcher, const struct buf *state)
{
	if (!kept_value("GPUHOOK_DOCKER_DATA_ROOT=")) {
		char **args = argv + launcher + 1;
		if (strcmp(args[0], "poststop") == 0) {  /* sent and detached, or run here */
			int detached = stop_detached(argc - launcher - 1, args, argv + 1, state);
			return detached == -1 ? hand_off(argv + 1, state) : detached;
		}
		int code;
		enum agent_result r = ask_agent(argc - launcher - 1, argv + launcher + 1, state, &code);
		if (r == AGENT_EXITED)
			return code;
	}
	return hand_off(argv + 1, state);
}

int main(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[1], "--protocol") == 0) {
		/* The self-check `gpuhook install` runs before registering this front. */
		puts(FRONT_PROTOCOL_TEXT);
		return 0;
	}
	if (argc < 2) {
		fputs("gpuhook: usage: gpuhook-front PYTHON ARGS... (the hook's Python command)\n", stderr);
		return 2;
	}
	int refused = keep_environment();
	if (refused)
		return refused;
	/* A relative interpreter or config path would be resolved against whatever working
	 * directory the runtime gave the hook (the bundle, which the image may shape): refuse. */
	if (argv[1][0] != '/') {
		fputs("gpuhook: the hook's interpreter must be an absolute path\n", stderr);
		return 2;
	}
	for (int i = 2; i < argc; i++) {
		const char *value = NULL;
		if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
			value = argv[++i];
		else if (strncmp(argv[i], "--config=", 9) == 0)
			value = argv[i] + 9;
		if (value && value[0] != '/') {
			fputs("gpuhook: --config must be an absolute path\n", stderr);
			return 2;
		}
	}
	int launcher = plain_hook_invocation(argc, argv);
	if (!launcher)
		return hand_off(argv + 1, NULL);
	struct buf state;
	if (read_bounded(0, MAX_STATE_BYTES + 1, 0, &state) != 0)
		/* Unreadable stdin: the Python hook reads it itself and says why; what was read
		 * before an error mid-way is all there is to hand it. */
		return hand_off(argv + 1, state.len ? &state : NULL);
	if (state.len > MAX_STATE_BYTES || may_request(state.data, state.len))
		return run_hook(argc, argv, launcher, &state);
	const unsigned char *bundle;
	size_t blen;
	if (top_level_bundle(state.data, state.len, &bundle, &blen) != 1 || !config_has_no_request(bundle, blen))
		return run_hook(argc, argv, launcher, &state);
	return 0;
}
