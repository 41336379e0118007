#include "model_info.h"

void moe_model_info_fill(Moe__V1__ModelInfo *info, const struct moe_config *c, const char *name,
                         const char *dtype, uint32_t eos[MOE_MAX_EOS])
{
    info->name = (char *)name;
    info->architecture = (char *)moe_arch_model_type(c->arch);
    info->vocab_size = (uint32_t)c->vocab_size;
    info->max_context = (uint32_t)c->max_pos;
    info->n_layer = (uint32_t)c->n_layer;
    info->d_model = (uint32_t)c->d_model;
    info->n_head = (uint32_t)c->n_head;
    info->n_kv_head = (uint32_t)c->n_kv_head;
    info->n_expert = (uint32_t)c->n_expert;
    info->top_k = (uint32_t)c->top_k;
    info->dtype = (char *)dtype;
    for (int i = 0; i < c->n_eos; i++)
        eos[i] = (uint32_t)c->eos_ids[i];
    info->n_eos_token_ids = (size_t)c->n_eos;
    info->eos_token_ids = eos;
    info->bos_token_id = c->bos_id >= 0 ? (uint32_t)c->bos_id : 0;
}
