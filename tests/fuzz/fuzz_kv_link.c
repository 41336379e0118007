/* Fuzz target: the KV data plane's frames (worker/disagg/kv_link.c): the 12-byte
 * head (kv_link_head_parse) and the body of every message type
 * (kv_link_msg_parse), the functions the server's connection threads and the
 * clients' answer readers decode every message with.
 *
 * Input: a head followed by a body, as on the socket. The body is decoded
 * as the head's type when the head is valid, and as each of the five types
 * anyway. What must hold: a refusal is one line naming the message and the
 * field; an accepted message has its counts within their limits, arrays
 * present for non-zero counts, strings terminated within their buffers. */
#include "fuzz.h"
#include "disagg/kv_link.h"

static void check_str(const char *s, size_t cap, const char *field)
{
    FUZZ_CHECK(memchr(s, '\0', cap), "'%s' is not terminated", field);
}

static void parse_as(uint32_t type, const uint8_t *body, size_t len)
{
    struct kv_link_msg *m = malloc(sizeof *m);
    if (!m)
        return;
    struct moe_error err = {0};
    enum moe_status st = kv_link_msg_parse(type, body, len, m, &err);
    if (st != MOE_OK) {
        FUZZ_CHECK(err.code == st && fuzz_msg_ok(err.msg), "status %d: '%s'", st, err.msg);
        FUZZ_CHECK(st == MOE_ERR_NOMEM || strstr(err.msg, "malformed") ||
                       strstr(err.msg, "unknown KV link message type"),
                   "'%s'", err.msg);
        FUZZ_CHECK(!m->blocks && !m->src_blocks && !m->targets, "arrays kept after an error");
        free(m);
        return;
    }
    FUZZ_CHECK(m->type == type, "type %u decoded as %u", type, m->type);
    check_str(m->id, sizeof m->id, "id");
    check_str(m->sender, sizeof m->sender, "sender");
    check_str(m->msg, sizeof m->msg, "msg");
    FUZZ_CHECK(m->n_blocks >= 0 && m->n_blocks <= KV_LINK_MAX_BLOCKS && (!m->n_blocks || m->blocks),
               "%d blocks", m->n_blocks);
    FUZZ_CHECK(m->n_src_blocks >= 0 && m->n_src_blocks <= KV_LINK_MAX_BLOCKS &&
                   (!m->n_src_blocks || m->src_blocks),
               "%d source blocks", m->n_src_blocks);
    if (type == KV_LINK_MSG_ORDER) {
        FUZZ_CHECK(m->n_targets >= 1 && m->n_targets <= KV_LINK_MAX_RANKS && m->targets,
                   "%d targets", m->n_targets);
        for (int i = 0; i < m->n_targets; i++)
            check_str(m->targets[i].endpoint, sizeof m->targets[i].endpoint, "endpoint");
    } else {
        FUZZ_CHECK(!m->n_targets && !m->targets, "targets in a non-ORDER message");
    }
    /* touch every decoded element, so that ASan sees a short array */
    uint64_t sum = 0;
    for (int i = 0; i < m->n_blocks; i++)
        sum += (uint32_t)m->blocks[i];
    for (int i = 0; i < m->n_src_blocks; i++)
        sum += (uint32_t)m->src_blocks[i];
    (void)sum;
    kv_link_msg_clear(m);
    FUZZ_CHECK(!m->blocks && !m->type, "kv_link_msg_clear left fields");
    free(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < KV_LINK_HEAD_BYTES) {
        for (uint32_t t = 0; t <= KV_LINK_MSG_STATUS + 1; t++)
            parse_as(t, data, size);
        return 0;
    }
    uint32_t type = 0, len = 0;
    struct moe_error err = {0};
    const uint8_t *body = data + KV_LINK_HEAD_BYTES;
    size_t n = size - KV_LINK_HEAD_BYTES;
    if (kv_link_head_parse(data, &type, &len, &err) == MOE_OK) {
        FUZZ_CHECK(len <= KV_LINK_MAX_BODY, "body of %u bytes accepted", len);
        parse_as(type, body, len < n ? len : n);
    } else {
        FUZZ_CHECK(fuzz_msg_ok(err.msg) && strstr(err.msg, "not a KV link message"), "'%s'",
                   err.msg);
    }
    for (uint32_t t = KV_LINK_MSG_EXPECT; t <= KV_LINK_MSG_STATUS; t++)
        parse_as(t, body, n);
    return 0;
}
