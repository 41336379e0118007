/* The ModelInfo message (proto/moe/v1/inference.proto) that the
 * coordinator's Inference service and a worker's Worker service both
 * answer, filled from one model configuration. */
#ifndef MOE_MODEL_INFO_H
#define MOE_MODEL_INFO_H

#include <stdint.h>

#include "model_config.h"
#include "moe/v1/inference.pb-c.h"

/* *info (initialised by the caller) gets c's shape, `name` and `dtype`
 * (borrowed) and the end-of-sequence ids, written into eos (borrowed too). */
void moe_model_info_fill(Moe__V1__ModelInfo *info, const struct moe_config *c, const char *name,
                         const char *dtype, uint32_t eos[MOE_MAX_EOS]);

#endif
