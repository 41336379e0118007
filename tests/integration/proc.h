/* Child processes for integration tests: start a server binary, read its
 * stdout until it says where it listens, signal it, wait for it with a
 * timeout. Children die with the test (PR_SET_PDEATHSIG), so a crashed test
 * leaves no server behind. Header-only: each test is one .c file.
 *
 * Two styles: struct test_proc (one handle per child, its output buffered),
 * and the pid registry below (child_spawn / read_address / child_wait), whose
 * children_kill_all and children_on_fatal clean up after an exit, a crash or
 * a time limit. */
#ifndef MOE_TEST_PROC_H
#define MOE_TEST_PROC_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"

struct test_proc {
    pid_t pid;
    int out_fd;     /* the child's stdout (stderr goes to ours) */
    char buf[8192]; /* what it printed so far */
    size_t len;
    int status; /* wait status once reaped */
    bool reaped;
};

/* Starts argv[0] with argv (NULL-terminated). Returns 0 on success. */
static inline int test_proc_start(struct test_proc *p, char *const argv[])
{
    memset(p, 0, sizeof *p);
    int fds[2];
    if (pipe(fds))
        return -1;
    pid_t parent = getpid();
    p->pid = fork();
    if (p->pid < 0)
        return -1;
    if (p->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execv(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    p->out_fd = fds[0];
    fcntl(p->out_fd, F_SETFL, O_NONBLOCK);
    return 0;
}

/* Reads the child's output until it contains `needle` or timeout_s passes.
 * Returns a pointer into p->buf at the match, or NULL. */
static inline const char *test_proc_wait_for(struct test_proc *p, const char *needle,
                                             double timeout_s)
{
    double end = moe_now() + timeout_s;
    for (;;) {
        p->buf[p->len] = 0;
        const char *hit = strstr(p->buf, needle);
        if (hit)
            return hit;
        double left = end - moe_now();
        if (left <= 0 || p->len + 1 >= sizeof p->buf)
            return NULL;
        struct pollfd pfd = {.fd = p->out_fd, .events = POLLIN};
        if (poll(&pfd, 1, (int)(left * 1000) + 1) <= 0)
            continue;
        ssize_t n = read(p->out_fd, p->buf + p->len, sizeof p->buf - 1 - p->len);
        if (n == 0)
            return NULL; /* the child closed stdout: it exited */
        if (n > 0)
            p->len += (size_t)n;
    }
}

/* Waits up to timeout_s for the child to exit. Returns true if it did. */
static inline bool test_proc_wait(struct test_proc *p, double timeout_s)
{
    double end = moe_now() + timeout_s;
    while (!p->reaped) {
        pid_t r = waitpid(p->pid, &p->status, WNOHANG);
        if (r == p->pid) {
            p->reaped = true;
            break;
        }
        if (moe_now() > end)
            return false;
        usleep(10 * 1000);
    }
    return true;
}

/* Exit code if it exited normally, else -signal. */
static inline int test_proc_exit_code(const struct test_proc *p)
{
    return WIFEXITED(p->status) ? WEXITSTATUS(p->status) : -WTERMSIG(p->status);
}

/* SIGKILL and reap (idempotent). */
static inline void test_proc_kill(struct test_proc *p)
{
    if (p->pid > 0 && !p->reaped) {
        kill(p->pid, SIGKILL);
        test_proc_wait(p, 10);
    }
    if (p->out_fd > 0) {
        close(p->out_fd);
        p->out_fd = -1;
    }
}

/* ---- the pid registry --------------------------------------------------------------- */

#define MAX_CHILD 24
static pid_t g_children[MAX_CHILD];

static inline void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* atexit handler: SIGKILL and reap every registered child. */
static inline void children_kill_all(void)
{
    for (int i = 0; i < MAX_CHILD; i++)
        if (g_children[i] > 0) {
            kill(g_children[i], SIGKILL);
            waitpid(g_children[i], NULL, 0);
            g_children[i] = 0;
        }
}

/* Signal handler (SIGALRM time limit, crashes): kill the children, then die
 * of the same signal. */
static inline void children_on_fatal(int sig)
{
    for (int i = 0; i < MAX_CHILD; i++)
        if (g_children[i] > 0)
            kill(g_children[i], SIGKILL);
    if (sig == SIGALRM)
        fprintf(stderr, "integration test: time limit reached\n");
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Installs the two above for exit, SIGALRM, SIGINT, SIGTERM, SIGSEGV and SIGABRT. */
static inline void children_guard(void)
{
    atexit(children_kill_all);
    signal(SIGALRM, children_on_fatal);
    signal(SIGINT, children_on_fatal);
    signal(SIGTERM, children_on_fatal);
    signal(SIGSEGV, children_on_fatal);
    signal(SIGABRT, children_on_fatal);
}

/* The child was reaped elsewhere: stop tracking it. */
static inline void child_forget(pid_t pid)
{
    for (int i = 0; i < MAX_CHILD; i++)
        if (g_children[i] == pid)
            g_children[i] = 0;
}

/* Starts argv (NULL-terminated) with `env` (NAME=VALUE, NULL-ended, may be
 * NULL) added to its environment; stdout on a pipe returned in *out_fd
 * (NULL: not wanted), stderr inherited, or both into the file `log` (when
 * not NULL). Returns the pid, or -1. */
static inline pid_t child_spawn(char *const argv[], char *const env[], int *out_fd, const char *log)
{
    int p[2] = {-1, -1};
    if (out_fd && pipe(p))
        return -1;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        for (int i = 0; env && env[i]; i++)
            putenv(env[i]);
        if (out_fd) {
            dup2(p[1], 1);
            close(p[0]);
            close(p[1]);
        }
        if (log) {
            int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
            if (fd >= 0) {
                dup2(fd, 1);
                dup2(fd, 2);
                close(fd);
            }
        }
        execv(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    for (int i = 0; i < MAX_CHILD; i++)
        if (!g_children[i]) {
            g_children[i] = pid;
            break;
        }
    if (out_fd) {
        close(p[1]);
        *out_fd = p[0];
    }
    return pid;
}

/* As child_spawn with a stdout pipe, but the child's stderr goes to the
 * file `err_log` (appended), so a test can wait for what it logs. */
static inline pid_t child_spawn_logged(char *const argv[], char *const env[], int *out_fd,
                                       const char *err_log)
{
    int p[2] = {-1, -1};
    if (pipe(p))
        return -1;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        for (int i = 0; env && env[i]; i++)
            putenv(env[i]);
        dup2(p[1], 1);
        close(p[0]);
        close(p[1]);
        int fd = open(err_log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 2);
            close(fd);
        }
        execv(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    for (int i = 0; i < MAX_CHILD; i++)
        if (!g_children[i]) {
            g_children[i] = pid;
            break;
        }
    close(p[1]);
    *out_fd = p[0];
    return pid;
}

/* Whether the file at `path` contains `needle` (false if unreadable). */
static inline bool file_contains(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    bool hit = false;
    char line[4096];
    while (!hit && fgets(line, sizeof line, f))
        hit = strstr(line, needle) != NULL;
    fclose(f);
    return hit;
}

/* Reads a child's stdout until a line contains " on HOST:PORT"; copies
 * HOST:PORT into addr and closes fd. Returns 0 on success. */
static inline int read_address(int fd, char *addr, size_t cap, int timeout_ms)
{
    char buf[2048];
    size_t n = 0;
    int64_t t0 = moe_now_ms();
    fcntl(fd, F_SETFL, O_NONBLOCK);
    while (moe_now_ms() - t0 < timeout_ms && n < sizeof buf - 1) {
        ssize_t r = read(fd, buf + n, sizeof buf - 1 - n);
        if (r == 0)
            break;
        if (r < 0) {
            sleep_ms(10);
            continue;
        }
        n += (size_t)r;
        buf[n] = '\0';
        char *on = strstr(buf, " on ");
        if (on && strchr(on, '\n')) {
            on += 4;
            size_t k = strcspn(on, " \n");
            snprintf(addr, cap, "%.*s", (int)k, on);
            close(fd);
            return 0;
        }
    }
    close(fd);
    return -1;
}

/* Waits for a child to exit; returns its exit status, or -1 on timeout
 * (then it is killed) or a signal. */
static inline int child_wait(pid_t pid, int timeout_ms)
{
    int st;
    for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < timeout_ms; sleep_ms(20))
        if (waitpid(pid, &st, WNOHANG) == pid) {
            child_forget(pid);
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    child_forget(pid);
    return -1;
}

static inline void child_kill9(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    child_forget(pid);
}

#endif
