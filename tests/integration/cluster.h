/* What the cluster-level integration tests share (test_cluster.c,
 * test_faults.c): a private etcd on free loopback ports, a copy of the tiny
 * qwen3_moe fixture with a longer context (same weights), free ports, and
 * the Admin calls that say how the coordinator sees its workers.
 * Header-only, on top of proc.h and rpcutil.h. */
#ifndef MOE_TEST_CLUSTER_H
#define MOE_TEST_CLUSTER_H

#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "etcd.h"
#include "moe/v1/admin.pb-c.h"
#include "proc.h"
#include "rpcutil.h"
#include "testlib.h"

/* A free TCP port on 127.0.0.1 (bound, read, closed), or -1. */
static inline int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

/* ---- the long-context model copy ---------------------------------------------------- */

/* Makes TMPDIR/qwen3_moe: the fixture's weights and tokenizer linked, its
 * config.json with max_position_embeddings = ctx. *tmp receives the
 * temporary folder (remove with model_copy_remove), *model the model dir.
 * Returns 0 on success. */
static inline int model_copy_make(int ctx, char *tmp, size_t tmp_cap, char *model, size_t model_cap)
{
    snprintf(tmp, tmp_cap, "/tmp/moe-cluster-XXXXXX");
    if (!mkdtemp(tmp))
        return -1;
    snprintf(model, model_cap, "%s/qwen3_moe", tmp);
    if (mkdir(model, 0755))
        return -1;
    const char *files[] = {"model.safetensors", "tokenizer.json", "generation_config.json"};
    char src[1024], dst[1024];
    for (int i = 0; i < 3; i++) {
        snprintf(src, sizeof src, "%s", test_src_path("tests/golden/fixtures/qwen3_moe/"));
        strncat(src, files[i], sizeof src - strlen(src) - 1);
        snprintf(dst, sizeof dst, "%s/%s", model, files[i]);
        if (symlink(src, dst))
            return -1;
    }
    FILE *in = fopen(test_src_path("tests/golden/fixtures/qwen3_moe/config.json"), "r");
    snprintf(dst, sizeof dst, "%s/config.json", model);
    FILE *out = fopen(dst, "w");
    if (!in || !out) {
        if (in)
            fclose(in);
        if (out)
            fclose(out);
        return -1;
    }
    char line[1024];
    while (fgets(line, sizeof line, in)) {
        if (strstr(line, "\"max_position_embeddings\""))
            fprintf(out, "  \"max_position_embeddings\": %d,\n", ctx);
        else
            fputs(line, out);
    }
    fclose(in);
    fclose(out);
    return 0;
}

static inline void model_copy_remove(const char *tmp)
{
    if (!tmp[0])
        return;
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd)) {
    }
}

/* ---- a private etcd ---------------------------------------------------------------- */

/* The etcd binary: $MOE_ETCD_BIN, else /usr/bin, /usr/local/bin, /bin. */
static inline int find_etcd(char *bin, size_t cap)
{
    const char *env = getenv("MOE_ETCD_BIN");
    if (env && *env) {
        snprintf(bin, cap, "%s", env);
        return access(bin, X_OK) == 0;
    }
    const char *dirs[] = {"/usr/bin", "/usr/local/bin", "/bin"};
    for (int i = 0; i < 3; i++) {
        snprintf(bin, cap, "%s/etcd", dirs[i]);
        if (access(bin, X_OK) == 0)
            return 1;
    }
    return 0;
}

struct test_etcd {
    char bin[512];
    char data[700]; /* data directory (kept across a restart) */
    char log[700];
    char client[64]; /* http://127.0.0.1:PORT */
    char peer[64];
    pid_t pid;
};

/* Waits until etcd answers a read (a missing key counts). */
static inline bool test_etcd_ready(const char *url, int timeout_ms)
{
    struct moe_etcd *ec = NULL;
    struct moe_error err;
    bool ready = false;
    if (moe_etcd_create(url, 300, &ec, &err) == MOE_OK)
        for (int64_t t0 = moe_now_ms(); !ready && moe_now_ms() - t0 < timeout_ms; sleep_ms(30)) {
            struct moe_etcd_kv kv;
            enum moe_status st = moe_etcd_get(ec, "probe", &kv, NULL, &err);
            moe_etcd_kv_clear(&kv);
            ready = st == MOE_OK || st == MOE_ERR_NOT_FOUND;
        }
    moe_etcd_destroy(ec);
    return ready;
}

/* (Re)starts etcd: the first call picks the ports and the data directory
 * under `dir`; a later call (after test_etcd_kill) starts it again on the
 * same ports and data. Returns 0 once it answers. */
static inline int test_etcd_start(struct test_etcd *e, const char *dir)
{
    if (!e->client[0]) {
        snprintf(e->data, sizeof e->data, "%s/etcd-data", dir);
        snprintf(e->log, sizeof e->log, "%s/etcd.log", dir);
        snprintf(e->client, sizeof e->client, "http://127.0.0.1:%d", free_port());
        snprintf(e->peer, sizeof e->peer, "http://127.0.0.1:%d", free_port());
    }
    char cluster[80];
    snprintf(cluster, sizeof cluster, "n=%s", e->peer);
    char *argv[] = {e->bin,    "--name",
                    "n",       "--data-dir",
                    e->data,   "--listen-client-urls",
                    e->client, "--advertise-client-urls",
                    e->client, "--listen-peer-urls",
                    e->peer,   "--initial-advertise-peer-urls",
                    e->peer,   "--initial-cluster",
                    cluster,   "--heartbeat-interval",
                    "10",      "--election-timeout",
                    "100",     "--log-level",
                    "error",   NULL};
    e->pid = child_spawn(argv, NULL, NULL, e->log);
    return e->pid > 0 && test_etcd_ready(e->client, 30000) ? 0 : -1;
}

static inline void test_etcd_kill(struct test_etcd *e)
{
    if (e->pid > 0)
        child_kill9(e->pid);
    e->pid = 0;
}

/* ---- the coordinator's view (Admin) ---------------------------------------------------- */

static inline Moe__V1__ListWorkersResponse *list_workers(struct rpc_client *cl)
{
    Moe__V1__ListWorkersRequest rq = MOE__V1__LIST_WORKERS_REQUEST__INIT;
    enum rpc_code code;
    return call(cl, "/moe.v1.Admin/ListWorkers", &rq, &moe__v1__list_workers_response__descriptor,
                &code, NULL, 0);
}

/* State of worker `id` in ListWorkers; 0 if absent, -1 on failure. */
static inline int worker_state(struct rpc_client *coord, const char *id)
{
    Moe__V1__ListWorkersResponse *lw = list_workers(coord);
    if (!lw)
        return -1;
    int st = 0;
    for (size_t i = 0; i < lw->n_workers; i++)
        if (!strcmp(lw->workers[i]->id, id))
            st = lw->workers[i]->state;
    moe__v1__list_workers_response__free_unpacked(lw, NULL);
    return st;
}

static inline bool wait_worker_state(struct rpc_client *coord, const char *id, int want,
                                     int timeout_ms)
{
    for (int64_t t0 = moe_now_ms(); moe_now_ms() - t0 < timeout_ms; sleep_ms(50))
        if (worker_state(coord, id) == want)
            return true;
    return false;
}

/* Admin DrainWorker / UndrainWorker; true on OK. */
static inline bool admin_drain(struct rpc_client *coord, const char *id, bool drain)
{
    enum rpc_code code;
    void *r;
    if (drain) {
        Moe__V1__DrainWorkerRequest rq = MOE__V1__DRAIN_WORKER_REQUEST__INIT;
        rq.id = (char *)id;
        r = call(coord, "/moe.v1.Admin/DrainWorker", &rq,
                 &moe__v1__drain_worker_response__descriptor, &code, NULL, 0);
    } else {
        Moe__V1__UndrainWorkerRequest rq = MOE__V1__UNDRAIN_WORKER_REQUEST__INIT;
        rq.id = (char *)id;
        r = call(coord, "/moe.v1.Admin/UndrainWorker", &rq,
                 &moe__v1__undrain_worker_response__descriptor, &code, NULL, 0);
    }
    if (r)
        protobuf_c_message_free_unpacked(r, NULL);
    return r != NULL;
}

#endif
