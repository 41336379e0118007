#include "stop_signal.h"

#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>

/* An atomic, not a volatile sig_atomic_t: the handler runs on whichever
 * thread the signal lands on (a gRPC or pool thread as often as main), and
 * a lock-free atomic is both signal-safe and a synchronised access
 * (ThreadSanitizer reported the volatile as a race). */
static atomic_int g_signal;

static void on_signal(int sig)
{
    atomic_store_explicit(&g_signal, sig, memory_order_relaxed);
}

void moe_stop_signal_install(void)
{
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
}

int moe_stop_signal(void)
{
    return atomic_load_explicit(&g_signal, memory_order_relaxed);
}

const char *moe_stop_signal_name(void)
{
    return moe_stop_signal() == SIGTERM ? "SIGTERM" : "SIGINT";
}
