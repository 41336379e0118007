/* Child processes for integration tests: start a server binary, read its
 * stdout until it says where it listens, signal it, wait for it with a
 * timeout. Children die with the test (PR_SET_PDEATHSIG), so a crashed test
 * leaves no server behind. Header-only: each test is one .c file. */
#ifndef MOE_TEST_PROC_H
#define MOE_TEST_PROC_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct test_proc {
    pid_t pid;
    int out_fd;     /* the child's stdout (stderr goes to ours) */
    char buf[8192]; /* what it printed so far */
    size_t len;
    int status; /* wait status once reaped */
    bool reaped;
};

static inline double test_proc_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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
    double end = test_proc_now() + timeout_s;
    for (;;) {
        p->buf[p->len] = 0;
        const char *hit = strstr(p->buf, needle);
        if (hit)
            return hit;
        double left = end - test_proc_now();
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
    double end = test_proc_now() + timeout_s;
    while (!p->reaped) {
        pid_t r = waitpid(p->pid, &p->status, WNOHANG);
        if (r == p->pid) {
            p->reaped = true;
            break;
        }
        if (test_proc_now() > end)
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

#endif
