/*
 * The portable build's 8-bit-activation products (qgemm_i8.h): the same integer sums one
 * column at a time, from each column's block as the file stores it. Kept in its own file
 * for length only: included once by qgemm_i8.h where the build has no vector path, after
 * its helpers, so the files form one translation unit.
 */
/* Column ``c``'s block ``bo`` as integer codes in element order, each sub-block's integer
 * scale ``isc`` (Q6_K's; 1 for the others), and each 32-element x block's multiplier A
 * and float offset B (see the top; Q6_K's A is d, its scales applied in int32); returns
 * the sub-block width. */
static int i8_column_codes(int base, const uint8_t *bo, int c, int q[QK_K], int isc[16],
                           float a[8], float b[8]) {
    for (int s = 0; s < 16; ++s) isc[s] = 1;
    if (base < QF_Q5_0) {
        const float dv = f16_bits_to_f32(((const uint16_t *)(bo + i8_off_d(base)))[c]);
        a[0] = dv;
        b[0] = base == QF_Q4_1 ? f16_bits_to_f32(((const uint16_t *)(bo + i8_off_m(base)))[c]) : 0.0f;
        for (int i = 0; i < i8_q_bytes(base); ++i) {
            const uint8_t byte = bo[i8_code_at(c, i)];
            if (base == QF_Q8_0) {
                q[i] = (int8_t)(byte ^ 0x80); /* stored as c + 128 */
            } else {
                q[i] = byte & 0x0F;
                q[i + 16] = byte >> 4;
            }
        }
        return QK;
    }
    uint8_t r[QB_Q5_K > QB_Q6_K ? QB_Q5_K : QB_Q6_K];
    i8_unpack_raw(base, bo, c, r);
    blk_codes_raw(base, r, q);
    if (base == QF_Q5_0 || base == QF_Q5_1) {
        a[0] = blk_f16(r);
        b[0] = base == QF_Q5_1 ? blk_f16(r + 2) : 0.0f;
        return QK;
    }
    if (base == QF_Q4_K || base == QF_Q5_K) {
        const float d = blk_f16(r), dmin = blk_f16(r + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(r + 4, sc, mn);
        for (int s = 0; s < 8; ++s) {
            a[s] = d * (float)sc[s];
            b[s] = -(dmin * (float)mn[s]);
        }
        return QK;
    }
    const float d = blk_f16(r + 208);
    for (int s = 0; s < 16; ++s) isc[s] = (int8_t)r[192 + s];
    for (int xb = 0; xb < 8; ++xb) {
        a[xb] = d;
        b[xb] = 0.0f;
    }
    return 16;
}

/* The same sums, one column at a time. */
static void I8K(i8_group_tile)(int base, int rt, const i8_rows_t *x0, int64_t gs, const uint8_t *grp,
                          const float *bias, float *y, int64_t ldy, int cols) {
    (void)gs;
    const int wb = i8_weights(base), off = i8_int_offset(base), fb = i8_has_m(base);
    const int64_t k = x0->k, nb = k / wb, bb = i8_group_block_bytes(base);
    for (int r = 0; r < rt; ++r) {
        const int8_t *xr = x0->xq + r * k;
        const float *dxr = x0->dx + r * (k / QK);
        const int32_t *sqr = x0->sq + r * (k / 16);
        float acc[I8G] = {0};
        for (int64_t b = 0; b < nb; ++b)
            for (int c = 0; c < I8G; ++c) {
                int q[QK_K], isc[16];
                float a[8], bo[8];
                const int w = i8_column_codes(base, grp + b * bb, c, q, isc, a, bo);
                for (int xb = 0; xb < wb / QK; ++xb) { /* the 32-element x blocks */
                    const int64_t e0 = b * wb + (int64_t)xb * QK;
                    int32_t isum = 0;
                    for (int s = 0; s < QK / w; ++s) { /* the sub-blocks in it */
                        const int64_t e = e0 + (int64_t)s * w;
                        int32_t dot = 0, sqv = sqr[e / 16];
                        if (w == QK) sqv += sqr[e / 16 + 1];
                        for (int i = 0; i < w; ++i) dot += q[e - b * wb + i] * xr[e + i];
                        isum += isc[(e - b * wb) / w] * (dot - off * sqv);
                    }
                    const int32_t sqv = sqr[e0 / 16] + sqr[e0 / 16 + 1];
                    const float d = dxr[e0 / QK];
                    acc[c] += (float)isum * (a[xb] * d);
                    if (fb) acc[c] += bo[xb] * (d * (float)sqv);
                }
            }
        for (int c = 0; c < cols; ++c) y[r * ldy + c] = acc[c] + (bias ? bias[c] : 0.0f);
    }
}
