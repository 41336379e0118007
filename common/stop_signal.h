/* SIGTERM and SIGINT as a request to stop, for the server processes
 * (moe-coordinator, moe-worker): the handler only records which signal
 * came, and the main loop polls for it and shuts down in its own time
 * (drain, grace period). */
#ifndef MOE_STOP_SIGNAL_H
#define MOE_STOP_SIGNAL_H

/* Installs the handler for SIGTERM and SIGINT. */
void moe_stop_signal_install(void);

/* The signal that asked to stop (SIGTERM or SIGINT), 0 while none has. */
int moe_stop_signal(void);

/* "SIGTERM" or "SIGINT": which one it was, for the shutdown's log line. */
const char *moe_stop_signal_name(void);

#endif
