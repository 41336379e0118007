/* The project's pseudo-random numbers, one copy for the engine's sampler,
 * the benchmark client's workloads and the model maker: xoshiro256**
 * (Blackman and Vigna) for streams, splitmix64 to seed it (nearby seeds give
 * unrelated states) and to mix a single value. Header-only: every caller's
 * numbers are these, bit for bit, whatever it links. */
#ifndef MOE_RNG_H
#define MOE_RNG_H

#include <stdint.h>

/* The next output of the splitmix64 sequence at *x (advancing it). */
static inline uint64_t moe_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t moe_rotl64(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* xoshiro256**: the next 64 bits of the stream in s (never all zero; a
 * splitmix64 seeding never gives that). */
static inline uint64_t moe_xoshiro256ss(uint64_t s[4])
{
    const uint64_t result = moe_rotl64(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = moe_rotl64(s[3], 45);
    return result;
}

/* 64 random bits -> a double uniform in [0, 1) (the top 53). */
static inline double moe_u64_to_unit(uint64_t r)
{
    return (double)(r >> 11) * 0x1.0p-53;
}

#endif
