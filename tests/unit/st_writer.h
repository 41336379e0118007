/* Test helper: writes small safetensors files into the test's temp dir.
 * Header-only because each unit test is compiled with testlib.c alone. */
#ifndef MOE_TEST_ST_WRITER_H
#define MOE_TEST_ST_WRITER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

/* Bytes of a safetensors file: the 8-byte little-endian `header_len_field`
 * (normally strlen(header)), the header text, then `n_data` bytes of data.
 * Returns a malloc'ed buffer of *n_out bytes (caller frees). */
static inline unsigned char *st_build(uint64_t header_len_field, const char *header,
                                      const void *data, size_t n_data, size_t *n_out)
{
    size_t hl = strlen(header);
    size_t n = 8 + hl + n_data;
    unsigned char *buf = malloc(n ? n : 1);
    if (!buf)
        abort();
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(header_len_field >> (8 * i));
    memcpy(buf + 8, header, hl);
    if (n_data)
        memcpy(buf + 8 + hl, data, n_data);
    *n_out = n;
    return buf;
}

/* Writes a well-formed file (header length = strlen(header)) called `name`
 * in the temp dir; returns its path (testlib's static buffer). */
static inline const char *st_write(const char *name, const char *header, const void *data,
                                   size_t n_data)
{
    size_t n;
    unsigned char *buf = st_build(strlen(header), header, data, n_data, &n);
    const char *path = test_write_temp(name, buf, n);
    free(buf);
    return path;
}

/* Builds a valid file tensor by tensor: offsets are assigned in order, with
 * no gap, so the data area is exactly the tensors' bytes. */
struct st_builder {
    char header[16384];
    size_t hlen;
    unsigned char data[65536];
    size_t n_data;
    int n_tensor;
};

static inline void st_builder_init(struct st_builder *b, const char *metadata_json)
{
    memset(b, 0, sizeof *b);
    b->hlen = (size_t)snprintf(b->header, sizeof b->header, "{");
    if (metadata_json) {
        b->hlen += (size_t)snprintf(b->header + b->hlen, sizeof b->header - b->hlen,
                                    "\"__metadata__\":%s", metadata_json);
        b->n_tensor++; /* forces a comma before the first tensor */
    }
}

/* `shape_json` e.g. "[4, 5]"; `bytes` are the tensor's raw little-endian data. */
static inline void st_builder_add(struct st_builder *b, const char *name, const char *dtype,
                                  const char *shape_json, const void *bytes, size_t nbytes)
{
    if (b->n_data + nbytes > sizeof b->data)
        abort();
    b->hlen += (size_t)snprintf(
        b->header + b->hlen, sizeof b->header - b->hlen,
        "%s\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%zu,%zu]}",
        b->n_tensor ? "," : "", name, dtype, shape_json, b->n_data, b->n_data + nbytes);
    if (b->hlen >= sizeof b->header)
        abort();
    if (nbytes)
        memcpy(b->data + b->n_data, bytes, nbytes);
    b->n_data += nbytes;
    b->n_tensor++;
}

/* Closes the header, pads it with spaces to a length == pad_mod (mod 8)
 * (an odd length leaves every tensor unaligned), writes the file. */
static inline const char *st_builder_write(struct st_builder *b, const char *name, int pad_mod)
{
    b->header[b->hlen++] = '}';
    while ((b->hlen % 8) != (size_t)pad_mod % 8)
        b->header[b->hlen++] = ' ';
    b->header[b->hlen] = '\0';
    return st_write(name, b->header, b->data, b->n_data);
}

#endif
