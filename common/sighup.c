/* SIGHUP reloads (see sighup.h): a self-pipe written by the handler, read by
 * one thread. */
#define _GNU_SOURCE /* pipe2 */
#include "sighup.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "auth_token.h"
#include "tls_opts.h"

#define SIGHUP_MAX_TOKENS 4

struct moe_sighup {
    char program[64];
    struct moe_tls *tls;
    struct moe_tokens *tokens[SIGHUP_MAX_TOKENS];
    int n_tokens;
    int pipe[2];
    pthread_t thread;
};

static volatile sig_atomic_t g_wake_fd = -1; /* the pipe's write end, for the handler */

static void on_sighup(int sig)
{
    (void)sig;
    int saved = errno;
    if (g_wake_fd >= 0) {
        char b = 'h';
        ssize_t r = write(g_wake_fd, &b, 1); /* a full pipe already has a wake-up */
        (void)r;
    }
    errno = saved;
}

static void reload_all(struct moe_sighup *h)
{
    struct moe_error err = {0};
    if (h->tls) {
        if (moe_tls_reload(h->tls, &err) == MOE_OK) {
            const struct moe_tls_material *m = moe_tls_current(h->tls);
            fprintf(stderr, "%s: SIGHUP: TLS certificate reloaded (generation %llu, serial %s)\n",
                    h->program, (unsigned long long)m->generation,
                    m->serial[0] ? m->serial : "none");
        } else {
            fprintf(stderr, "%s: SIGHUP: %s\n", h->program, err.msg);
        }
    }
    for (int i = 0; i < h->n_tokens; i++) {
        if (!h->tokens[i])
            continue;
        if (moe_tokens_reload(h->tokens[i], &err) == MOE_OK)
            fprintf(stderr, "%s: SIGHUP: %d token(s) reloaded\n", h->program,
                    moe_tokens_count(h->tokens[i]));
        else
            fprintf(stderr, "%s: SIGHUP: %s\n", h->program, err.msg);
    }
}

static void *sighup_main(void *arg)
{
    struct moe_sighup *h = arg;
    for (;;) {
        struct pollfd p = {.fd = h->pipe[0], .events = POLLIN};
        if (poll(&p, 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        char buf[64];
        ssize_t n = read(h->pipe[0], buf, sizeof buf);
        if (n <= 0)
            continue;
        bool stop = memchr(buf, 's', (size_t)n) != NULL;
        if (memchr(buf, 'h', (size_t)n))
            reload_all(h);
        if (stop)
            break;
    }
    return NULL;
}

enum moe_status moe_sighup_start(const char *program, struct moe_tls *tls,
                                 struct moe_tokens *const *tokens, int n_tokens,
                                 struct moe_sighup **out, struct moe_error *err)
{
    *out = NULL;
    if (n_tokens > SIGHUP_MAX_TOKENS)
        return moe_error_set(err, MOE_ERR_INVALID, "sighup: more than %d token sets",
                             SIGHUP_MAX_TOKENS);
    struct moe_sighup *h = calloc(1, sizeof *h);
    if (!h)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    snprintf(h->program, sizeof h->program, "%s", program);
    h->tls = tls;
    for (int i = 0; i < n_tokens; i++)
        h->tokens[i] = tokens[i];
    h->n_tokens = n_tokens;
    if (pipe2(h->pipe, O_CLOEXEC | O_NONBLOCK)) {
        free(h);
        return moe_error_set(err, MOE_ERR_IO, "sighup: pipe: %s", strerror(errno));
    }
    if (pthread_create(&h->thread, NULL, sighup_main, h)) {
        close(h->pipe[0]);
        close(h->pipe[1]);
        free(h);
        return moe_error_set(err, MOE_ERR_INTERNAL, "sighup: cannot start the thread");
    }
    g_wake_fd = h->pipe[1];
    struct sigaction sa = {.sa_handler = on_sighup, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGHUP, &sa, NULL);
    *out = h;
    return MOE_OK;
}

void moe_sighup_stop(struct moe_sighup *h)
{
    if (!h)
        return;
    signal(SIGHUP, SIG_IGN);
    g_wake_fd = -1;
    char b = 's';
    ssize_t r = write(h->pipe[1], &b, 1);
    (void)r;
    pthread_join(h->thread, NULL);
    close(h->pipe[0]);
    close(h->pipe[1]);
    free(h);
}
