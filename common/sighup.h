/* Re-reading certificates and token files on SIGHUP, for every server
 * process (moe-coordinator, moe-worker, each rank of a worker group).
 *
 * A thread waits for the signal (the handler only writes a byte to a pipe)
 * and then reloads the TLS material (moe_tls_reload) and every token file
 * (moe_tokens_reload), printing one line per reload on stderr:
 *   "moe-worker: SIGHUP: TLS certificate reloaded (generation 2, serial 3F...)"
 * or why it failed (the previous material stays in use). */
#ifndef MOE_SIGHUP_H
#define MOE_SIGHUP_H

#include "moe_error.h"

struct moe_tls;
struct moe_tokens;
struct moe_sighup;

/* Installs the SIGHUP handler and starts the thread. `program` names the
 * log lines; `tls` (may be NULL) and the n_tokens token sets (entries may be
 * NULL) are borrowed and must outlive moe_sighup_stop. One per process. */
enum moe_status moe_sighup_start(const char *program, struct moe_tls *tls,
                                 struct moe_tokens *const *tokens, int n_tokens,
                                 struct moe_sighup **out, struct moe_error *err);

/* Stops the thread (SIGHUP is ignored from then on). NULL is a no-op. */
void moe_sighup_stop(struct moe_sighup *h);

#endif
