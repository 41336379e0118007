/* KV handoffs that nobody claims expire and give their blocks back:
 *  - a prefill worker parks a sequence after its first token (prefill_only);
 *    no decode side asks for it; after --handoff-ttl-ms the parked blocks
 *    are freed and the handoff is gone (KvSend for it is refused);
 *  - a decode worker reserves blocks (KvReserve); no KV and no Generate
 *    arrive; after the TTL the reservation is freed.
 *
 *   test_handoff_expiry MOE_WORKER_BINARY MODEL_DIR */
#include "rpcutil.h"
#include "moe/v1/worker.pb-c.h"
#include "proc.h"
#include "rpc.h"
#include "testlib.h"

#define TTL_MS 400

/* Polls until the worker holds no blocks and no handoff; returns the seconds
 * it took, or -1 after timeout_s. */
static double wait_released(struct rpc_client *c, double timeout_s)
{
    double t0 = moe_now();
    while (moe_now() - t0 < timeout_s) {
        Moe__V1__WorkerLoad *l = get_load(c);
        bool idle = l && l->kv_blocks_used == 0 && l->handoffs_pending == 0;
        if (l)
            moe__v1__worker_load__free_unpacked(l, NULL);
        if (idle)
            return moe_now() - t0;
        usleep(20 * 1000);
    }
    return -1;
}

static int start_worker(struct test_proc *w, const char *bin, const char *model, const char *role,
                        char *addr, size_t cap)
{
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%d", TTL_MS);
    char *argv[] = {(char *)bin,   "--model",          (char *)model, "--dtype",
                    "f32",         "--threads",        "1",           "--listen",
                    "127.0.0.1:0", "--kv-blocks",      "256",         "--role",
                    (char *)role,  "--handoff-ttl-ms", ttl,           NULL};
    if (test_proc_start(w, argv))
        return -1;
    const char *line = test_proc_wait_for(w, " on 127.0.0.1:", 30);
    if (!line)
        return -1;
    snprintf(addr, cap, "127.0.0.1:%d", atoi(line + strlen(" on 127.0.0.1:")));
    return 0;
}

static void test_parked_expires(struct rpc_client *c)
{
    uint32_t prompt[40];
    for (int i = 0; i < 40; i++)
        prompt[i] = (uint32_t)(7 + 3 * i);
    Moe__V1__WorkerGenerateRequest rq = MOE__V1__WORKER_GENERATE_REQUEST__INIT;
    Moe__V1__SamplingParams sp = MOE__V1__SAMPLING_PARAMS__INIT;
    rq.request_id = "parked";
    rq.n_prompt_token_ids = 40;
    rq.prompt_token_ids = prompt;
    rq.sampling = &sp;
    rq.prefill_only = 1;
    rq.handoff_id = "h-parked";
    sp.max_tokens = 16;
    sp.ignore_eos = 1;
    size_t len;
    uint8_t *b = pack(&rq.base, &len);
    struct moe_error err;
    struct rpc_client_stream *st =
        rpc_client_stream_start(c, "/moe.v1.Worker/Generate", b, len, 10000, &err);
    free(b);
    int n = 0;
    const uint8_t *m;
    size_t ml;
    while (st && rpc_client_stream_next(st, &m, &ml)) {
        Moe__V1__GenerateResponse *r = moe__v1__generate_response__unpack(NULL, ml, m);
        if (r) {
            n += (int)r->n_token_ids;
            moe__v1__generate_response__free_unpacked(r, NULL);
        }
    }
    const char *msg = NULL;
    CHECKF(st && rpc_client_stream_status(st, &msg) == RPC_OK && n == 1,
           "prefill_only: %d tokens, %s", n, msg ? msg : "");
    rpc_client_stream_destroy(st);
    Moe__V1__WorkerLoad *l = get_load(c);
    CHECKF(l && l->kv_blocks_used >= 3 && l->handoffs_pending == 1,
           "after prefill: %u blocks used, %u handoffs pending", l ? l->kv_blocks_used : 0,
           l ? l->handoffs_pending : 0);
    if (l)
        moe__v1__worker_load__free_unpacked(l, NULL);
    double took = wait_released(c, 30.0);
    CHECKF(took >= 0, "parked handoff not released (%.2f s)", took);
    printf(
        "parked handoff expired and freed its blocks %.0f ms after the first token (ttl %d ms)\n",
        took * 1e3, TTL_MS);
    /* asking to send it now is refused: it is gone */
    Moe__V1__KvSendRequest sr = MOE__V1__KV_SEND_REQUEST__INIT;
    sr.handoff_id = "h-parked";
    sr.target_address = "127.0.0.1:1";
    b = pack(&sr.base, &len);
    struct rpc_reply reply;
    enum rpc_code code = rpc_client_call(c, "/moe.v1.Worker/KvSend", b, len, 5000, &reply);
    CHECKF(code != RPC_OK && strstr(reply.message, "h-parked"), "KvSend after expiry: %s '%s'",
           rpc_code_name(code), reply.message);
    rpc_reply_clear(&reply);
    free(b);
}

static void test_reservation_expires(struct rpc_client *c)
{
    Moe__V1__KvReserveRequest rq = MOE__V1__KV_RESERVE_REQUEST__INIT;
    rq.handoff_id = "h-reserved";
    rq.request_id = "reserved";
    rq.n_tokens = 40;
    rq.n_blocks = 3;
    rq.block_size = 16;
    rq.tp_size = 1;
    rq.n_layer = 3;
    rq.kv_dim = 64; /* qwen3_moe fixture: 2 KV heads x head_dim 32 */
    size_t len;
    uint8_t *b = pack(&rq.base, &len);
    struct rpc_reply reply;
    enum rpc_code code = rpc_client_call(c, "/moe.v1.Worker/KvReserve", b, len, 5000, &reply);
    free(b);
    Moe__V1__KvReserveResponse *r =
        code == RPC_OK ? moe__v1__kv_reserve_response__unpack(NULL, reply.len, reply.data) : NULL;
    CHECKF(r && r->ok && r->n_block_ids == 3, "KvReserve: %s '%s' %s", rpc_code_name(code),
           reply.message, r && r->error ? r->error : "");
    if (r)
        moe__v1__kv_reserve_response__free_unpacked(r, NULL);
    rpc_reply_clear(&reply);
    Moe__V1__WorkerLoad *l = get_load(c);
    CHECKF(l && l->kv_blocks_used == 3, "reserved blocks: %u", l ? l->kv_blocks_used : 0);
    if (l)
        moe__v1__worker_load__free_unpacked(l, NULL);
    double took = wait_released(c, 30.0);
    CHECKF(took >= 0, "reservation not released (%.2f s)", took);
    printf("reservation expired and freed its blocks %.0f ms after KvReserve (ttl %d ms)\n",
           took * 1e3, TTL_MS);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: test_handoff_expiry MOE_WORKER MODEL_DIR\n");
        return 2;
    }
    struct test_proc p, d;
    char pa[64], da[64];
    struct moe_error err;
    CHECK(start_worker(&p, argv[1], argv[2], "prefill", pa, sizeof pa) == 0);
    CHECK(start_worker(&d, argv[1], argv[2], "decode", da, sizeof da) == 0);
    struct rpc_client *pc = rpc_client_create(pa, NULL, &err);
    struct rpc_client *dc = rpc_client_create(da, NULL, &err);
    if (pc && dc && test_n_fail == 0) {
        test_parked_expires(pc);
        test_reservation_expires(dc);
    }
    rpc_client_destroy(pc);
    rpc_client_destroy(dc);
    test_proc_kill(&p);
    test_proc_kill(&d);
    return test_summary();
}
