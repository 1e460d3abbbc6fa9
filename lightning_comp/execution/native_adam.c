/* Adam(W)'s step of the managed parameters on a CPU, all of them in one call (lc_adam_steps), in the formats a plan's
 * `state`/`master` entries manage: moments as 8-bit block-quantised codes (block by block) or as FP32 or BF16 tensors
 * (element by element), weights FP32 or BF16.
 *
 * Built at first use by lightning_comp.execution.native_build and called through ctypes by
 * lightning_comp.execution.native_adam, which documents the arguments and what this file computes. The arithmetic is
 * lightning_comp.execution.fused_adam's step functions', operation for operation, in FP32 (no contraction into FMAs:
 * the build passes -ffp-contract=off). 8-bit codes are decoded through the map's own 256 values and, after Adam(W),
 * each block's new moments are scaled by their largest magnitude and encoded by lightning_comp.numerics.dynamic_codec's
 * arithmetic, whose constants come in as arguments (one owner of those numbers: that module). What the compiled
 * (torch.compile) path does in four passes over the whole tensor, with FP32 moments written to memory between them,
 * happens here within one block of 256 elements, in the core's cache. BF16 values (weights, moments) are rounded
 * stochastically from lightning_comp.numerics.stochastic_rounding's hash of a key and the element's index, or to
 * nearest even.
 *
 * The loops are written to be vectorised by the compiler (-O3): selects instead of branches, no calls but sqrtf and
 * floorf (-fno-math-errno makes them instructions); where the compiler may use AVX2 but not AVX-512, the 8-bit codes
 * are encoded with intrinsics instead (encode_vector: the same codes, in about two thirds of the time). The tensors
 * are cut into units of about UNIT elements, and the units of all of them are shared among `threads` OpenMP threads
 * in one parallel region, so that small tensors share the threads too and a step pays for one region, not one per
 * tensor; built without OpenMP the pragmas are ignored and one thread does it all.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The vector encode (encode_vector below) where the compiler may use AVX2 but not AVX-512. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#define LC_VECTOR_ENCODE 1
#else
#define LC_VECTOR_ENCODE 0
#endif

#define BLOCK 256
#define DECADES 7
#define SELECT(c, a, b) ((c) ? (a) : (b))

/* The layout of an encoding table (lightning_comp.numerics.dynamic_codec.encoding_table): per decade its multiplier,
 * offset, first code magnitude and last in-decade index; then the six thresholds between decades; then the
 * magnitudes below which a value is zero and from which it is one; then the code magnitude of one. */
#define T_MUL 0
#define T_OFF (DECADES)
#define T_FIRST (2 * DECADES)
#define T_LAST (3 * DECADES)
#define T_BETWEEN (4 * DECADES)
#define T_ZERO (5 * DECADES - 1)
#define T_ONE (5 * DECADES)
#define T_TOP (5 * DECADES + 1)

/* The code magnitude of |y| (y = a block value divided by the block's scale): dynamic_codec.encode's arithmetic. */
static inline float code_magnitude(float y, const float *restrict t) {
    float mul = t[T_MUL], off = t[T_OFF], first = t[T_FIRST], last = t[T_LAST];
    for (int d = 1; d < DECADES; d++) {
        int above = y >= t[T_BETWEEN + d - 1];
        mul = SELECT(above, t[T_MUL + d], mul);
        off = SELECT(above, t[T_OFF + d], off);
        first = SELECT(above, t[T_FIRST + d], first);
        last = SELECT(above, t[T_LAST + d], last);
    }
    float within = floorf(y * mul - off);
    within = SELECT(within < 0.0f, 0.0f, within);
    within = SELECT(within < last, within, last);
    float magnitude = SELECT(y < t[T_ZERO], 0.0f, first + within);
    return SELECT(y >= t[T_ONE], t[T_TOP], magnitude);
}

static void encode_signed_portable(const float *restrict values, float scale, const float *restrict table,
                                   uint8_t *restrict out) {
    float t[T_TOP + 1]; /* a local copy: its loads leave the loop, which then vectorises */
    memcpy(t, table, sizeof(t));
    for (int i = 0; i < BLOCK; i++) {
        float scaled = values[i] / scale;
        float magnitude = code_magnitude(fabsf(scaled), t);
        float negative = 127.0f - SELECT(magnitude < 127.0f, magnitude, 127.0f); /* the negative half has no -1 */
        out[i] = (uint8_t)(int32_t)SELECT(scaled < 0.0f, negative, 127.0f + magnitude);
    }
}

static void encode_unsigned_portable(const float *restrict values, float scale, const float *restrict table,
                                     uint8_t *restrict out) {
    float t[T_TOP + 1];
    memcpy(t, table, sizeof(t));
    for (int i = 0; i < BLOCK; i++) {
        out[i] = (uint8_t)(int32_t)code_magnitude(fabsf(values[i] / scale), t);
    }
}

/* The same codes with AVX2, eight values at a time, where the compiler may use AVX2 but not AVX-512 (with AVX-512
 * the compiler's selects take mask registers and the portable loops are faster: on one AMD EPYC with AVX-512 (Zen 5,
 * gcc 12, -march=native) the whole 8-bit step read 0.67-0.72 ns per element at 1-4 M elements through them against
 * 0.89-0.97 with this encode forced on, two alternating runs each). In the portable loops
 * each of the four columns of a value's decade row costs six selects; here the decade is the count of thresholds
 * the value reaches (they increase, so it is the last decade the selects would take) and each column is read from
 * its row by one permute. Everything after is the portable arithmetic, operation for operation: ordered
 * comparisons and selects (a NaN compares false, as in C), a product then a difference (no FMA), truncation to
 * int32. On one AVX2 core (AMD EPYC, Zen 3) the two encodes of a block took 1.9 ns per element against 2.7 by the
 * portable loops; tests/unit/test_native_adam.py checks that both give the same codes. */
#if LC_VECTOR_ENCODE
static inline __m256 select8(__m256 condition, __m256 a, __m256 b) { return _mm256_blendv_ps(b, a, condition); }

static inline __m256 code_magnitude8(__m256 y, const float *restrict t, const __m256 *restrict columns) {
    __m256i decade = _mm256_setzero_si256();
    for (int d = 1; d < DECADES; d++) { /* a true comparison is all ones: -1 */
        __m256 above = _mm256_cmp_ps(y, _mm256_set1_ps(t[T_BETWEEN + d - 1]), _CMP_GE_OQ);
        decade = _mm256_sub_epi32(decade, _mm256_castps_si256(above));
    }
    __m256 mul = _mm256_permutevar8x32_ps(columns[0], decade), off = _mm256_permutevar8x32_ps(columns[1], decade);
    __m256 first = _mm256_permutevar8x32_ps(columns[2], decade), last = _mm256_permutevar8x32_ps(columns[3], decade);
    __m256 zero = _mm256_setzero_ps();
    __m256 within = _mm256_floor_ps(_mm256_sub_ps(_mm256_mul_ps(y, mul), off));
    within = select8(_mm256_cmp_ps(within, zero, _CMP_LT_OQ), zero, within);
    within = select8(_mm256_cmp_ps(within, last, _CMP_LT_OQ), within, last);
    __m256 magnitude = select8(_mm256_cmp_ps(y, _mm256_set1_ps(t[T_ZERO]), _CMP_LT_OQ), zero,
                               _mm256_add_ps(first, within));
    return select8(_mm256_cmp_ps(y, _mm256_set1_ps(t[T_ONE]), _CMP_GE_OQ), _mm256_set1_ps(t[T_TOP]), magnitude);
}

static void encode_vector(const float *restrict values, float scale, const float *restrict table, int is_signed,
                          uint8_t *restrict out) {
    __m256 columns[4]; /* multiplier, offset, first and last of the seven decades, an eighth lane never read */
    for (int c = 0; c < 4; c++) {
        float column[8] = {0.0f};
        memcpy(column, table + c * DECADES, DECADES * sizeof(float));
        columns[c] = _mm256_loadu_ps(column);
    }
    const __m256 divisor = _mm256_set1_ps(scale), sign = _mm256_set1_ps(-0.0f), middle = _mm256_set1_ps(127.0f);
    for (int i = 0; i < BLOCK; i += 32) {
        __m256i codes[4];
        for (int k = 0; k < 4; k++) {
            __m256 scaled = _mm256_div_ps(_mm256_loadu_ps(values + i + 8 * k), divisor);
            __m256 magnitude = code_magnitude8(_mm256_andnot_ps(sign, scaled), table, columns);
            if (is_signed) {
                __m256 capped = select8(_mm256_cmp_ps(magnitude, middle, _CMP_LT_OQ), magnitude, middle);
                magnitude = select8(_mm256_cmp_ps(scaled, _mm256_setzero_ps(), _CMP_LT_OQ),
                                    _mm256_sub_ps(middle, capped), _mm256_add_ps(middle, magnitude));
            }
            codes[k] = _mm256_cvttps_epi32(magnitude);
        }
        /* 32 codes in [0, 255] to bytes: the packs work within 128-bit lanes, the permute restores the order */
        __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(codes[0], codes[1]),
                                            _mm256_packus_epi32(codes[2], codes[3]));
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(out + i), bytes);
    }
}
#endif

/* A block's codes: the values divided by `scale`, encoded with `table` (the signed map's or the unsigned one's); by
 * the portable loops or, where built (LC_VECTOR_ENCODE) and not `portable`, the vector ones. */
static void encode_block(const float *restrict values, float scale, const float *restrict table, int is_signed,
                         int portable, uint8_t *restrict out) {
#if LC_VECTOR_ENCODE
    if (!portable) {
        encode_vector(values, scale, table, is_signed, out);
        return;
    }
#endif
    (void)portable;
    if (is_signed) {
        encode_signed_portable(values, scale, table, out);
    } else {
        encode_unsigned_portable(values, scale, table, out);
    }
}

/* The block's scale: its largest magnitude, at least 1e-12; NaN if any value is NaN (as torch's amax and clamp).
 * Magnitudes are compared as the integers of their bits (in the same order as the floats, NaN above infinity), which
 * vectorises where a float maximum that must keep NaN does not. */
static float block_scale(const float *restrict values) {
    uint32_t largest = 0u;
    for (int i = 0; i < BLOCK; i++) {
        uint32_t bits;
        memcpy(&bits, values + i, 4);
        bits &= 0x7FFFFFFFu;
        largest = SELECT(bits > largest, bits, largest);
    }
    if (largest > 0x7F800000u) {
        return NAN;
    }
    float scale;
    memcpy(&scale, &largest, 4);
    return SELECT(scale < 1e-12f, 1e-12f, scale);
}

/* The hyper-parameters, in lightning_comp.execution.fused_adam.HYPER_PARAMETERS's order. */
typedef struct {
    float sign, l2, keep, beta1_rest, beta2, beta2_rest, step_size, bias2_sqrt, eps;
} Hyper;

static inline float adam(float *m, float *v, float w, float g, const Hyper *h) {
    g = g * h->sign + w * h->l2;
    w = w * h->keep;
    *m = *m + (g - *m) * h->beta1_rest;
    *v = *v * h->beta2 + g * g * h->beta2_rest;
    return w - h->step_size * *m / (sqrtf(*v) / h->bias2_sqrt + h->eps);
}

static void step_fp32_block(float *restrict w, const float *restrict g, const uint8_t *restrict m_codes,
                            const uint8_t *restrict v_codes, float m_scale, float v_scale, const Hyper *h,
                            const float *restrict m_map, const float *restrict v_map, float *restrict m_out,
                            float *restrict v_out) {
    for (int i = 0; i < BLOCK; i++) {
        float m = m_map[(int32_t)m_codes[i]] * m_scale, v = v_map[(int32_t)v_codes[i]] * v_scale;
        w[i] = adam(&m, &v, w[i], g[i], h);
        m_out[i] = m;
        v_out[i] = v;
    }
}

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, 4);
    return value;
}

/* lowbias32 (lightning_comp.numerics.stochastic_rounding._mix). */
static inline uint32_t mix(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* FP32 -> BF16: with `noise` (< 2^16) added to the low bits and truncated (stochastic_rounding._rounded), or to
 * nearest even (noise < 0); non-finite values to nearest (NaN to c10's quiet NaN). */
static inline uint16_t to_bf16(float value, int64_t noise) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint32_t nearest = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    uint32_t finite = (bits & 0x7F800000u) != 0x7F800000u;
    uint32_t nan = !finite && (bits & 0x007FFFFFu) != 0u;
    uint32_t noisy = (bits + (uint32_t)noise) >> 16;
    uint32_t rounded = SELECT(noise >= 0 && finite, noisy, SELECT(finite, nearest, SELECT(nan, 0x7FC0u, bits >> 16)));
    return (uint16_t)rounded;
}

static void step_bf16_block(uint16_t *restrict w, const uint16_t *restrict g, const uint8_t *restrict m_codes,
                            const uint8_t *restrict v_codes, float m_scale, float v_scale, const Hyper *h,
                            const float *restrict m_map, const float *restrict v_map, float *restrict m_out,
                            float *restrict v_out, int stochastic, uint32_t key, int64_t first_index) {
    for (int i = 0; i < BLOCK; i++) {
        float m = m_map[(int32_t)m_codes[i]] * m_scale, v = v_map[(int32_t)v_codes[i]] * v_scale;
        float updated = adam(&m, &v, bf16_to_float(w[i]), bf16_to_float(g[i]), h);
        int64_t noise = stochastic ? (int64_t)(mix(key + (uint32_t)(first_index + i)) & 0xFFFFu) : -1;
        w[i] = to_bf16(updated, noise);
        m_out[i] = m;
        v_out[i] = v;
    }
}

/* Blocks [first, last) of a parameter of `blocks` blocks whose moments are packed 8-bit tensors (codes, then the
 * blocks' FP32 scales: lightning_comp.numerics.block_quant.pack), updated in place. */
static void step_8bit_blocks(void *weights, const void *grad, int bf16_weights, uint8_t *m_packed, uint8_t *v_packed,
                             int64_t blocks, int64_t first, int64_t last, const Hyper *h, const float *m_map,
                             const float *v_map, const float *m_table, const float *v_table, int stochastic,
                             uint32_t key) {
    uint8_t *m_scales = m_packed + blocks * BLOCK, *v_scales = v_packed + blocks * BLOCK;
    for (int64_t b = first; b < last; b++) {
        float m_new[BLOCK], v_new[BLOCK], m_scale, v_scale;
        memcpy(&m_scale, m_scales + 4 * b, 4);
        memcpy(&v_scale, v_scales + 4 * b, 4);
        uint8_t *m_codes = m_packed + b * BLOCK, *v_codes = v_packed + b * BLOCK;
        if (bf16_weights) {
            step_bf16_block((uint16_t *)weights + b * BLOCK, (const uint16_t *)grad + b * BLOCK, m_codes, v_codes,
                            m_scale, v_scale, h, m_map, v_map, m_new, v_new, stochastic, key, b * BLOCK);
        } else {
            step_fp32_block((float *)weights + b * BLOCK, (const float *)grad + b * BLOCK, m_codes, v_codes,
                            m_scale, v_scale, h, m_map, v_map, m_new, v_new);
        }
        m_scale = block_scale(m_new);
        v_scale = block_scale(v_new);
        encode_block(m_new, m_scale, m_table, 1, 0, m_codes);
        encode_block(v_new, v_scale, v_table, 0, 0, v_codes);
        memcpy(m_scales + 4 * b, &m_scale, 4);
        memcpy(v_scales + 4 * b, &v_scale, 4);
    }
}

/* Elements [start, end) of a dense step; the format flags are constants at each call (DENSE below), so that every
 * combination compiles to its own loop without branches. */
static inline __attribute__((always_inline)) void dense_range(
        void *weights, const void *grad, void *exp_avg, void *exp_avg_sq, int64_t start, int64_t end, const Hyper *h,
        uint32_t key, uint32_t m_key, uint32_t v_key, const int bf16_weights, const int bf16_moments,
        const int stochastic) {
    for (int64_t i = start; i < end; i++) {
        float w = bf16_weights ? bf16_to_float(((const uint16_t *)weights)[i]) : ((const float *)weights)[i];
        float g = bf16_weights ? bf16_to_float(((const uint16_t *)grad)[i]) : ((const float *)grad)[i];
        float m = bf16_moments ? bf16_to_float(((const uint16_t *)exp_avg)[i]) : ((const float *)exp_avg)[i];
        float v = bf16_moments ? bf16_to_float(((const uint16_t *)exp_avg_sq)[i]) : ((const float *)exp_avg_sq)[i];
        w = adam(&m, &v, w, g, h);
        if (bf16_moments) {
            ((uint16_t *)exp_avg)[i] = to_bf16(m, (int64_t)(mix(m_key + (uint32_t)i) & 0xFFFFu));
            ((uint16_t *)exp_avg_sq)[i] = to_bf16(v, (int64_t)(mix(v_key + (uint32_t)i) & 0xFFFFu));
        } else {
            ((float *)exp_avg)[i] = m;
            ((float *)exp_avg_sq)[i] = v;
        }
        if (bf16_weights) {
            ((uint16_t *)weights)[i] = to_bf16(w, stochastic ? (int64_t)(mix(key + (uint32_t)i) & 0xFFFFu) : -1);
        } else {
            ((float *)weights)[i] = w;
        }
    }
}

#define DENSE(BW, BM, SR) dense_range(weights, grad, exp_avg, exp_avg_sq, start, end, h, key, m_key, v_key, BW, BM, SR)

/* Elements [start, end) of a parameter whose moments are tensors of its shape, FP32 or BF16 (rounded stochastically
 * from `key + m_stream` and `key + v_stream`: fused_adam's stream offsets, passed in). */
static void step_dense_range(void *weights, const void *grad, int bf16_weights, void *exp_avg, void *exp_avg_sq,
                             int bf16_moments, int64_t start, int64_t end, const Hyper *h, int stochastic,
                             uint32_t key, uint32_t m_stream, uint32_t v_stream) {
    uint32_t m_key = key + m_stream, v_key = key + v_stream;
    int form = (bf16_weights ? 4 : 0) | (bf16_moments ? 2 : 0) | (bf16_weights && stochastic ? 1 : 0);
    switch (form) {
    case 0: DENSE(0, 0, 0); break;
    case 2: DENSE(0, 1, 0); break;
    case 4: DENSE(1, 0, 0); break;
    case 5: DENSE(1, 0, 1); break;
    case 6: DENSE(1, 1, 0); break;
    default: DENSE(1, 1, 1); break;
    }
}

#define UNIT 4096 /* elements per unit of work among the threads (16 blocks of 8-bit codes) */
#define BF16_WEIGHTS 1 /* Tensor.flags: the weights (and the gradient) are BF16 */
#define BF16_MOMENTS 2 /* dense moments in BF16 */
#define STOCHASTIC 4 /* BF16 weights rounded stochastically from `key` (else to nearest) */
#define PACKED 8 /* moments packed 8-bit (else dense tensors of the parameter's shape) */

/* One parameter of a step (lightning_comp.execution.native_adam.NativeTensor mirrors this layout): its weights and
 * gradient, its two moments, its element count, the hyper-parameters of its step (its group's, its own step count's
 * bias corrections) in fused_adam.HYPER_PARAMETERS's order, its rounding key, and the flags above. */
typedef struct {
    void *weights;
    const void *grad;
    void *exp_avg;
    void *exp_avg_sq;
    int64_t numel;
    float hyper[9];
    uint32_t key;
    int32_t flags;
} Tensor;

static void step_unit(const Tensor *t, int64_t unit, const float *m_map, const float *v_map, const float *m_table,
                      const float *v_table, uint32_t m_stream, uint32_t v_stream) {
    Hyper h;
    memcpy(&h, t->hyper, sizeof(Hyper));
    int bf16_weights = (t->flags & BF16_WEIGHTS) != 0, stochastic = (t->flags & STOCHASTIC) != 0;
    int64_t start = unit * UNIT, end = start + UNIT < t->numel ? start + UNIT : t->numel;
    if (t->flags & PACKED) {
        step_8bit_blocks(t->weights, t->grad, bf16_weights, (uint8_t *)t->exp_avg, (uint8_t *)t->exp_avg_sq,
                         t->numel / BLOCK, start / BLOCK, end / BLOCK, &h, m_map, v_map, m_table, v_table, stochastic,
                         t->key);
    } else {
        step_dense_range(t->weights, t->grad, bf16_weights, t->exp_avg, t->exp_avg_sq, (t->flags & BF16_MOMENTS) != 0,
                         start, end, &h, stochastic, t->key, m_stream, v_stream);
    }
}

/* One step of `count` parameters (`tensors`), each updated in place: 8-bit moments (PACKED; the parameter a whole
 * number of blocks) decoded through `m_map`/`v_map` and encoded with `m_table`/`v_table`
 * (dynamic_codec.encoding_table), dense ones rounded from their streams. The units of all the tensors are shared
 * among `threads` threads eight at a time as they come free: 32 K elements in a row keep a thread's reads streaming,
 * and a thread held up by other work on the machine takes fewer (2 AVX2 cores beside a busy process, 12 tensors of
 * 256 K elements: 10.1 ms against 12.6 shared statically, 18.0 one call per tensor; quiet, within noise of static).
 * Returns 0. */
int lc_adam_steps(const Tensor *tensors, int count, const float *m_map, const float *v_map, const float *m_table,
                  const float *v_table, uint32_t m_stream, uint32_t v_stream, int threads) {
    int64_t *ends = malloc(sizeof(int64_t) * (size_t)(count > 0 ? count : 1)); /* each tensor's last unit + 1 */
    int64_t units = 0;
    for (int i = 0; i < count; i++) {
        units += (tensors[i].numel + UNIT - 1) / UNIT;
        if (ends != NULL) {
            ends[i] = units;
        }
    }
    if (ends == NULL) { /* no table to share the units by: one thread, tensor by tensor */
        for (int i = 0; i < count; i++) {
            for (int64_t u = 0; u < (tensors[i].numel + UNIT - 1) / UNIT; u++) {
                step_unit(tensors + i, u, m_map, v_map, m_table, v_table, m_stream, v_stream);
            }
        }
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8) if (threads > 1)
    for (int64_t u = 0; u < units; u++) {
        int low = 0, high = count - 1; /* the first tensor whose units end after u */
        while (low < high) {
            int middle = low + (high - low) / 2;
            if (ends[middle] > u) {
                high = middle;
            } else {
                low = middle + 1;
            }
        }
        int64_t first = low > 0 ? ends[low - 1] : 0;
        step_unit(tensors + low, u - first, m_map, v_map, m_table, v_table, m_stream, v_stream);
    }
    free(ends);
    return 0;
}

/* The codes lc_adam_steps writes for `blocks` blocks of BLOCK values, each divided by its scale (`scales`), with
 * `table` (signed or not), by the portable loops (`portable`) or by those the step uses; and whether this build has
 * vector ones (lc_vector_encode). For checking the two against each other and against dynamic_codec.encode. */
int lc_encode_blocks(const float *values, int64_t blocks, const float *scales, const float *table, int is_signed,
                     int portable, uint8_t *out) {
    for (int64_t b = 0; b < blocks; b++) {
        encode_block(values + b * BLOCK, scales[b], table, is_signed, portable, out + b * BLOCK);
    }
    return 0;
}

int lc_vector_encode(void) { return LC_VECTOR_ENCODE; }
