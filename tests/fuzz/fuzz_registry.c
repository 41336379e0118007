/* Fuzz target: the worker registrations the coordinator reads from etcd
 * (coordinator/registry.c): a key /moe/workers/<id> whose value should be
 * {"address": "HOST:PORT", "role": "mixed|prefill|decode"}, as a watch
 * event (PUT, then DELETE). Whoever can write etcd writes these, so a bad
 * one must be logged and ignored, never crash or corrupt the member list.
 *
 * The parsers are static and reached only through an etcd event, so this
 * file includes registry.c with the gRPC channel replaced by a fake (no
 * network: the address string is what is under test, not gRPC).
 *
 * Input: the worker id up to the first '\n', the value after it. What must
 * hold: an accepted registration is one member whose id is the key's
 * suffix and whose address is HOST:PORT with a host; a second PUT of the
 * same key leaves one member; DELETE leaves none. */
#include "rpc.h"

static struct rpc_client *fuzz_client_create(const char *target,
                                             const struct rpc_client_options *opts,
                                             struct moe_error *err);
static void fuzz_client_destroy(struct rpc_client *c);
#define rpc_client_create fuzz_client_create
#define rpc_client_destroy fuzz_client_destroy

#include "registry.c"

#include "fuzz.h"
#include "hostport.h"

static struct rpc_client *
fuzz_client_create(const char *target, const struct rpc_client_options *opts, struct moe_error *err)
{
    (void)opts;
    if (!target || !target[0]) {
        moe_error_set(err, MOE_ERR_INVALID, "empty target");
        return NULL;
    }
    return (struct rpc_client *)strdup(target);
}

static void fuzz_client_destroy(struct rpc_client *c)
{
    free(c);
}

static void event(struct coord *c, enum moe_etcd_event_type type, const char *key,
                  const char *value, size_t value_len)
{
    struct moe_etcd_event ev = {
        .type = type, .key = key, .key_len = strlen(key), .value = value, .value_len = value_len};
    on_etcd_event(c, &ev);
}

static void check_members(struct coord *c, const char *id, size_t max)
{
    FUZZ_CHECK(c->n_workers <= max, "%zu members after one key", c->n_workers);
    for (size_t i = 0; i < c->n_workers; i++) {
        const struct coord_worker *w = c->workers[i];
        char host[COORD_ADDR_MAX];
        int port;
        FUZZ_CHECK(!strcmp(w->id, id), "member id '%s' is not the key's suffix", w->id);
        FUZZ_CHECK(moe_hostport_split(w->address, host, sizeof host, &port) && host[0],
                   "member address '%s' is not HOST:PORT", w->address);
        FUZZ_CHECK(w->client && !strcmp((const char *)w->client, w->address),
                   "the channel is not to the member's address");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nl = memchr(data, '\n', size);
    size_t id_len = nl ? (size_t)(nl - data) : size;
    if (id_len > 4 * COORD_ID_MAX)
        return 0;
    char key[sizeof WORKERS_PREFIX + 4 * COORD_ID_MAX];
    memcpy(key, WORKERS_PREFIX, strlen(WORKERS_PREFIX));
    memcpy(key + strlen(WORKERS_PREFIX), data, id_len);
    key[strlen(WORKERS_PREFIX) + id_len] = '\0';
    const char *id = key + strlen(WORKERS_PREFIX);
    char *value = fuzz_cstr(nl ? nl + 1 : data + size, nl ? size - id_len - 1 : 0);
    if (!value)
        return 0;
    size_t value_len = nl ? size - id_len - 1 : 0;

    struct coord c;
    memset(&c, 0, sizeof c);
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cond, NULL);
    event(&c, MOE_ETCD_EVENT_PUT, key, value, value_len);
    check_members(&c, id, 1);
    event(&c, MOE_ETCD_EVENT_PUT, key, value, value_len); /* again: still one */
    check_members(&c, id, 1);
    event(&c, MOE_ETCD_EVENT_DELETE, key, NULL, 0);
    FUZZ_CHECK(c.n_workers == 0 || strlen(key) <= strlen(WORKERS_PREFIX),
               "%zu members after DELETE", c.n_workers);
    while (c.n_workers > 0)
        member_drop_locked(&c, 0);
    free(c.workers);
    pthread_cond_destroy(&c.cond);
    pthread_mutex_destroy(&c.mu);
    free(value);
    return 0;
}
