/* Fuzz target: the OpenAI-compatible request bodies the coordinator's HTTP
 * front door parses (coordinator/openai.c): every field of /v1/completions
 * and /v1/chat/completions, the chat template rendering of `messages`, and
 * then the checks every request meets before it is routed
 * (common/request_check.c). Whoever can reach the HTTP port sends these.
 *
 * The parsers are static, so this file includes openai.c (it defines all of
 * that file's symbols: the library's copy is never linked in). The model is
 * the bundled one (deploy/model/moe-tiny-en: its config, tokenizer and
 * chat template).
 *
 * Input: byte 0 picks the route (even: completions, odd: chat), the rest is
 * the body. What must hold: a refusal is one line with a status of 400,
 * 404, 413 or 501 (500 only for out of memory) and names a field or none;
 * an accepted request has 1..OA_MAX_CHOICES choices, its prompt ids within
 * the vocabulary and under the context, and its sampling either passes the
 * routing checks or is refused by them with a "sampling." message. */
#include "openai.c"

#include "chat_template.h"
#include "fuzz.h"

static struct coord coord;
static struct coord_http http;

static void init(void)
{
    static int done;
    if (done)
        return;
    done = 1;
    struct moe_error err = {0};
    FUZZ_CHECK(moe_config_load(fuzz_src_path("deploy/model/moe-tiny-en/config.json"), &coord.cfg,
                               &err) == MOE_OK,
               "%s", err.msg);
    FUZZ_CHECK(moe_tokenizer_load(fuzz_src_path("deploy/model/moe-tiny-en/tokenizer.json"),
                                  &coord.tok, &err) == MOE_OK,
               "%s", err.msg);
    snprintf(coord.model_name, sizeof coord.model_name, "moe-tiny-en");
    http.c = &coord;
    http.tmpl = chat_template_load(fuzz_src_path("deploy/model/moe-tiny-en"), &err);
    FUZZ_CHECK(http.tmpl, "%s", err.msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    init();
    bool chat = data[0] & 1;
    cJSON *body = cJSON_ParseWithLength((const char *)data + 1, size - 1);
    if (!body)
        return 0; /* answered 400 "the body is not JSON" before any field is read */
    struct oa_params *p = calloc(1, sizeof *p);
    FUZZ_CHECK(p, "out of memory");
    struct perr e = {0};
    bool ok = chat ? parse_chat(&http, body, p, &e) : parse_completions(&http, body, p, &e);
    if (!ok) {
        FUZZ_CHECK(e.set && (e.status == 400 || e.status == 404 || e.status == 413 ||
                             e.status == 500 || e.status == 501),
                   "refused with status %d", e.status);
        FUZZ_CHECK(fuzz_msg_ok(e.msg), "refusal '%s'", e.msg);
    } else {
        FUZZ_CHECK(p->n_prompts >= 1 && p->n >= 1 && p->n_prompts * p->n <= OA_MAX_CHOICES,
                   "%d prompts x n %d", p->n_prompts, p->n);
        char msg[1024];
        for (int i = 0; i < p->n_prompts; i++) {
            const struct oa_prompt *pr = &p->prompts[i];
            FUZZ_CHECK(pr->text || pr->ids, "prompt %d is neither text nor ids", i);
            for (size_t k = 0; pr->ids && k < pr->n_ids; k++)
                FUZZ_CHECK(pr->ids[k] < (uint32_t)coord.cfg.vocab_size, "prompt %d id %u", i,
                           pr->ids[k]);
            if (pr->ids &&
                moe_check_lengths(pr->n_ids, &p->sp, (unsigned)coord.cfg.max_pos, msg, sizeof msg))
                FUZZ_CHECK(fuzz_msg_ok(msg), "length refusal '%s'", msg);
        }
        if (moe_check_generation(NULL, &p->sp, (unsigned)coord.cfg.vocab_size, msg, sizeof msg))
            FUZZ_CHECK(fuzz_msg_ok(msg) && !strncmp(msg, "sampling.", 9), "refusal '%s'", msg);
        FUZZ_CHECK(p->sp.max_tokens <= (uint32_t)coord.cfg.max_pos, "max_tokens %u",
                   p->sp.max_tokens);
    }
    params_free(p);
    free(p);
    cJSON_Delete(body);
    return 0;
}
