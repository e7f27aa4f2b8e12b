/*
 * Scalar conversions between float32 and the 16-bit float formats, rounding to nearest
 * even as torch does, so a value written by the kernels has the bits torch's ``.to()``
 * gives it. Included by the sources that need them.
 */
#ifndef PAGEDSERVE_CONVERT_H
#define PAGEDSERVE_CONVERT_H

#include <stdint.h>
#include <string.h>

static inline float bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_bf16(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
