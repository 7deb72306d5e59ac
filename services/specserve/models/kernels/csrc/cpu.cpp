// specserve's CPU kernels for a bfloat16 step (models/kernels/cpu.py builds and loads this): weight-only quantized
// products, attention over the pool's arena, RMS norm, a whole decoder layer. Each row of a result is computed
// the same way whatever else is computed with it, so a verify block's rows equal decode steps' bit for bit.
//
// One source, two instruction sets, chosen when it is compiled: AVX-512 with bfloat16 and int8 (VNNI) dot
// products (__AVX512BF16__, __AVX512VNNI__) or AVX2 + FMA + F16C. The kernels are written once over `vec`, 16
// float32 lanes (one register on AVX-512, two on AVX2); every operation of that layer rounds each lane as the
// AVX-512 instruction does (vdpbf16ps: the odd product, then the even one, each added with one rounding;
// vcvtneps2bf16: nearest even, subnormals to zero), so both builds compute the same bits, bfloat16 subnormal
// inputs aside.
//
// Quantized products (models/kernels/quant.py):
// y[m, n] = sum_k x[m, k] * w[n, k] for bfloat16 activations x and int4 or int8 weights w, a tile of weights
// read from memory once for all rows, in passes of up to 8 rows (torch's CPU kernels read them again for every
// 4 rows). Codes are widened to exact values and multiplied pairwise with the dot product's roundings.
//
// int4 (groups of G inputs, w = (q - 8) * scale + zero): per group, y += scale * sum(x * q) + bias * sum(x)
// with bias = zero - 8 * scale, both float16 (as GGUF's Q4 blocks store them). Codes of 16 outputs x 4 inputs
// in 32 bytes: byte 2i + j holds output i's code for input 4t + j in its low nibble, 4t + 2 + j in its high one.
// int8 (one scale a row): codes of 16 outputs x 2 inputs in 32 bytes, byte 2i + j = output i, input 2t + j.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int kMaxRows = 8;

// Codes a little ahead of those read now: a tile's codes cross 4 KB pages, where the hardware's prefetchers stop
// (a 16-row step of int4 x int8 tiles stalled on ~20% of its code loads without it).
inline void ahead(const void *p) { _mm_prefetch((const char *)p + 1024, _MM_HINT_T0); }

float bf16_to_float(uint16_t v) {
  uint32_t bits = (uint32_t)v << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's casts
  uint32_t bits;
  memcpy(&bits, &f, 4);
  return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// ---- the vector layer: `n` is how many leading lanes a load or store touches (the others read as zero) ----
#if defined(__AVX512BF16__)
constexpr int kIsa = 512;
using vec = __m512;

inline __mmask16 tail_mask(int64_t n) {  // the first min(n, 16) lanes
  return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}
inline vec zero() { return _mm512_setzero_ps(); }
inline vec set1(float v) { return _mm512_set1_ps(v); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec div(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec min(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }    // a·b + c
inline vec fnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a·b
inline vec abs(vec a) { return _mm512_abs_ps(a); }
inline vec round_int(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec scale2(vec a, vec n) { return _mm512_scalef_ps(a, n); }  // a · 2^n, n integral
inline vec where_negative(vec x, vec a, vec b) {                     // a where x < 0, else b
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), b, a);
}
inline vec keep(vec a, int64_t n) { return _mm512_maskz_mov_ps(tail_mask(n), a); }
inline vec max_first(vec acc, vec a, int64_t n) { return _mm512_mask_max_ps(acc, tail_mask(n), acc, a); }
inline float reduce_add(vec a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(vec a) { return _mm512_reduce_max_ps(a); }
inline vec load_f32(const float *p, int64_t n = 16) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
inline void store_f32(float *p, vec v, int64_t n = 16) { _mm512_mask_storeu_ps(p, tail_mask(n), v); }
inline vec load_i32(const int32_t *p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)p)); }
inline vec load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
inline vec load_bf16(const uint16_t *p, int64_t n = 16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail_mask(n), p)), 16));
}
inline void store_bf16(uint16_t *out, vec v, int64_t n = 16) {
  _mm256_mask_storeu_epi16(out, tail_mask(n), (__m256i)_mm512_cvtneps_pbh(v));
}
inline vec round_bf16(vec v) {  // v rounded to bfloat16 (nearest even), kept as float32
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}
// 16 integral values in [-127, 127] as int8, each pair of inputs twice in a word: [q0 q1 q0 q1] [q2 q3 q2 q3] ...
inline void store_q8_pairs(int32_t *p, vec v) {
  const __m128i b = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v));
  _mm_storeu_si128((__m128i *)p, _mm_unpacklo_epi16(b, b));
  _mm_storeu_si128((__m128i *)(p + 4), _mm_unpackhi_epi16(b, b));
}
// acc + the dot products of 16 pairs of bfloat16 values (a[2l], a[2l+1]) · (b[2l], b[2l+1]) into lane l
inline vec dot_bf16(vec acc, const uint16_t *a, const uint16_t *b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
}
// 32 bfloat16 values loaded once for several dot_pairs (attention: a key row against a group's queries)
struct pairs32 {
  __m512i v;
};
inline pairs32 load_pairs(const uint16_t *a) { return {_mm512_loadu_si512(a)}; }
inline vec dot_pairs(vec acc, const pairs32 &a, const pairs32 &b) {  // dot_bf16 of what a and b were loaded from
  return _mm512_dpbf16_ps(acc, (__m512bh)a.v, (__m512bh)b.v);
}

// Lane j of the result: the sum of v[j]'s 16 lanes (a transpose as it adds: 45 operations for 16 sums), as
// ((s0 + s1) + (s2 + s3)) with s_q = (e[4q] + e[4q+2]) + (e[4q+1] + e[4q+3]).
inline vec sum16(const vec *v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; i++)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {
    __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Quantized tiles: activations as given (bfloat16), two products a lane with vdpbf16ps.
using act_t = uint16_t;

inline const act_t *activations(const uint16_t *x, int64_t, int64_t, bool) { return x; }

inline __m512 dot2(__m512 acc, __m512i w, const uint16_t *x) {
  int32_t pair;
  memcpy(&pair, x, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
}

// Rows [0, MR) of x against NT blocks of 16 outputs starting at block nb.
template <int MR, int NT>
void int4_tile(const act_t *x, int64_t K, const float *xsum, int64_t groups, int64_t G, const uint8_t *codes,
               const uint16_t *sb, int64_t nb, uint16_t *out, int64_t N) {
  const __m512i table = _mm512_set_epi16(
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040,
      0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0,
      0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);  // bfloat16 of 15..0, twice
  const __m512i low = _mm512_set1_epi16(0x0f);
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) acc[m][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 part[MR][NT];
    for (int m = 0; m < MR; m++)
      for (int t = 0; t < NT; t++) part[m][t] = _mm512_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
      for (int t = 0; t < NT; t++) {
        const uint8_t *c = codes + ((nb + t) * (K / 4) + k / 4) * 32;
        ahead(c);
        __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)c));
        __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(w, low), table);
        __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
        for (int m = 0; m < MR; m++) {
          part[m][t] = dot2(part[m][t], lo, x + m * K + k);
          part[m][t] = dot2(part[m][t], hi, x + m * K + k + 2);
        }
      }
    }
    for (int t = 0; t < NT; t++) {
      const uint16_t *s = sb + ((nb + t) * groups + g) * 32;
      __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
      __m512 bias = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 16)));
      for (int m = 0; m < MR; m++) {
        acc[m][t] = _mm512_fmadd_ps(part[m][t], scale, acc[m][t]);
        acc[m][t] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g]), bias, acc[m][t]);
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) store_bf16(out + m * N + (nb + t) * 16, acc[m][t]);
}

template <int MR, int NT>
void int8_tile(const act_t *x, int64_t K, const int8_t *codes, const float *scales, int64_t nb, uint16_t *out,
               int64_t N) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) acc[m][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    for (int t = 0; t < NT; t++) {
      const int8_t *c = codes + ((nb + t) * (K / 2) + k / 2) * 32;
      ahead(c);
      __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
      __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
      __m512i w = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // exact: |code| <= 127
      for (int m = 0; m < MR; m++) acc[m][t] = dot2(acc[m][t], w, x + m * K + k);
    }
  }
  for (int t = 0; t < NT; t++) {
    __m512 scale = _mm512_loadu_ps(scales + (nb + t) * 16);
    for (int m = 0; m < MR; m++) store_bf16(out + m * N + (nb + t) * 16, _mm512_mul_ps(acc[m][t], scale));
  }
}

#else  // AVX2 + FMA + F16C: a vec is two 8-lane registers, lanes 0-7 and 8-15
constexpr int kIsa = 2;
struct vec {
  __m256 lo, hi;
};

alignas(32) const int32_t kLeading[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline __m256i lanes8(int64_t n) {  // a mask of the first n (0..8) of 8 lanes
  return _mm256_loadu_si256((const __m256i *)(kLeading + 8 - n));
}
inline int64_t lo_lanes(int64_t n) { return n >= 8 ? 8 : n < 0 ? 0 : n; }
inline int64_t hi_lanes(int64_t n) { return n >= 16 ? 8 : n <= 8 ? 0 : n - 8; }

inline vec both(__m256 a) { return {a, a}; }
inline vec zero() { return both(_mm256_setzero_ps()); }
inline vec set1(float v) { return both(_mm256_set1_ps(v)); }
inline vec add(vec a, vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vec sub(vec a, vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vec mul(vec a, vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vec div(vec a, vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vec max(vec a, vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vec min(vec a, vec b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vec fmadd(vec a, vec b, vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vec fnmadd(vec a, vec b, vec c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline vec abs(vec a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline vec round_int(vec a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline __m256 pow2(__m256 n) {  // 2^n for integral n in [-126, 127]: exact, so a · 2^n rounds as scalef does
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vec scale2(vec a, vec n) { return {_mm256_mul_ps(a.lo, pow2(n.lo)), _mm256_mul_ps(a.hi, pow2(n.hi))}; }
inline vec where_negative(vec x, vec a, vec b) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(x.lo, z, _CMP_LT_OQ)),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(x.hi, z, _CMP_LT_OQ))};
}
inline vec keep(vec a, int64_t n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(lanes8(lo_lanes(n)))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(lanes8(hi_lanes(n))))};
}
inline vec max_first(vec acc, vec a, int64_t n) {
  return {_mm256_blendv_ps(acc.lo, _mm256_max_ps(acc.lo, a.lo), _mm256_castsi256_ps(lanes8(lo_lanes(n)))),
          _mm256_blendv_ps(acc.hi, _mm256_max_ps(acc.hi, a.hi), _mm256_castsi256_ps(lanes8(hi_lanes(n))))};
}
inline float reduce_add(vec a) {  // the tree of GCC's _mm512_reduce_add_ps
  __m256 t3 = _mm256_add_ps(a.hi, a.lo);
  __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}
inline float reduce_max(vec a) {
  __m256 t = _mm256_max_ps(a.hi, a.lo);
  __m128 u = _mm_max_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  u = _mm_max_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_max_ss(u, _mm_movehdup_ps(u)));
}
inline vec load_f32(const float *p, int64_t n = 16) {
  if (n >= 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, lanes8(lo_lanes(n))), _mm256_maskload_ps(p + 8, lanes8(hi_lanes(n)))};
}
inline void store_f32(float *p, vec v, int64_t n = 16) {
  if (n >= 16) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
    return;
  }
  _mm256_maskstore_ps(p, lanes8(lo_lanes(n)), v.lo);
  _mm256_maskstore_ps(p + 8, lanes8(hi_lanes(n)), v.hi);
}
inline __m256 widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline vec load_i32(const int32_t *p) {
  return {_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)p)),
          _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(p + 8)))};
}
inline vec load_f16(const uint16_t *p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
inline vec load_bf16(const uint16_t *p, int64_t n = 16) {
  alignas(32) uint16_t tmp[16] = {0};
  if (n < 16) {
    memcpy(tmp, p, (n > 0 ? n : 0) * 2);
    p = tmp;
  }
  return {widen_bf16(_mm_loadu_si128((const __m128i *)p)), widen_bf16(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
inline __m256i narrow_bf16(__m256 v) {  // vcvtneps2bf16 per lane, in the low 16 bits of each 32
  const __m256i b = _mm256_castps_si256(v), top = _mm256_srli_epi32(b, 16);
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1)))),
      16);
  const __m256i magnitude = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
  const __m256i subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), magnitude);  // and zero
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_and_si256(top, _mm256_set1_epi32(0x8000)), subnormal);
  return _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
}
inline void store_bf16_8(uint16_t *out, __m256 v) {
  const __m256i r = narrow_bf16(v);
  _mm_storeu_si128((__m128i *)out, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline void store_bf16(uint16_t *out, vec v, int64_t n = 16) {
  if (n >= 16) {
    store_bf16_8(out, v.lo);
    store_bf16_8(out + 8, v.hi);
    return;
  }
  alignas(32) uint16_t tmp[16];
  store_bf16_8(tmp, v.lo);
  store_bf16_8(tmp + 8, v.hi);
  memcpy(out, tmp, (n > 0 ? n : 0) * 2);
}
inline vec round_bf16(vec v) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), top = _mm256_set1_epi32((int)0xffff0000u);
  auto half = [&](__m256 h) {
    __m256i b = _mm256_castps_si256(h);
    b = _mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one)));
    return _mm256_castsi256_ps(_mm256_and_si256(b, top));
  };
  return {half(v.lo), half(v.hi)};
}
// 16 integral values in [-127, 127] as int8, each pair of inputs twice in a word: [q0 q1 q0 q1] [q2 q3 q2 q3] ...
inline void store_q8_pairs(int32_t *p, vec v) {
  const __m256i w = _mm256_permute4x64_epi64(
      _mm256_packs_epi32(_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi)), 0xd8);  // 16 int16, in order
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128((__m128i *)p, _mm_unpacklo_epi16(b, b));
  _mm_storeu_si128((__m128i *)(p + 4), _mm_unpackhi_epi16(b, b));
}
// 8 lanes of vdpbf16ps: lane l += a[2l+1]·b[2l+1], then += a[2l]·b[2l] (a product of bfloat16 values is exact
// in float32, so an FMA rounds each sum once, as the instruction does)
inline __m256 dot_bf16_8(__m256 acc, const uint16_t *a, const uint16_t *b) {
  const __m256i x = _mm256_loadu_si256((const __m256i *)a), y = _mm256_loadu_si256((const __m256i *)b);
  const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(x, odd)), _mm256_castsi256_ps(_mm256_and_si256(y, odd)),
                        acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(y, 16)),
                         acc);
}
inline vec dot_bf16(vec acc, const uint16_t *a, const uint16_t *b) {
  return {dot_bf16_8(acc.lo, a, b), dot_bf16_8(acc.hi, a + 16, b + 16)};
}
// 32 bfloat16 values widened once for several dot_pairs: the odd and the even input of each pair, per 16 values
struct pairs32 {
  __m256 odd[2], even[2];
};
inline pairs32 load_pairs(const uint16_t *a) {
  const __m256i x0 = _mm256_loadu_si256((const __m256i *)a), x1 = _mm256_loadu_si256((const __m256i *)(a + 16));
  const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
  return {{_mm256_castsi256_ps(_mm256_and_si256(x0, odd)), _mm256_castsi256_ps(_mm256_and_si256(x1, odd))},
          {_mm256_castsi256_ps(_mm256_slli_epi32(x0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16))}};
}
inline vec dot_pairs(vec acc, const pairs32 &a, const pairs32 &b) {  // dot_bf16 of what a and b were loaded from
  return {_mm256_fmadd_ps(a.even[0], b.even[0], _mm256_fmadd_ps(a.odd[0], b.odd[0], acc.lo)),
          _mm256_fmadd_ps(a.even[1], b.even[1], _mm256_fmadd_ps(a.odd[1], b.odd[1], acc.hi))};
}
// The sums of v[0..3]'s 16 lanes each, in sum16's order: s_q of 128-bit lane q of lo (q = 0, 1) and hi (2, 3).
inline __m128 sum4(const vec *v) {
  auto pairs = [](__m256 a, __m256 b) { return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)); };
  auto quads = [&](__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256d ab = _mm256_castps_pd(pairs(a, b)), cd = _mm256_castps_pd(pairs(c, d));
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ab, cd)), _mm256_castpd_ps(_mm256_unpackhi_pd(ab, cd)));
  };
  const __m256 x = quads(v[0].lo, v[1].lo, v[2].lo, v[3].lo), y = quads(v[0].hi, v[1].hi, v[2].hi, v[3].hi);
  return _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)),
                    _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1)));
}
inline vec sum16(const vec *v) {
  return {_mm256_set_m128(sum4(v + 4), sum4(v)), _mm256_set_m128(sum4(v + 12), sum4(v + 8))};
}

// Quantized tiles: activations widened to float32 once per product, weights to float32 per 8 outputs, and
// multiplied with FMAs in vdpbf16ps's order (the odd input of a pair, then the even one). For int4, inputs
// 4t + j are divided by 1, 256, 16, 4096 (j = 0..3), the place of their code in a lane's 16 bits, so a code
// is widened by a mask alone: the product is the same number (powers of two are exact), so are its sums.
using act_t = float;

inline const act_t *activations(const uint16_t *x, int64_t M, int64_t K, bool int4) {
  thread_local std::vector<float> wide;
  wide.resize(M * K);
  const float place[4] = {1.0f, 1.0f / 256, 1.0f / 16, 1.0f / 4096};
  for (int64_t i = 0; i < M * K; i++) wide[i] = bf16_to_float(x[i]) * (int4 ? place[i % 4] : 1.0f);
  return wide.data();
}

// A tile's columns are 8 outputs each (block nb + c / H, half h0 + c % H): both halves of its blocks at once, or,
// where MR · NT · 2 sums would not fit in the 16 registers, one half a pass. Each sum is a chain of dependent FMAs
// (the pairs' order is fixed), so a tile keeps several going at once.
template <int MR, int NT>
constexpr int halves() { return MR * NT * 2 > 12 ? 1 : 2; }

// Rows [0, MR) of x against NT blocks of 16 outputs starting at block nb.
template <int MR, int NT>
void int4_tile(const act_t *x, int64_t K, const float *xsum, int64_t groups, int64_t G, const uint8_t *codes,
               const uint16_t *sb, int64_t nb, uint16_t *out, int64_t N) {
  constexpr int H = halves<MR, NT>(), C = NT * H;
  const __m256i f0 = _mm256_set1_epi32(0x000f), f1 = _mm256_set1_epi32(0x0f00), f2 = _mm256_set1_epi32(0x00f0),
                f3 = _mm256_set1_epi32(0xf000);
  for (int h0 = 0; h0 < 2; h0 += H) {
    __m256 acc[MR][C];
    for (int m = 0; m < MR; m++)
      for (int c = 0; c < C; c++) acc[m][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      __m256 part[MR][C];
      for (int m = 0; m < MR; m++)
        for (int c = 0; c < C; c++) part[m][c] = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
        for (int c = 0; c < C; c++) {
          // lane i: bytes 2i and 2i+1 of the half: inputs k, k+2 in byte 2i's nibbles, k+1, k+3 in byte 2i+1's
          const uint8_t *b = codes + ((nb + c / H) * (K / 4) + k / 4) * 32 + 16 * (h0 + c % H);
          ahead(b);
          const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)b));
          const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(w, f0));
          const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(w, f1));
          const __m256 w2 = _mm256_cvtepi32_ps(_mm256_and_si256(w, f2));
          const __m256 w3 = _mm256_cvtepi32_ps(_mm256_and_si256(w, f3));
          for (int m = 0; m < MR; m++) {
            const float *xm = x + m * K + k;
            part[m][c] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xm + 1), part[m][c]);
            part[m][c] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xm), part[m][c]);
            part[m][c] = _mm256_fmadd_ps(w3, _mm256_broadcast_ss(xm + 3), part[m][c]);
            part[m][c] = _mm256_fmadd_ps(w2, _mm256_broadcast_ss(xm + 2), part[m][c]);
          }
        }
      }
      for (int c = 0; c < C; c++) {
        const uint16_t *s = sb + ((nb + c / H) * groups + g) * 32 + 8 * (h0 + c % H);
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
        const __m256 bias = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16)));
        for (int m = 0; m < MR; m++) {
          acc[m][c] = _mm256_fmadd_ps(part[m][c], scale, acc[m][c]);
          acc[m][c] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[m * groups + g]), bias, acc[m][c]);
        }
      }
    }
    for (int m = 0; m < MR; m++)
      for (int c = 0; c < C; c++) store_bf16_8(out + m * N + (nb + c / H) * 16 + 8 * (h0 + c % H), acc[m][c]);
  }
}

template <int MR, int NT>
void int8_tile(const act_t *x, int64_t K, const int8_t *codes, const float *scales, int64_t nb, uint16_t *out,
               int64_t N) {
  constexpr int H = halves<MR, NT>(), C = NT * H;
  for (int h0 = 0; h0 < 2; h0 += H) {
    __m256 acc[MR][C];
    for (int m = 0; m < MR; m++)
      for (int c = 0; c < C; c++) acc[m][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
      for (int c = 0; c < C; c++) {
        // lane i: bytes 2i (input k) and 2i+1 (input k+1) of the half, as one sign-extended 16-bit value
        const int8_t *b = codes + ((nb + c / H) * (K / 2) + k / 2) * 32 + 16 * (h0 + c % H);
        ahead(b);
        const __m256i w = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)b));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24), 24));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(w, 8));
        for (int m = 0; m < MR; m++) {
          acc[m][c] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(x + m * K + k + 1), acc[m][c]);
          acc[m][c] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x + m * K + k), acc[m][c]);
        }
      }
    }
    for (int c = 0; c < C; c++) {
      const int64_t o = (nb + c / H) * 16 + 8 * (h0 + c % H);
      const __m256 scale = _mm256_loadu_ps(scales + o);
      for (int m = 0; m < MR; m++) store_bf16_8(out + m * N + o, _mm256_mul_ps(acc[m][c], scale));
    }
  }
}
#endif

// ---- written once over `vec` ----

// Blocks per tile: enough independent sums to hide the dot product's latency, few enough to stay in registers.
constexpr int tile_blocks(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

// Tiles a thread takes at a time: threads take work as they come, so one that another process preempts
// holds up the step by at most its current chunk (a static split waits for its whole share).
inline int64_t share(int64_t tiles) {
  const int64_t chunk = tiles / (8 * omp_get_max_threads());
  return chunk > 0 ? chunk : 1;
}

// tile(first block) over every tile of NT blocks of 16 outputs, shared among the threads; one(block) after
// them for the blocks left over.
template <int NT, typename Tile, typename One>
void over_blocks(int64_t blocks, Tile tile, One one) {
  const int64_t tiles = blocks / NT, chunk = share(tiles);
#pragma omp parallel for schedule(dynamic, chunk)
  for (int64_t i = 0; i < tiles; i++) tile(i * NT);
  for (int64_t nb = tiles * NT; nb < blocks; nb++) one(nb);
}

// f(std::integral_constant<int, rows>()) for rows in 1..kMaxRows: a pass compiled for each row count.
template <typename F>
void by_rows(int64_t rows, F f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, kMaxRows>()); break;
  }
}

// A product over M rows: the weights in tiles of NT blocks (NT = blocks(the first pass's rows)), and inside each
// tile every pass of up to kMaxRows rows, so a step reads a tile's codes from memory once however many rows it
// has (later passes find them in the cache). tile(rows constant, NT constant, first row, first block).
template <int (*blocks)(int), typename Tile>
void row_passes(int64_t M, int64_t N, Tile tile) {
  auto passes = [&](auto nt, int64_t nb) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
      by_rows(M - m0 < kMaxRows ? M - m0 : kMaxRows, [&](auto r) { tile(r, nt, m0, nb); });
  };
  by_rows(M < kMaxRows ? M : kMaxRows, [&](auto r) {
    constexpr int NT = blocks(decltype(r)::value);
    over_blocks<NT>(N / 16, [&](int64_t nb) { passes(std::integral_constant<int, NT>(), nb); },
                    [&](int64_t nb) { passes(std::integral_constant<int, 1>(), nb); });
  });
}

// e^x for x <= 0 (x - max of a softmax): range reduction to |r| <= ln2/2, a degree-6 polynomial.
inline vec exp_nonpositive(vec x) {
  x = max(x, set1(-87.0f));
  const vec n = round_int(mul(x, set1(1.44269504088896341f)));
  vec r = fnmadd(n, set1(0.693145751953125f), x);
  r = fnmadd(n, set1(1.428606765330187e-06f), r);
  vec p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return scale2(p, n);
}

// One query row of GH heads that share their keys and values (grouped-query attention) against keys [0, L)
// (rows of D bfloat16 values, `stride` apart): softmax(q·k · scale) · v for each head, computed as for a head
// alone; a key's and a value's row is loaded (on AVX2 widened) once for the group. q: the heads' query rows, D
// apart; out likewise. D % 32 == 0, D <= 256. cap > 0: scores soft-capped to cap · tanh(score / cap) (Gemma 2).
template <int GH>
void attend_heads(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t stride, int64_t L, int64_t D,
                  float scale, float cap, uint16_t *out, std::vector<float> &scores) {
  scores.resize(GH * (L + 16));
  const int64_t pitch = L + 16, parts = D / 32, chunks = D / 16;
  pairs32 qp[GH][8];
  for (int h = 0; h < GH; h++)
    for (int64_t c = 0; c < parts; c++) qp[h][c] = load_pairs(q + h * D + c * 32);
  vec top16[GH];
  for (int h = 0; h < GH; h++) top16[h] = set1(-INFINITY);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t keys = L - t0 < 16 ? L - t0 : 16;
    vec dots[GH][16];
    for (int64_t j = 0; j < 16; j++) {
      vec acc[GH];
      for (int h = 0; h < GH; h++) acc[h] = zero();
      for (int64_t c = 0; j < keys && c < parts; c++) {
        const pairs32 kp = load_pairs(k + (t0 + j) * stride + c * 32);
        for (int h = 0; h < GH; h++) acc[h] = dot_pairs(acc[h], kp, qp[h][c]);
      }
      for (int h = 0; h < GH; h++) dots[h][j] = acc[h];
    }
    for (int h = 0; h < GH; h++) {
      vec row = mul(sum16(dots[h]), set1(scale));
      if (cap > 0) {  // tanh(y) = sign(y) (1 - e) / (1 + e), e = e^-2|y|
        const vec y = mul(row, set1(1.0f / cap)), e = exp_nonpositive(mul(set1(-2.0f), abs(y)));
        const vec t = div(sub(set1(1.0f), e), add(set1(1.0f), e));
        row = mul(where_negative(y, sub(zero(), t), t), set1(cap));
      }
      store_f32(scores.data() + h * pitch + t0, row, keys);
      top16[h] = max_first(top16[h], row, keys);
    }
  }
  float inv[GH];
  for (int h = 0; h < GH; h++) {
    float *s = scores.data() + h * pitch;
    const vec mx = set1(reduce_max(top16[h]));
    vec sum = zero();
    for (int64_t t = 0; t < L; t += 16) {
      const vec e = keep(exp_nonpositive(sub(load_f32(s + t, L - t), mx)), L - t);
      store_f32(s + t, e, L - t);
      sum = add(sum, e);
    }
    inv[h] = 1.0f / reduce_add(sum);
  }
  // value chunks a pass: the sums, a value row and a weight stay in registers (AVX2: 16 of 8 lanes, so fewer)
  constexpr int CB = kIsa == 512 ? (GH == 1 ? 4 : GH <= 3 ? 2 : 1) : (GH == 1 ? 3 : GH == 2 ? 2 : 1);
  for (int64_t c0 = 0; c0 < chunks; c0 += CB) {
    const int64_t cb = chunks - c0 < CB ? chunks - c0 : CB;
    vec acc[GH][CB];
    for (int h = 0; h < GH; h++)
      for (int i = 0; i < CB; i++) acc[h][i] = zero();
    for (int64_t t = 0; t < L; t++) {
      vec row[CB];
      for (int64_t i = 0; i < cb; i++) row[i] = load_bf16(v + t * stride + (c0 + i) * 16);
      for (int h = 0; h < GH; h++) {
        const vec p = set1(scores[h * pitch + t]);
        for (int64_t i = 0; i < cb; i++) acc[h][i] = fmadd(p, row[i], acc[h][i]);
      }
    }
    for (int h = 0; h < GH; h++)
      for (int64_t i = 0; i < cb; i++) store_bf16(out + h * D + (c0 + i) * 16, mul(acc[h][i], set1(inv[h])));
  }
}

// attend_heads for a runtime group size: groups of up to 4 heads at a time.
void attend_group(const uint16_t *q, int64_t heads, const uint16_t *k, const uint16_t *v, int64_t stride, int64_t L,
                  int64_t D, float scale, float cap, uint16_t *out, std::vector<float> &scores) {
  for (int64_t h = 0; h < heads;) {
    const int64_t n = heads - h >= 4 ? 4 : heads - h;
    const uint16_t *qh = q + h * D;
    uint16_t *oh = out + h * D;
    switch (n) {
      case 1: attend_heads<1>(qh, k, v, stride, L, D, scale, cap, oh, scores); break;
      case 2: attend_heads<2>(qh, k, v, stride, L, D, scale, cap, oh, scores); break;
      case 3: attend_heads<3>(qh, k, v, stride, L, D, scale, cap, oh, scores); break;
      default: attend_heads<4>(qh, k, v, stride, L, D, scale, cap, oh, scores); break;
    }
    h += n;
  }
}

// ---- int4 weights x int8 activations: integer dot products (exact, so every build sums the same) ----
// Per row m and group g of G inputs: d = max|x| / 127, xq = round(x / d) (nearest even, |xq| <= 127), and
// y += (scale · d) · sum(q · xq) + bias · (d · sum(xq)), the float part in `vec` as every other product. (The
// bias meets the quantized sum, as the codes do: with sum(x) the error is that of codes · scale, all >= 0.)

// xq of 4 inputs as two words, [xq0 xq1 xq0 xq1] and [xq2 xq3 xq2 xq3]: the byte pairs vpmaddubsw meets in a
// 16-bit lane of codes (inputs 4t, 4t + 1 in the low nibbles, 4t + 2, 4t + 3 in the high ones).
// d[m, g] and xsum[m, g] = d · sum(xq) per group of G inputs; total[m, u] = sum(xq) and split[m, u] (its inputs 4t,
// 4t + 1 in the low 16 bits, 4t + 2, 4t + 3 in the high ones, as int16; not written where split is null) per
// sub-group of `sub` inputs (sub divides G; the tiles' integer sums are per sub-group).
void quantize_rows(const uint16_t *x, int64_t M, int64_t K, int64_t G, int64_t sub, int32_t *pairs, float *d,
                   float *xsum, int32_t *total, int32_t *split) {
  const int64_t groups = K / G, subs = K / sub;
#pragma omp parallel for schedule(static) if (M * K >= 4096)
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      const uint16_t *xg = x + m * K + g * G;
      alignas(64) float r[16];
      vec top = zero();
      for (int64_t k = 0; k < G; k += 16) top = max(top, abs(load_bf16(xg + k, G - k)));
      const float amax = reduce_max(top);
      const float dg = amax / 127.0f, inv = amax > 0.f ? 127.0f / amax : 0.f;
      int32_t *tu = total + m * subs + g * (G / sub);
      alignas(64) int32_t low[256 / 4];  // per sub-group: the sum over inputs 4t, 4t + 1
      for (int64_t u = 0; u < G / sub; u++) tu[u] = low[u] = 0;
      if (G % 16 == 0 && sub % 16 == 0) {
        alignas(64) static const float first_two[16] = {1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0};
        for (int64_t k = 0; k < G; k += 16) {  // integers below 2^24: float sums are exact
          const vec r = max(set1(-127.f), min(set1(127.f), round_int(mul(load_bf16(xg + k), set1(inv)))));
          tu[k / sub] += (int32_t)reduce_add(r);
          if (split) low[k / sub] += (int32_t)reduce_add(mul(r, load_f32(first_two)));
          store_q8_pairs(pairs + (m * K + g * G + k) / 2, r);
        }
      } else {
        for (int64_t k = 0; k < G; k += 4) {
          if (k % 16 == 0) store_f32(r, round_int(mul(load_bf16(xg + k, G - k), set1(inv))));  // nearest even
          uint8_t q[4];
          for (int j = 0; j < 4; j++) {
            const float v0 = r[k % 16 + j];
            const int32_t v = (int32_t)(v0 > 127.f ? 127.f : v0 < -127.f ? -127.f : v0);
            tu[k / sub] += v;
            if (j < 2) low[k / sub] += v;
            q[j] = (uint8_t)(int8_t)v;
          }
          int32_t *p = pairs + (m * K + g * G + k) / 2;
          p[0] = (int32_t)((uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[0] << 16 | (uint32_t)q[1] << 24);
          p[1] = (int32_t)((uint32_t)q[2] | (uint32_t)q[3] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24);
        }
      }
      int32_t sum = 0;
      for (int64_t u = 0; u < G / sub; u++) {
        sum += tu[u];
        if (split)
          split[m * subs + g * (G / sub) + u] =
              (int32_t)((uint32_t)(uint16_t)low[u] | (uint32_t)(uint16_t)(tu[u] - low[u]) << 16);
      }
      d[m * groups + g] = dg;
      xsum[m * groups + g] = dg * (float)sum;
    }
}

// Rows [0, MR) of packed activations and NT blocks of codes from block nb, by their first addresses: the loops
// index them by an unsigned offset, with no address arithmetic a row.
template <int MR, int NT>
struct q8_operands {
  const int32_t *row[MR];
  const uint8_t *block[NT];
  q8_operands(const int32_t *pairs, int64_t K, const uint8_t *codes, int64_t nb) {
    for (int m = 0; m < MR; m++) row[m] = pairs + m * (K / 2);
    for (int t = 0; t < NT; t++) block[t] = codes + (nb + t) * (K / 4) * 32;
  }
};

// s16[m][t] = sums (16 bits, wrapping) of codes · xq over inputs [2 · j0, 2 · j1) for row m, block t, with
// vpmaddubsw.
template <int MR, int NT>
inline void q8_sum16(const q8_operands<MR, NT> &op, uint64_t j0, uint64_t j1, __m256i (&s16)[MR][NT]) {
  const int32_t *const(&row)[MR] = op.row;
  const uint8_t *const(&block)[NT] = op.block;
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) s16[m][t] = _mm256_setzero_si256();
  for (uint64_t j = j0; j < j1; j += 2) {  // inputs 2j .. 2j + 3
    for (int t = 0; t < NT; t++) {
      const uint8_t *b = block[t] + j * 16;
      ahead(b);
      const __m256i v = _mm256_loadu_si256((const __m256i *)b);
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int m = 0; m < MR; m++) {
        s16[m][t] = _mm256_add_epi16(s16[m][t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(row[m][j])));
        s16[m][t] = _mm256_add_epi16(s16[m][t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(row[m][j + 1])));
      }
    }
  }
}

#if defined(__AVX512BF16__)
// The int4 codes of inputs k .. k + 3 for blocks nb and nb + 1 (a 256-bit half each), one code (0-15) a byte: lo
// holds each output's inputs k, k + 1 (a 16-bit pair), hi its inputs k + 2, k + 3. low: 0x0f in every byte.
inline std::pair<__m512i, __m512i> two_blocks(const uint8_t *codes, int64_t K, int64_t nb, int64_t k, __m512i low) {
  const uint8_t *c = codes + (nb * (K / 4) + k / 4) * 32;
  ahead(c);
  ahead(c + (K / 4) * 32);
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)c)),
                                       _mm256_loadu_si256((const __m256i *)(c + (K / 4) * 32)), 1);
  return {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
}
#endif

// Row m's activation pairs of inputs from k (even) on: the words of a row are K / 2 apart. Unsigned, as a signed
// (m · K + k) / 2 put a rounding fix-up of several instructions in the inner loops.
inline const int32_t *at_pairs(const int32_t *pairs, int64_t K, int m, int64_t k) {
  return pairs + m * (K >> 1) + ((uint64_t)k >> 1);
}

// sums[m][t][i] = sum over inputs [k0, k1) of codes · xq for row m, output i of block nb + t: 16-bit sums of 16
// inputs (|sum| <= 16 · 15 · 127 < 2^15) with vpmaddubsw, widened to 32 bits. 256-bit registers hold a block's
// 16 outputs; on AVX-512, 512-bit ones hold two blocks where NT is even (the same integers either way).
template <int MR, int NT>
void q8_sums(const int32_t *pairs, int64_t K, const uint8_t *codes, int64_t nb, int64_t k0, int64_t k1,
             int32_t (*sums)[NT][16]) {
#if defined(__AVX512BF16__)
  if constexpr (NT % 2 == 0) {
    constexpr int P = NT / 2;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i s32[MR][NT];
    for (int m = 0; m < MR; m++)
      for (int t = 0; t < NT; t++) s32[m][t] = _mm512_setzero_si512();
    for (int64_t c0 = k0; c0 < k1; c0 += 16) {
      const int64_t c1 = c0 + 16 < k1 ? c0 + 16 : k1;
      __m512i s16[MR][P];
      for (int m = 0; m < MR; m++)
        for (int q = 0; q < P; q++) s16[m][q] = _mm512_setzero_si512();
      for (int64_t k = c0; k < c1; k += 4) {
        for (int q = 0; q < P; q++) {
          const auto [lo, hi] = two_blocks(codes, K, nb + 2 * q, k, low);
          for (int m = 0; m < MR; m++) {
            const int32_t *p = at_pairs(pairs, K, m, k);
            s16[m][q] = _mm512_add_epi16(s16[m][q], _mm512_maddubs_epi16(lo, _mm512_set1_epi32(p[0])));
            s16[m][q] = _mm512_add_epi16(s16[m][q], _mm512_maddubs_epi16(hi, _mm512_set1_epi32(p[1])));
          }
        }
      }
      for (int m = 0; m < MR; m++)
        for (int q = 0; q < P; q++) {
          s32[m][2 * q] = _mm512_add_epi32(s32[m][2 * q], _mm512_cvtepi16_epi32(_mm512_castsi512_si256(s16[m][q])));
          s32[m][2 * q + 1] =
              _mm512_add_epi32(s32[m][2 * q + 1], _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(s16[m][q], 1)));
        }
    }
    for (int m = 0; m < MR; m++)
      for (int t = 0; t < NT; t++) _mm512_storeu_si512((void *)sums[m][t], s32[m][t]);
    return;
  }
#endif
  const q8_operands<MR, NT> op(pairs, K, codes, nb);
  __m256i lo32[MR][NT], hi32[MR][NT];
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) lo32[m][t] = hi32[m][t] = _mm256_setzero_si256();
  for (int64_t c0 = k0; c0 < k1; c0 += 16) {
    __m256i s16[MR][NT];
    q8_sum16(op, (uint64_t)c0 / 2, (uint64_t)(c0 + 16 < k1 ? c0 + 16 : k1) / 2, s16);
    for (int m = 0; m < MR; m++)
      for (int t = 0; t < NT; t++) {
        lo32[m][t] = _mm256_add_epi32(lo32[m][t], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[m][t])));
        hi32[m][t] = _mm256_add_epi32(hi32[m][t], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[m][t], 1)));
      }
  }
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) {
      _mm256_storeu_si256((__m256i *)sums[m][t], lo32[m][t]);
      _mm256_storeu_si256((__m256i *)(sums[m][t] + 8), hi32[m][t]);
    }
}

#if defined(__AVX512VNNI__)
// int4q8_tile for an even NT with vpdpbusd, which adds 4 products into a 32-bit lane: half the instructions a row of
// vpmaddubsw and its 16-bit adds, and the sums kept in registers. The codes' pairs (lo: inputs 4t, 4t + 1; hi:
// 4t + 2, 4t + 3) interleaved by 16 bits make a lane one output's four inputs, the outputs of each 128-bit lane in
// the order 0-3 (a) and 4-7 (b); the scales are read in that order and the results put back in order at the end.
// The same integer sums, and per lane the same float operations in the same order, as the other passes.
template <int MR, int NT>
void int4q8_tile_vnni(const int32_t *pairs, int64_t K, const float *d, const float *xsum, int64_t groups, int64_t G,
                      const uint8_t *codes, const uint16_t *sb, int64_t nb, uint16_t *out, int64_t N) {
  constexpr int P = NT / 2;
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i in_a = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i in_b = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  __m512 acc_a[MR][P], acc_b[MR][P];
  for (int m = 0; m < MR; m++)
    for (int q = 0; q < P; q++) acc_a[m][q] = acc_b[m][q] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512i a[MR][P], b[MR][P];
    for (int m = 0; m < MR; m++)
      for (int q = 0; q < P; q++) a[m][q] = b[m][q] = _mm512_setzero_si512();
    for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
      for (int q = 0; q < P; q++) {
        const auto [lo, hi] = two_blocks(codes, K, nb + 2 * q, k, low);
        const __m512i wa = _mm512_unpacklo_epi16(lo, hi), wb = _mm512_unpackhi_epi16(lo, hi);
        for (int m = 0; m < MR; m++) {
          int32_t quad;  // inputs k .. k + 3: the pairs' words hold [x0 x1 x0 x1] [x2 x3 x2 x3], so bytes 2-5
          memcpy(&quad, (const char *)at_pairs(pairs, K, m, k) + 2, 4);
          const __m512i x = _mm512_set1_epi32(quad);
          a[m][q] = _mm512_dpbusd_epi32(a[m][q], wa, x);
          b[m][q] = _mm512_dpbusd_epi32(b[m][q], wb, x);
        }
      }
    }
    for (int q = 0; q < P; q++) {
      const uint16_t *s0 = sb + ((nb + 2 * q) * groups + g) * 32, *s1 = sb + ((nb + 2 * q + 1) * groups + g) * 32;
      const __m512 scale0 = load_f16(s0), bias0 = load_f16(s0 + 16), scale1 = load_f16(s1), bias1 = load_f16(s1 + 16);
      const __m512 scale_a = _mm512_permutex2var_ps(scale0, in_a, scale1);
      const __m512 bias_a = _mm512_permutex2var_ps(bias0, in_a, bias1);
      const __m512 scale_b = _mm512_permutex2var_ps(scale0, in_b, scale1);
      const __m512 bias_b = _mm512_permutex2var_ps(bias0, in_b, bias1);
      for (int m = 0; m < MR; m++) {  // as int4q8_tile's `scaled`
        const __m512 dm = _mm512_set1_ps(d[m * groups + g]), xs = _mm512_set1_ps(xsum[m * groups + g]);
        acc_a[m][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][q]), _mm512_mul_ps(scale_a, dm), acc_a[m][q]);
        acc_a[m][q] = _mm512_fmadd_ps(xs, bias_a, acc_a[m][q]);
        acc_b[m][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b[m][q]), _mm512_mul_ps(scale_b, dm), acc_b[m][q]);
        acc_b[m][q] = _mm512_fmadd_ps(xs, bias_b, acc_b[m][q]);
      }
    }
  }
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int m = 0; m < MR; m++)
    for (int q = 0; q < P; q++) {
      store_bf16(out + m * N + (nb + 2 * q) * 16, _mm512_permutex2var_ps(acc_a[m][q], first, acc_b[m][q]));
      store_bf16(out + m * N + (nb + 2 * q + 1) * 16, _mm512_permutex2var_ps(acc_a[m][q], second, acc_b[m][q]));
    }
}
#endif

// Rows [0, MR) against NT blocks of 16 outputs from block nb.
template <int MR, int NT>
void int4q8_tile(const int32_t *pairs, int64_t K, const float *d, const float *xsum, const int32_t *total,
                 int64_t groups, int64_t G, const uint8_t *codes, const uint16_t *sb, int64_t nb, uint16_t *out,
                 int64_t N) {
#if defined(__AVX512VNNI__)
  if constexpr (NT % 2 == 0) {
    int4q8_tile_vnni<MR, NT>(pairs, K, d, xsum, groups, G, codes, sb, nb, out, N);
    return;
  }
#endif
  alignas(64) float acc[MR][NT][16];
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) store_f32(acc[m][t], zero());
  // acc[m][t] += S · (scale · d) + xsum · bias for the group's integer sums S[i] (sum(i))
  auto scaled = [&](int64_t g, auto sum) {
    for (int t = 0; t < NT; t++) {
      const uint16_t *s = sb + ((nb + t) * groups + g) * 32;
      const vec scale = load_f16(s), bias = load_f16(s + 16);
      for (int m = 0; m < MR; m++) {
        vec a = load_f32(acc[m][t]);
        a = fmadd(sum(m, t), mul(scale, set1(d[m * groups + g])), a);
        a = fmadd(set1(xsum[m * groups + g]), bias, a);
        store_f32(acc[m][t], a);
      }
    }
  };
#if !defined(__AVX512BF16__)
  if (G == 32) {
    // A group summed in 16 bits whole, wrapping: S - 8 · sum(xq) = sum((q - 8) · xq) lies within 32 · 8 · 127 <
    // 2^15, so that difference modulo 2^16 is exact, and S is it plus 8 · sum(xq) (total).
    const q8_operands<MR, NT> op(pairs, K, codes, nb);
    for (int64_t g = 0; g < groups; g++) {
      __m256i s16[MR][NT];
      q8_sum16(op, (uint64_t)g * 16, (uint64_t)g * 16 + 16, s16);
      scaled(g, [&](int m, int t) {
        const int32_t eight = 8 * total[m * groups + g];
        const __m256i s = _mm256_sub_epi16(s16[m][t], _mm256_set1_epi16((int16_t)(uint16_t)eight));
        const __m256i e = _mm256_set1_epi32(eight);
        return vec{_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s)), e)),
                   _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(s, 1)), e))};
      });
    }
  } else
#endif
  {
    alignas(64) int32_t sums[MR][NT][16];
    for (int64_t g = 0; g < groups; g++) {
      q8_sums<MR, NT>(pairs, K, codes, nb, g * G, (g + 1) * G, sums);
      scaled(g, [&](int m, int t) { return load_i32(sums[m][t]); });
    }
  }
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) store_bf16(out + m * N + (nb + t) * 16, load_f32(acc[m][t]));
}

// Blocks per int8-activation tile: a 16-bit sum a block (two a 512-bit register) for each row in registers.
// One row (a decode step) of weights larger than the caches is bound by memory, not latency: a block a tile reads
// fewer streams at once (each block's codes and scales are one), which the hardware prefetchers keep up with
// (q8_blocks on AVX2 and blocks_per_tile: 1-row products of such weights 10-23% faster on AVX2, 7-9% on AVX-512).
constexpr int q8_blocks(int rows) {
#if defined(__AVX512BF16__)
  return rows <= 3 ? 4 : 2;
#else
  return rows == 1 ? 1 : rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
#endif
}

// ---- GGUF blocks x int8 activations (kernels/quant.py Blocks): every block type computed as stored ----
// w = scale · code + bias per group of G inputs, code unsigned in [0, 2^bits), scale = d · sc and bias = m · mn +
// offset · scale with d, m float16 per span of S inputs (a K-quant's super-block, a legacy block's own) and sc,
// mn int8 per group: exact in float32, so the kernel multiplies the file's numbers. Per row m and group g, as the
// int4 products: y += (scale · dx) · sum(code · xq) + bias · (dx · sum(xq)), the integer sums exact on every build.
// Layout, per block of 16 outputs: lo: K/4 x 32 bytes of the codes' low nibbles (as int4's); hi (bits > 4): the
// codes' high parts (hb = bits - 4 of them) for 4/hb consecutive 4-input tiles in 32 bytes, tile t's at bit
// (t % (4/hb)) · hb of the low nibble (inputs 4t + j) and of the high one (4t + 2 + j); 8-bit codes instead in lo
// alone, as signed bytes (code - 128, the offset raised by 128): K/4 x 64 bytes, byte 4i + j output i's input
// 4t + j; dm: float16 [K/S][1 + has_min][16] (d, then m); scm: int8 [K/G][has_scale + has_min][16] (sc, then mn;
// legacy blocks have no sc: 1).
struct Blocks {
  const uint8_t *lo;
  const uint8_t *hi;
  const uint16_t *dm;
  const int8_t *scm;
  int64_t bits;
  int64_t group;
  int64_t span;
  int64_t has_min;
  int64_t has_scale;
  float offset;
};

// Whether the kernels multiply a K-quant's sub-block scales into integer sums (6-bit codes: Q6_K and weights fused
// with it, whose groups of 16 paid a float step each): the activations then take one scale a span (a super-block:
// 256 inputs, as llama.cpp's Q8_K) and, per row, span s and output,
//   A = sum over the span's groups of sc · sum((code + offset) · xq),  B = sum of mn · sum(xq)   (exact, int32),
//   y += A · (d · dx) + B · (m · dx),
// one float step a span instead of one a group. |A| <= 256 · 128 · 63 · 127 < 2^31.
inline bool integer_scaled(const Blocks &w) {
  return w.has_scale && w.bits == 6 && w.span <= 256 && w.span % w.group == 0;
}

// y (acc) += A · (d · dx) + B · (m · dx) for a span: every build's float operations, per lane in this order.
inline vec span_step(vec acc, vec a, vec b, vec d, vec m, float dx, bool has_min) {
  acc = fmadd(a, mul(d, set1(dx)), acc);
  return has_min ? fmadd(b, mul(m, set1(dx)), acc) : acc;
}

inline vec load_i8(const int8_t *p) {  // 16 int8 as float32
#if defined(__AVX512BF16__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
#endif
}

// Block nb's codes (of at most 6 bits) of inputs 4t .. 4t + 3: lo holds each output's inputs 4t, 4t + 1, hi its
// 4t + 2, 4t + 3, a code a byte (byte 2i + j: output i).
template <int HB>
inline void block_codes(const Blocks &w, int64_t K, int64_t nb, int64_t t, __m256i &lo, __m256i &hi) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  const uint8_t *c = w.lo + (nb * (K / 4) + t) * 32;
  ahead(c);
  const __m256i v = _mm256_loadu_si256((const __m256i *)c);
  lo = _mm256_and_si256(v, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  if constexpr (HB > 0) {
    constexpr int per = 4 / HB;
    const uint8_t *h = w.hi + (nb * (K / 4 / per) + t / per) * 32;
    ahead(h);
    const __m256i u = _mm256_loadu_si256((const __m256i *)h);
    const __m128i s = _mm_cvtsi32_si128((int)((t % per) * HB)), s4 = _mm_cvtsi32_si128((int)((t % per) * HB + 4));
    const __m256i mask = _mm256_set1_epi8((char)((1 << HB) - 1));
    const __m256i ulo = _mm256_and_si256(_mm256_srl_epi16(u, s), mask);
    const __m256i uhi = _mm256_and_si256(_mm256_srl_epi16(u, s4), mask);
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(ulo, 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(uhi, 4));
  }
}

// 16 int32 sums (outputs 0-7 in lo, 8-15 in hi) as float32
inline vec i32_pair(__m256i lo, __m256i hi) {
#if defined(__AVX512BF16__)
  return _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
#else
  return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
#endif
}

// Group g's span (sp) and whether g is its last group, stepped a group at a time: no division in the loops.
struct span_walk {
  int64_t per, sp = 0, in = 0;
  bool ends() const { return in + 1 == per; }
  void next() {
    if (++in == per) in = 0, sp++;
  }
};

// Rows [0, MR) against NT blocks of 16 outputs from block nb. A group's sums of code · xq: vpmaddubsw's 16-bit sums
// over as many inputs as cannot overflow (8 for 5-bit codes, 4 for 6), widened to 32 bits, kept in registers; 8-bit
// codes as llama.cpp's Q8 products, |w| · (x · sign w) per 4 inputs widened at once. 4-bit codes sum a whole group in 16 bits, wrapping: sum((code - 8) · xq) lies
// within 32 · 8 · 127 < 2^15, so that difference modulo 2^16 is exact, and the sum is it plus 8 · sum(xq) (total).
template <int HB, int MR, int NT>
void blocks_tile(const Blocks &w, const int32_t *pairs, int64_t K, const float *d, const float *xsum,
                 const int32_t *total, int64_t nb, uint16_t *out, int64_t N) {
  const int64_t G = w.group, chunk = HB == 1 ? 8 : HB == 2 ? 4 : G, groups = K / G, spans = K / w.span, per = w.span / G;
#if !defined(__AVX512BF16__)
  if constexpr (HB == 0 && MR > 4) {  // two blocks a tile (blocks_per_tile): their sums of 4 rows fit the registers
    blocks_tile<HB, 4, NT>(w, pairs, K, d, xsum, total, nb, out, N);
    blocks_tile<HB, MR - 4, NT>(w, pairs + 4 * (K / 2), K, d + 4 * groups, xsum + 4 * groups, total + 4 * groups,
                                nb, out + 4 * N, N);
    return;
  }
#endif
  const int64_t dmw = 1 + w.has_min, scw = w.has_scale + w.has_min;
  alignas(64) float acc[MR][NT][16];
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) store_f32(acc[m][t], zero());
  const vec offset = set1(w.offset);
  constexpr bool INT = HB == 2;  // integer_scaled takes 6-bit codes only
  constexpr int IM = INT ? MR : 1, IT = INT ? NT : 1;
  const bool integer = INT && integer_scaled(w);
  const int32_t off = (int32_t)w.offset;
  __m256i ia[IM][IT][2], ib[IM][IT][2];  // A and B of the span (integer_scaled)
  if constexpr (INT)
    for (int m = 0; m < MR; m++)
      for (int t = 0; t < NT; t++) ia[m][t][0] = ia[m][t][1] = ib[m][t][0] = ib[m][t][1] = _mm256_setzero_si256();
  span_walk span{per};
  for (int64_t g = 0; g < groups; g++, span.next()) {
    __m256i lo32[MR][NT], hi32[MR][NT];
    for (int m = 0; m < MR; m++)
      for (int t = 0; t < NT; t++) lo32[m][t] = hi32[m][t] = _mm256_setzero_si256();
    if constexpr (HB == 8) {  // signed codes, 4 inputs of an output a 32-bit lane: |w| · (x · sign w), exact in 16 bits
      const __m256i ones = _mm256_set1_epi16(1);
      for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
        for (int t = 0; t < NT; t++) {
          const int8_t *c = (const int8_t *)w.lo + ((nb + t) * (K / 4) + k / 4) * 64;
          ahead(c);
          const __m256i w0 = _mm256_loadu_si256((const __m256i *)c), w1 = _mm256_loadu_si256((const __m256i *)(c + 32));
          const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
          for (int m = 0; m < MR; m++) {
            int32_t quad;  // inputs k .. k + 3: the pairs' words hold [x0 x1 x0 x1] [x2 x3 x2 x3], so bytes 2-5
            memcpy(&quad, (const char *)at_pairs(pairs, K, m, k) + 2, 4);
            const __m256i x = _mm256_set1_epi32(quad);
            lo32[m][t] = _mm256_add_epi32(
                lo32[m][t], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones));
            hi32[m][t] = _mm256_add_epi32(
                hi32[m][t], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1)), ones));
          }
        }
      }
    } else
    for (int64_t c0 = g * G; c0 < (g + 1) * G; c0 += chunk) {
      __m256i s16[MR][NT];
      for (int m = 0; m < MR; m++)
        for (int t = 0; t < NT; t++) s16[m][t] = _mm256_setzero_si256();
      for (int64_t k = c0; k < c0 + chunk; k += 4) {
        __m256i lo[NT], hi[NT];  // the step's codes, then each row's inputs once for all blocks (fewer spills)
        for (int t = 0; t < NT; t++) block_codes<HB>(w, K, nb + t, (uint64_t)k / 4, lo[t], hi[t]);
        for (int m = 0; m < MR; m++) {
          const int32_t *p = at_pairs(pairs, K, m, k);
          const __m256i x0 = _mm256_set1_epi32(p[0]), x1 = _mm256_set1_epi32(p[1]);
          for (int t = 0; t < NT; t++) {
            s16[m][t] = _mm256_add_epi16(s16[m][t], _mm256_maddubs_epi16(lo[t], x0));
            s16[m][t] = _mm256_add_epi16(s16[m][t], _mm256_maddubs_epi16(hi[t], x1));
          }
        }
      }
      if constexpr (HB == 0)
        for (int m = 0; m < MR; m++) {
          const int32_t eight = 8 * total[m * groups + g];
          for (int t = 0; t < NT; t++) s16[m][t] = _mm256_sub_epi16(s16[m][t], _mm256_set1_epi16((int16_t)(uint16_t)eight));
          lo32[m][0] = hi32[m][0] = _mm256_set1_epi32(eight);
          for (int t = 1; t < NT; t++) lo32[m][t] = hi32[m][t] = lo32[m][0];
        }
      for (int m = 0; m < MR; m++)
        for (int t = 0; t < NT; t++) {
          lo32[m][t] = _mm256_add_epi32(lo32[m][t], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[m][t])));
          hi32[m][t] = _mm256_add_epi32(hi32[m][t], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[m][t], 1)));
        }
    }
    if constexpr (INT) if (integer) {
      for (int t = 0; t < NT; t++) {
        const int8_t *scm = w.scm + ((nb + t) * groups + g) * scw * 16;
        const __m256i sc_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)scm));
        const __m256i sc_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(scm + 8)));
        const __m256i mn_lo = w.has_min ? _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(scm + 16))) : sc_lo;
        const __m256i mn_hi = w.has_min ? _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(scm + 24))) : sc_hi;
        for (int m = 0; m < MR; m++) {
          const int32_t tm = total[m * groups + g];
          const __m256i o = _mm256_set1_epi32(off * tm);
          ia[m][t][0] = _mm256_add_epi32(ia[m][t][0], _mm256_mullo_epi32(_mm256_add_epi32(lo32[m][t], o), sc_lo));
          ia[m][t][1] = _mm256_add_epi32(ia[m][t][1], _mm256_mullo_epi32(_mm256_add_epi32(hi32[m][t], o), sc_hi));
          if (w.has_min) {
            ib[m][t][0] = _mm256_add_epi32(ib[m][t][0], _mm256_mullo_epi32(mn_lo, _mm256_set1_epi32(tm)));
            ib[m][t][1] = _mm256_add_epi32(ib[m][t][1], _mm256_mullo_epi32(mn_hi, _mm256_set1_epi32(tm)));
          }
        }
      }
      if (span.ends()) {
        const int64_t sp = span.sp;
        for (int t = 0; t < NT; t++) {
          const uint16_t *dm = w.dm + ((nb + t) * spans + sp) * dmw * 16;
          const vec dd = load_f16(dm), mm = w.has_min ? load_f16(dm + 16) : zero();
          for (int m = 0; m < MR; m++) {
            store_f32(acc[m][t], span_step(load_f32(acc[m][t]), i32_pair(ia[m][t][0], ia[m][t][1]),
                                           i32_pair(ib[m][t][0], ib[m][t][1]), dd, mm, d[m * spans + sp], w.has_min));
            ia[m][t][0] = ia[m][t][1] = ib[m][t][0] = ib[m][t][1] = _mm256_setzero_si256();
          }
        }
      }
      continue;
    }
    for (int t = 0; t < NT; t++) {
      const uint16_t *dm = w.dm + ((nb + t) * spans + span.sp) * dmw * 16;
      const int8_t *scm = w.scm + ((nb + t) * groups + g) * scw * 16;
      const vec scale = w.has_scale ? mul(load_f16(dm), load_i8(scm)) : load_f16(dm);
      const vec bias = fmadd(offset, scale, w.has_min ? mul(load_f16(dm + 16), load_i8(scm + 16 * w.has_scale)) : zero());
      for (int m = 0; m < MR; m++) {
        vec a = load_f32(acc[m][t]);
        a = fmadd(i32_pair(lo32[m][t], hi32[m][t]), mul(scale, set1(d[m * groups + g])), a);
        a = fmadd(set1(xsum[m * groups + g]), bias, a);
        store_f32(acc[m][t], a);
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) store_bf16(out + m * N + (nb + t) * 16, load_f32(acc[m][t]));
}

#if !defined(__AVX512BF16__)
// Whether blocks_tile_pairs sums a group of 6-bit codes exactly: a 16-bit lane meets G / 2 products (code - 32) · xq.
inline bool pairs_exact(const Blocks &w) { return w.group / 2 * 32 * 127 < 32768; }

// An integer_scaled weight (6-bit codes) on AVX2, laid out as blocks_tile_vnni's (a 32-bit lane one output's four inputs: outputs
// 0-3 and 8-11 in a, 4-7 and 12-15 in b). vpmaddubsw's pairs are summed over the whole group in 16 bits: a lane
// holds sum(code · xq) over the group's inputs 4t, 4t + 1 (or 4t + 2, 4t + 3); less 32 times those inputs' sum
// (split) it lies within 2^15 (pairs_exact), so that difference modulo 2^16 is exact, and vpmaddwd with the
// group's scales (a pair of words each) multiplies and widens it in one step. A, B as integer_scaled defines them;
// the same integers, and per lane the same float operations, as blocks_tile.
template <int MR, int NT>
void blocks_tile_pairs(const Blocks &w, const int32_t *pairs, int64_t K, const float *d, const int32_t *total,
                       const int32_t *split, int64_t nb, uint16_t *out, int64_t N) {
  const int64_t G = w.group, groups = K / G, spans = K / w.span, per = w.span / G;
  if constexpr (MR > 4) {  // two 16-bit sums a row and block: 4 rows' stay in registers, the codes in the cache
    blocks_tile_pairs<4, NT>(w, pairs, K, d, total, split, nb, out, N);
    blocks_tile_pairs<MR - 4, NT>(w, pairs + 4 * (K / 2), K, d + 4 * spans, total + 4 * groups,
                                      split + 4 * groups, nb, out + 4 * N, N);
    return;
  }
  const int64_t dmw = 1 + w.has_min, scw = w.has_scale + w.has_min;
  const int32_t extra = 32 + (int32_t)w.offset;  // A = sum sc · (code - 32) · xq + extra · sum sc · sum(xq)
  alignas(32) int32_t ia[MR][NT][2][8], ic[MR][NT][2][8], ib[MR][NT][2][8];  // by lane, as a and b
  alignas(64) float acc[MR][NT][16];
  const __m256i z = _mm256_setzero_si256();
  auto at = [](int32_t *p) { return (__m256i *)p; };
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) {
      store_f32(acc[m][t], zero());
      for (int h = 0; h < 2; h++) {
        _mm256_store_si256(at(ia[m][t][h]), z);
        _mm256_store_si256(at(ic[m][t][h]), z);
        _mm256_store_si256(at(ib[m][t][h]), z);
      }
    }
  span_walk span{per};
  for (int64_t g = 0; g < groups; g++, span.next()) {
    __m256i a[MR][NT], b[MR][NT];
    for (int m = 0; m < MR; m++)
      for (int t = 0; t < NT; t++) a[m][t] = b[m][t] = z;
    for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
      __m256i wa[NT], wb[NT];
      for (int t = 0; t < NT; t++) {
        __m256i lo, hi;
        block_codes<2>(w, K, nb + t, (uint64_t)k / 4, lo, hi);
        wa[t] = _mm256_unpacklo_epi16(lo, hi);
        wb[t] = _mm256_unpackhi_epi16(lo, hi);
      }
      for (int m = 0; m < MR; m++) {
        int32_t quad;  // inputs k .. k + 3: the pairs' words hold [x0 x1 x0 x1] [x2 x3 x2 x3], so bytes 2-5
        memcpy(&quad, (const char *)at_pairs(pairs, K, m, k) + 2, 4);
        const __m256i x = _mm256_set1_epi32(quad);
        for (int t = 0; t < NT; t++) {
          a[m][t] = _mm256_add_epi16(a[m][t], _mm256_maddubs_epi16(wa[t], x));
          b[m][t] = _mm256_add_epi16(b[m][t], _mm256_maddubs_epi16(wb[t], x));
        }
      }
    }
    for (int t = 0; t < NT; t++) {
      const int8_t *scm = w.scm + ((nb + t) * groups + g) * scw * 16;
      const __m256i sv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scm));  // outputs 0-7 | 8-15
      const __m256i sc_a = _mm256_unpacklo_epi16(sv, sv), sc_b = _mm256_unpackhi_epi16(sv, sv);
      __m256i mn_a = z, mn_b = z;
      if (w.has_min) {
        const __m256i mv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(scm + 16)));
        mn_a = _mm256_unpacklo_epi16(mv, mv);
        mn_b = _mm256_unpackhi_epi16(mv, mv);
      }
      for (int m = 0; m < MR; m++) {
        const __m256i mid = _mm256_slli_epi16(_mm256_set1_epi32(split[m * groups + g]), 5);  // 32 · split
        const __m256i am = _mm256_sub_epi16(a[m][t], mid), bm = _mm256_sub_epi16(b[m][t], mid);
        auto plus = [&](int32_t *p, __m256i v) {
          _mm256_store_si256(at(p), _mm256_add_epi32(_mm256_load_si256(at(p)), v));
        };
        plus(ia[m][t][0], _mm256_madd_epi16(am, sc_a));
        plus(ia[m][t][1], _mm256_madd_epi16(bm, sc_b));
        const __m256i tv = _mm256_set1_epi32((int32_t)(uint16_t)total[m * groups + g]);  // words (T, 0): sc · T
        if (extra != 0) {
          plus(ic[m][t][0], _mm256_madd_epi16(sc_a, tv));
          plus(ic[m][t][1], _mm256_madd_epi16(sc_b, tv));
        }
        if (w.has_min) {
          plus(ib[m][t][0], _mm256_madd_epi16(mn_a, tv));
          plus(ib[m][t][1], _mm256_madd_epi16(mn_b, tv));
        }
      }
    }
    if (span.ends()) {
      const int64_t sp = span.sp;
      const __m256i ex = _mm256_set1_epi32(extra);
      for (int t = 0; t < NT; t++) {
        const uint16_t *dm = w.dm + ((nb + t) * spans + sp) * dmw * 16;
        const vec dd = load_f16(dm), mm = w.has_min ? load_f16(dm + 16) : zero();
        for (int m = 0; m < MR; m++) {
          __m256i a0 = _mm256_load_si256(at(ia[m][t][0])), a1 = _mm256_load_si256(at(ia[m][t][1]));
          if (extra != 0) {
            a0 = _mm256_add_epi32(a0, _mm256_mullo_epi32(_mm256_load_si256(at(ic[m][t][0])), ex));
            a1 = _mm256_add_epi32(a1, _mm256_mullo_epi32(_mm256_load_si256(at(ic[m][t][1])), ex));
          }
          const __m256i b0 = _mm256_load_si256(at(ib[m][t][0])), b1 = _mm256_load_si256(at(ib[m][t][1]));
          const vec av = i32_pair(_mm256_permute2x128_si256(a0, a1, 0x20), _mm256_permute2x128_si256(a0, a1, 0x31));
          const vec bv = i32_pair(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
          store_f32(acc[m][t], span_step(load_f32(acc[m][t]), av, bv, dd, mm, d[m * spans + sp], w.has_min));
          for (int h = 0; h < 2; h++) {
            _mm256_store_si256(at(ia[m][t][h]), z);
            _mm256_store_si256(at(ic[m][t][h]), z);
            _mm256_store_si256(at(ib[m][t][h]), z);
          }
        }
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) store_bf16(out + m * N + (nb + t) * 16, load_f32(acc[m][t]));
}
#endif

#if defined(__AVX512VNNI__)
// block_codes for blocks nb and nb + 1 at once, block nb's in the low 256 bits.
template <int HB>
inline void two_block_codes(const Blocks &w, int64_t K, int64_t nb, int64_t t, __m512i &lo, __m512i &hi) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  const uint8_t *c = w.lo + (nb * (K / 4) + t) * 32;
  ahead(c);
  ahead(c + (K / 4) * 32);
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)c)),
                                       _mm256_loadu_si256((const __m256i *)(c + (K / 4) * 32)), 1);
  lo = _mm512_and_si512(v, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  if constexpr (HB > 0) {
    constexpr int per = 4 / HB;
    const uint8_t *h = w.hi + (nb * (K / 4 / per) + t / per) * 32;
    ahead(h);
    const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)h)),
                                         _mm256_loadu_si256((const __m256i *)(h + (K / 4 / per) * 32)), 1);
    const __m128i s = _mm_cvtsi32_si128((int)((t % per) * HB)), s4 = _mm_cvtsi32_si128((int)((t % per) * HB + 4));
    const __m512i mask = _mm512_set1_epi8((char)((1 << HB) - 1));
    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(u, s), mask), 4));
    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srl_epi16(u, s4), mask), 4));
  }
}

// blocks_tile with vpdpbusd (4 products into a 32-bit lane, exact): codes of at most 6 bits for an even NT, as
// int4q8_tile_vnni lays them out (a lane one output's four inputs, outputs permuted and put back at the end); 8-bit
// codes for any NT, their 64-byte tiles already a lane per output, unsigned as code + 128 with 128 · sum(xq) taken
// off. The same integer sums, and per lane the same float operations in the same order, as blocks_tile.
template <int HB, int MR, int NT, bool MIN>
void blocks_tile_vnni(const Blocks &w, const int32_t *pairs, int64_t K, const float *d, const float *xsum,
                      const int32_t *total, int64_t nb, uint16_t *out, int64_t N) {
  constexpr int P = HB == 8 ? NT : NT / 2;  // 512-bit sums a row: a block each (8-bit), else a pair of blocks
  const int64_t G = w.group, groups = K / G, spans = K / w.span, per = w.span / G;
  const int64_t dmw = 1 + w.has_min, scw = w.has_scale + w.has_min;
  const __m512i in_a = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i in_b = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  const __m512 offset = _mm512_set1_ps(w.offset);
  alignas(64) float acc_a[MR][P][16], acc_b[MR][HB == 8 ? 1 : P][16];
  for (int m = 0; m < MR; m++)
    for (int q = 0; q < P; q++) {
      _mm512_store_ps(acc_a[m][q], _mm512_setzero_ps());
      if constexpr (HB != 8) _mm512_store_ps(acc_b[m][q], _mm512_setzero_ps());
    }
  auto scale_bias = [&](int64_t t, int64_t g, int64_t sp, __m512 &scale, __m512 &bias) {  // as blocks_tile's
    const uint16_t *dm = w.dm + ((nb + t) * spans + sp) * dmw * 16;
    const int8_t *scm = w.scm + ((nb + t) * groups + g) * scw * 16;
    scale = w.has_scale ? mul(load_f16(dm), load_i8(scm)) : load_f16(dm);
    bias = fmadd(offset, scale, w.has_min ? mul(load_f16(dm + 16), load_i8(scm + 16 * w.has_scale)) : zero());
  };
  constexpr bool INT = HB == 2;  // integer_scaled takes 6-bit codes only
  const bool integer = INT && integer_scaled(w);
  const int32_t off = (int32_t)w.offset;
  constexpr int AM = INT ? MR : 1, AP = INT ? P : 1, BM = INT && MIN ? MR : 1, BP = INT && MIN ? P : 1;
  __m512i ia_a[AM][AP], ia_b[AM][AP], ib_a[BM][BP], ib_b[BM][BP];  // A and B of the span, by lane (B with mins)
  auto zero_ab = [&](int m, int q) {
    ia_a[m][q] = ia_b[m][q] = _mm512_setzero_si512();
    if constexpr (MIN) ib_a[m][q] = ib_b[m][q] = _mm512_setzero_si512();
  };
  if constexpr (INT)
    for (int m = 0; m < MR; m++)
      for (int q = 0; q < P; q++) zero_ab(m, q);
  auto add = [&](float *acc, __m512i sums, __m512 scale, __m512 bias, int m, int64_t g) {
    __m512 a = _mm512_load_ps(acc);
    a = fmadd(_mm512_cvtepi32_ps(sums), mul(scale, set1(d[m * groups + g])), a);
    a = fmadd(set1(xsum[m * groups + g]), bias, a);
    _mm512_store_ps(acc, a);
  };
  span_walk span{per};
  for (int64_t g = 0; g < groups; g++, span.next()) {
    __m512i a[MR][P], b[MR][HB == 8 ? 1 : P];
    for (int m = 0; m < MR; m++)
      for (int q = 0; q < P; q++) {
        a[m][q] = _mm512_setzero_si512();
        if constexpr (HB != 8) b[m][q] = _mm512_setzero_si512();
      }
    for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
      __m512i wa[P], wb[P];
      for (int q = 0; q < P; q++) {
        if constexpr (HB == 8) {
          const uint8_t *c = w.lo + ((nb + q) * (K / 4) + (uint64_t)k / 4) * 64;
          ahead(c);
          wa[q] = _mm512_xor_si512(_mm512_loadu_si512((const void *)c), _mm512_set1_epi8((char)0x80));
        } else {
          __m512i lo, hi;
          two_block_codes<HB>(w, K, nb + 2 * q, (uint64_t)k / 4, lo, hi);
          wa[q] = _mm512_unpacklo_epi16(lo, hi);
          wb[q] = _mm512_unpackhi_epi16(lo, hi);
        }
      }
      for (int m = 0; m < MR; m++) {
        int32_t quad;  // inputs k .. k + 3: the pairs' words hold [x0 x1 x0 x1] [x2 x3 x2 x3], so bytes 2-5
        memcpy(&quad, (const char *)at_pairs(pairs, K, m, k) + 2, 4);
        const __m512i x = _mm512_set1_epi32(quad);
        for (int q = 0; q < P; q++) {
          a[m][q] = _mm512_dpbusd_epi32(a[m][q], wa[q], x);
          if constexpr (HB != 8) b[m][q] = _mm512_dpbusd_epi32(b[m][q], wb[q], x);
        }
      }
    }
    const bool span_end = span.ends();
    const int64_t sp = span.sp;
    for (int q = 0; q < P; q++) {
      if constexpr (HB == 8) {
        __m512 scale, bias;
        scale_bias(q, g, sp, scale, bias);
        for (int m = 0; m < MR; m++)
          add(acc_a[m][q], _mm512_sub_epi32(a[m][q], _mm512_set1_epi32(128 * total[m * groups + g])), scale, bias,
              m, g);
      } else {
        bool done = false;
        if constexpr (INT)
          if (integer) {
            auto ints = [&](const int8_t *p0, const int8_t *p1, __m512i &ia, __m512i &ib) {  // 16 int8 of two blocks
              const __m512i v0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p0));
              const __m512i v1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p1));
              ia = _mm512_permutex2var_epi32(v0, in_a, v1);
              ib = _mm512_permutex2var_epi32(v0, in_b, v1);
            };
            const int8_t *scm0 = w.scm + ((nb + 2 * q) * groups + g) * scw * 16;
            const int8_t *scm1 = w.scm + ((nb + 2 * q + 1) * groups + g) * scw * 16;
            __m512i sc_a, sc_b, mn_a = _mm512_setzero_si512(), mn_b = _mm512_setzero_si512();
            ints(scm0, scm1, sc_a, sc_b);
            if (w.has_min) ints(scm0 + 16, scm1 + 16, mn_a, mn_b);
            for (int m = 0; m < MR; m++) {
              const int32_t tm = total[m * groups + g];
              const __m512i o = _mm512_set1_epi32(off * tm), tv = _mm512_set1_epi32(tm);
              ia_a[m][q] = _mm512_add_epi32(ia_a[m][q], _mm512_mullo_epi32(_mm512_add_epi32(a[m][q], o), sc_a));
              ia_b[m][q] = _mm512_add_epi32(ia_b[m][q], _mm512_mullo_epi32(_mm512_add_epi32(b[m][q], o), sc_b));
              if constexpr (MIN) {
                ib_a[m][q] = _mm512_add_epi32(ib_a[m][q], _mm512_mullo_epi32(mn_a, tv));
                ib_b[m][q] = _mm512_add_epi32(ib_b[m][q], _mm512_mullo_epi32(mn_b, tv));
              }
            }
            if (span_end) {
              const uint16_t *dm0 = w.dm + ((nb + 2 * q) * spans + sp) * dmw * 16;
              const uint16_t *dm1 = w.dm + ((nb + 2 * q + 1) * spans + sp) * dmw * 16;
              const __m512 d0 = load_f16(dm0), d1 = load_f16(dm1);
              const __m512 dd_a = _mm512_permutex2var_ps(d0, in_a, d1), dd_b = _mm512_permutex2var_ps(d0, in_b, d1);
              __m512 mm_a = zero(), mm_b = zero();
              if (w.has_min) {
                const __m512 m0 = load_f16(dm0 + 16), m1 = load_f16(dm1 + 16);
                mm_a = _mm512_permutex2var_ps(m0, in_a, m1);
                mm_b = _mm512_permutex2var_ps(m0, in_b, m1);
              }
              for (int m = 0; m < MR; m++) {
                const float dx = d[m * spans + sp];
                __m512 fb_a = zero(), fb_b = zero();
                if constexpr (MIN) {
                  fb_a = _mm512_cvtepi32_ps(ib_a[m][q]);
                  fb_b = _mm512_cvtepi32_ps(ib_b[m][q]);
                }
                const __m512 fa_a = _mm512_cvtepi32_ps(ia_a[m][q]), fa_b = _mm512_cvtepi32_ps(ia_b[m][q]);
                _mm512_store_ps(acc_a[m][q], span_step(_mm512_load_ps(acc_a[m][q]), fa_a, fb_a, dd_a, mm_a, dx, MIN));
                _mm512_store_ps(acc_b[m][q], span_step(_mm512_load_ps(acc_b[m][q]), fa_b, fb_b, dd_b, mm_b, dx, MIN));
                zero_ab(m, q);
              }
            }
            done = true;
          }
        if (!done) {
          __m512 scale0, bias0, scale1, bias1;
          scale_bias(2 * q, g, sp, scale0, bias0);
          scale_bias(2 * q + 1, g, sp, scale1, bias1);
          const __m512 scale_a = _mm512_permutex2var_ps(scale0, in_a, scale1);
          const __m512 bias_a = _mm512_permutex2var_ps(bias0, in_a, bias1);
          const __m512 scale_b = _mm512_permutex2var_ps(scale0, in_b, scale1);
          const __m512 bias_b = _mm512_permutex2var_ps(bias0, in_b, bias1);
          for (int m = 0; m < MR; m++) {
            add(acc_a[m][q], a[m][q], scale_a, bias_a, m, g);
            add(acc_b[m][q], b[m][q], scale_b, bias_b, m, g);
          }
        }
      }
    }
  }
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int m = 0; m < MR; m++)
    for (int q = 0; q < P; q++) {
      if constexpr (HB == 8) {
        store_bf16(out + m * N + (nb + q) * 16, _mm512_load_ps(acc_a[m][q]));
      } else {
        const __m512 ra = _mm512_load_ps(acc_a[m][q]), rb = _mm512_load_ps(acc_b[m][q]);
        store_bf16(out + m * N + (nb + 2 * q) * 16, _mm512_permutex2var_ps(ra, first, rb));
        store_bf16(out + m * N + (nb + 2 * q + 1) * 16, _mm512_permutex2var_ps(ra, second, rb));
      }
    }
}
#endif

// Blocks per tile: on AVX-512 VNNI an even number (blocks_tile_vnni pairs them), as the int8-activation tiles, but
// two for 6-bit codes from 2 rows (their integer epilogue at four blocks cost more than it saved); on AVX2 two for
// 4-bit codes from 2 rows on (a row's activations loaded once for both; blocks_tile runs more than 4 rows in passes
// of 4), one for wider codes from 4 rows, whose longer code unpacking two blocks did not repay. One row: the fewest
// blocks each build's tile takes (q8_blocks says why).
template <int HB>
constexpr int blocks_per_tile(int rows) {
#if defined(__AVX512VNNI__)
  return rows == 1 || HB == 2 ? 2 : q8_blocks(rows);
#else
  return rows == 1 ? 1 : HB == 0 || rows <= 3 ? 2 : 1;
#endif
}

// One linear layer of a fused step: kind 4 (int4 groups), 5 (int4 groups, int8 activations), 6 (GGUF blocks: codes
// points to a Blocks) or 8 (int8 rows), in the layout of the mm kernels.
struct Linear {
  int64_t kind;
  const void *codes;
  const void *scales;
  int64_t group;
  int64_t N;
  int64_t K;
};

// act[t, i] = bfloat16(bfloat16(x · sigmoid(z)) · up) with x = gate[t, i], in float32 with the kernels' exp: SiLU
// (z = x) or GELU's tanh form (GELU: z = 2u, u = sqrt(2/pi) · (x + 0.044715 x^3)).
template <bool GELU>
void gated_mul(const uint16_t *gate_up, int64_t T, int64_t I, uint16_t *act) {
  const vec one = set1(1.0f), c0 = set1(1.5957691216057308f), c1 = set1(0.044715f);  // c0 = 2 sqrt(2/pi)
#pragma omp parallel for schedule(static) if (T >= 4)
  for (int64_t t = 0; t < T; t++) {
    const uint16_t *g = gate_up + t * 2 * I, *u = g + I;
    for (int64_t i = 0; i < I; i += 16) {
      const vec x = load_bf16(g + i, I - i);
      const vec z = GELU ? mul(c0, fmadd(mul(c1, x), mul(x, x), x)) : x;
      const vec e = exp_nonpositive(sub(zero(), abs(z)));  // e^-|z|
      const vec sig = div(where_negative(z, e, one), add(one, e));
      store_bf16(act + t * I + i, mul(round_bf16(mul(x, sig)), load_bf16(u + i, I - i)), I - i);
    }
  }
}

}  // namespace

extern "C" {

// Which build this is: 512 (AVX-512 with bfloat16 dot products) or 2 (AVX2 + FMA + F16C).
int specserve_isa() { return kIsa; }

// specserve_int4_mm's product with the activations quantized to int8 per row and group (int4q8_tile).
void specserve_int4q8_mm(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sb,
                         int64_t G, uint16_t *out, int64_t N, float *xsum) {
  const int64_t groups = K / G;
  thread_local std::vector<int32_t> pairs;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> total;
  pairs.resize(M * K / 2);
  d.resize(M * groups);
  total.resize(M * groups);
  quantize_rows(x, M, K, G, G, pairs.data(), d.data(), xsum, total.data(), nullptr);
  const int32_t *xq = pairs.data(), *xt = total.data();  // the calling thread's, by pointer: tiles run elsewhere
  const float *xd = d.data();
  row_passes<q8_blocks>(M, N, [&](auto r, auto nt, int64_t m0, int64_t nb) {
    int4q8_tile<decltype(r)::value, decltype(nt)::value>(xq + m0 * K / 2, K, xd + m0 * groups, xsum + m0 * groups,
                                                         xt + m0 * groups, groups, G, codes, sb, nb, out + m0 * N, N);
  });
}

// x: bfloat16 [M, K]; codes: N/16 x K/4 x 32 bytes; sb: float16 [N/16, K/G, 2, 16] (scale, bias); out: [M, N];
// xsum: float scratch of M * K/G. N % 16 == 0, G % 4 == 0, K % G == 0.
void specserve_int4_mm(const uint16_t *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *sb, int64_t G,
                       uint16_t *out, int64_t N, float *xsum) {
  const int64_t groups = K / G;
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      float s = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; k++) s += bf16_to_float(x[m * K + k]);
      xsum[m * groups + g] = s;
    }
  const act_t *xa = activations(x, M, K, true);
  row_passes<tile_blocks>(M, N, [&](auto r, auto nt, int64_t m0, int64_t nb) {
    int4_tile<decltype(r)::value, decltype(nt)::value>(xa + m0 * K, K, xsum + m0 * groups, groups, G, codes, sb, nb,
                                                       out + m0 * N, N);
  });
}

// x: bfloat16 [M, K] times a Blocks weight (N outputs), int8 activations per row and group (per span where the
// weight's scales are integer_scaled); out: bfloat16 [M, N]; xsum: float scratch of M * K/group. N % 16 == 0,
// K % span == 0.
void specserve_blocks_mm(const uint16_t *x, int64_t M, int64_t K, const Blocks *w, uint16_t *out, int64_t N,
                         float *xsum) {
  const int64_t G = w->group, groups = K / G, A = integer_scaled(*w) ? w->span : G, acts = K / A;
  thread_local std::vector<int32_t> pairs;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> total, split;
  pairs.resize(M * K / 2);
  d.resize(M * acts);
  total.resize(M * groups);
  split.resize(M * groups);
  quantize_rows(x, M, K, A, G, pairs.data(), d.data(), xsum, total.data(), split.data());
  const int32_t *xq = pairs.data();
  const float *xd = d.data();
  const int32_t *xt = total.data();
#if !defined(__AVX512BF16__)
  const int32_t *xs = split.data();
#endif
  auto run = [&](auto hb) {
    constexpr int HB = decltype(hb)::value;
    row_passes<blocks_per_tile<HB>>(M, N, [&](auto r, auto nt, int64_t m0, int64_t nb) {
      constexpr int MR = decltype(r)::value, NT = decltype(nt)::value;
#if defined(__AVX512VNNI__)
      if constexpr (HB == 8 || NT % 2 == 0) {
        if (HB == 2 && w->has_min)  // (mins matter only to the 6-bit codes' integer epilogue)
          blocks_tile_vnni<HB, MR, NT, HB == 2>(*w, xq + m0 * K / 2, K, xd + m0 * acts, xsum + m0 * acts,
                                             xt + m0 * groups, nb, out + m0 * N, N);
        else
          blocks_tile_vnni<HB, MR, NT, false>(*w, xq + m0 * K / 2, K, xd + m0 * acts, xsum + m0 * acts,
                                              xt + m0 * groups, nb, out + m0 * N, N);
        return;
      }
#elif !defined(__AVX512BF16__)
      if constexpr (HB == 2)
        if (integer_scaled(*w) && pairs_exact(*w)) {
          blocks_tile_pairs<MR, NT>(*w, xq + m0 * K / 2, K, xd + m0 * acts, xt + m0 * groups, xs + m0 * groups,
                                        nb, out + m0 * N, N);
          return;
        }
#endif
      blocks_tile<HB, MR, NT>(*w, xq + m0 * K / 2, K, xd + m0 * acts, xsum + m0 * acts, xt + m0 * groups, nb,
                              out + m0 * N, N);
    });
  };
  switch (w->bits) {
    case 4: run(std::integral_constant<int, 0>()); break;
    case 5: run(std::integral_constant<int, 1>()); break;
    case 6: run(std::integral_constant<int, 2>()); break;
    default: run(std::integral_constant<int, 8>()); break;
  }
}

// x: bfloat16 [M, K]; codes: N/16 x K/2 x 32 bytes; scales: float [N]; out: bfloat16 [M, N]. N % 16 == 0, K even.
void specserve_int8_mm(const uint16_t *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                       uint16_t *out, int64_t N) {
  const act_t *xa = activations(x, M, K, false);
  row_passes<tile_blocks>(M, N, [&](auto r, auto nt, int64_t m0, int64_t nb) {
    int8_tile<decltype(r)::value, decltype(nt)::value>(xa + m0 * K, K, codes, scales, nb, out + m0 * N, N);
  });
}

// Attention of short new blocks against one layer of the pool's arena (k, v: [kv_heads, positions, D], head
// `head_stride` elements apart), after writing the blocks' keys and values into it. Sequence j (info[4j..]:
// arena offset of its block, cached length, new tokens, first row in q) has query i see its cache and its new
// tokens up to itself, and with a sliding `window` > 0 only the last `window` of those; `softcap` > 0 caps the
// scores to softcap · tanh(score / softcap) (Gemma 2). q: [T, heads, D] rows `q_stride` apart; k_new, v_new:
// [T, kv_heads, D]; out: [T, heads·D].
void specserve_attend(const uint16_t *q, int64_t q_stride, const uint16_t *k_new, int64_t k_stride,
                      const uint16_t *v_new, int64_t v_stride, uint16_t *k, uint16_t *v, int64_t head_stride,
                      const int64_t *info, int64_t nseq, int64_t heads, int64_t kv_heads, int64_t D, float scale,
                      int64_t window, float softcap, uint16_t *out) {
  int64_t rows = 0;
  for (int64_t j = 0; j < nseq; j++) {
    const int64_t base = info[4 * j], start = info[4 * j + 1], n = info[4 * j + 2], row = info[4 * j + 3];
    for (int64_t i = 0; i < n; i++)
      for (int64_t g = 0; g < kv_heads; g++) {
        memcpy(k + g * head_stride + (base + start + i) * D, k_new + (row + i) * k_stride + g * D, D * 2);
        memcpy(v + g * head_stride + (base + start + i) * D, v_new + (row + i) * v_stride + g * D, D * 2);
      }
    rows += n;
  }
  std::vector<int64_t> task;  // (sequence, new token) per row
  task.reserve(2 * rows);
  for (int64_t j = 0; j < nseq; j++)
    for (int64_t i = 0; i < info[4 * j + 2]; i++) task.push_back(j), task.push_back(i);
  // a task: one head, or, with enough rows to keep every thread busy, a group of heads that share keys and values
  const int64_t group = heads / kv_heads;
  const int64_t per = group > 1 && rows * kv_heads >= 2 * omp_get_max_threads() ? group : 1;
  const int64_t per_row = heads / per, tasks = rows * per_row;
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t x = 0; x < tasks; x++) {
      const int64_t j = task[2 * (x / per_row)], i = task[2 * (x / per_row) + 1], h = x % per_row * per;
      const int64_t base = info[4 * j], start = info[4 * j + 1], row = info[4 * j + 3] + i;
      const int64_t g = h / group, seen = start + i + 1;
      const int64_t lo = window > 0 && seen > window ? seen - window : 0;  // key t seen iff t > position - window
      const uint16_t *kg = k + g * head_stride + (base + lo) * D, *vg = v + g * head_stride + (base + lo) * D;
      attend_group(q + row * q_stride + h * D, per, kg, vg, D, seen - lo, D, scale, softcap,
                   out + row * heads * D + h * D, scores);
    }
  }
}

// 1 / sqrt(mean(x²) + eps) of a row of H bfloat16 values, summed in float32 (both RMS norms' normalisation).
static inline float inverse_rms(const uint16_t *row, int64_t H, float eps) {
  vec ss = zero();
  for (int64_t c = 0; c < H; c += 16) {
    const vec a = load_bf16(row + c, H - c);
    ss = fmadd(a, a, ss);
  }
  return 1.0f / sqrtf(reduce_add(ss) / (float)H + eps);
}

// weight · bfloat16(x / rms(x)) for rows of x [M, H] (`x_stride` apart): the normalisation in float32, the
// scaling in bfloat16, as `lean._rms`.
void specserve_rms_norm(const uint16_t *x, int64_t x_stride, const uint16_t *weight, int64_t M, int64_t H,
                        float eps, uint16_t *out) {
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; m++) {
    const uint16_t *row = x + m * x_stride;
    const float r = inverse_rms(row, H, eps);
    for (int64_t c = 0; c < H; c++) {
      const float y = bf16_to_float(float_to_bf16(bf16_to_float(row[c]) * r));
      out[m * H + c] = float_to_bf16(y * bf16_to_float(weight[c]));
    }
  }
}

// bfloat16(x / rms(x) · weight) for rows of x [M, H] (`x_stride` apart) with float32 weights (Gemma's 1 + w,
// OLMo 2's): the normalisation and the scaling in float32, one rounding, as `lean.norm` for those families.
void specserve_rms_norm_f32(const uint16_t *x, int64_t x_stride, const float *weight, int64_t M, int64_t H,
                            float eps, uint16_t *out) {
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; m++) {
    const uint16_t *row = x + m * x_stride;
    const float r = inverse_rms(row, H, eps);
    for (int64_t c = 0; c < H; c++) out[m * H + c] = float_to_bf16(bf16_to_float(row[c]) * r * weight[c]);
  }
}


// A blocks weight's codes [N, K] (one a byte) in the layout specserve_blocks_mm reads (struct Blocks), in one
// pass: for each 16 outputs and 4 inputs, lo holds 8-bit codes less 128 [16][4], or low nibbles, inputs j and
// j + 2 in one byte [16][2]; hi the bits above the nibble (5- and 6-bit codes), 4 / (bits - 4) tiles in a byte,
// the first in the lowest bits.
void specserve_pack_codes(const uint8_t *codes, int64_t N, int64_t K, int64_t bits, uint8_t *lo, uint8_t *hi) {
  const int64_t tiles = K / 4, hb = bits - 4, per = (hb == 1 || hb == 2) ? 4 / hb : 1;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < N / 16; b++) {
    for (int64_t t = 0; t < tiles; t++) {
      for (int64_t o = 0; o < 16; o++) {
        const uint8_t *c = codes + (b * 16 + o) * K + t * 4;
        if (bits == 8) {
          uint8_t *out = lo + (b * tiles + t) * 64 + o * 4;
          for (int j = 0; j < 4; j++) out[j] = (uint8_t)(c[j] - 128);
          continue;
        }
        uint8_t *out = lo + (b * tiles + t) * 32 + o * 2;
        for (int j = 0; j < 2; j++) out[j] = (uint8_t)((c[j] & 0x0F) | (c[j + 2] & 0x0F) << 4);
        if (per > 1) {
          uint8_t *h = hi + (b * (tiles / per) + t / per) * 32 + o * 2;
          const int shift = (int)((t % per) * hb);
          for (int j = 0; j < 2; j++) {
            const uint8_t pair = (uint8_t)((c[j] >> 4) | (c[j + 2] >> 4) << 4);
            h[j] = (uint8_t)((t % per == 0 ? 0 : h[j]) | pair << shift);
          }
        }
      }
    }
  }
}


// act[t, i] = bfloat16(bfloat16(silu(gate)) · up) for gate_up [T, 2I] (gate first): SiLU in float32.
void specserve_silu_mul(const uint16_t *gate_up, int64_t T, int64_t I, uint16_t *act) {
  gated_mul<false>(gate_up, T, I, act);
}

// act[t, i] = bfloat16(bfloat16(gelu_tanh(gate)) · up) for gate_up [T, 2I] (gate first): GELU's tanh form in
// float32 as x · sigmoid(2u), u = sqrt(2/pi) · (x + 0.044715 x^3) (the same function, without 1 + tanh's
// cancellation for negative x), with the kernels' exp.
void specserve_gelu_mul(const uint16_t *gate_up, int64_t T, int64_t I, uint16_t *act) {
  gated_mul<true>(gate_up, T, I, act);
}

}  // extern "C"

namespace {
// Rotary embedding of the queries and keys of rows of qkv [T, (heads + kv_heads + kv_heads) · D] (`stride` apart),
// into out [T, heads + kv_heads, D]: x·cos + rotate_half(x)·sin with cos, sin [T, D], each product and the sum
// rounded to bfloat16 as torch's bfloat16 ops round them (lean.rotated_qkv).
void rope(const uint16_t *qkv, int64_t stride, int64_t T, int64_t rotated_heads, int64_t D,
          const uint16_t *cos, const uint16_t *sin, uint16_t *out) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < rotated_heads; h++) {
      const uint16_t *x = qkv + t * stride + h * D;
      uint16_t *o = out + (t * rotated_heads + h) * D;
      for (int64_t d = 0; d < D; d += 16) {  // D % 32 == 0: 16 lanes stay in one half
        const vec a = load_bf16(x + d), c = load_bf16(cos + t * D + d), s = load_bf16(sin + t * D + d);
        const vec r = d < half ? sub(zero(), load_bf16(x + d + half)) : load_bf16(x + d - half);
        store_bf16(o + d, add(round_bf16(mul(a, c)), round_bf16(mul(r, s))));
      }
    }
}

void residual_add(uint16_t *x, const uint16_t *y, int64_t n) {  // x = bfloat16(x + y)
  for (int64_t i = 0; i < n; i += 16) store_bf16(x + i, add(load_bf16(x + i, n - i), load_bf16(y + i, n - i)), n - i);
}

// An RMS norm of rows with the family's weights: bfloat16 ones scaled after the cast (Llama's), or float32 ones
// before it (f32: Gemma's 1 + w). In place where out is x.
void norm_rows(const uint16_t *x, int64_t stride, const void *weight, bool f32, int64_t M, int64_t H, float eps,
               uint16_t *out) {
  if (f32)
    specserve_rms_norm_f32(x, stride, (const float *)weight, M, H, eps, out);
  else
    specserve_rms_norm(x, stride, (const uint16_t *)weight, M, H, eps, out);
}

void linear(const Linear &w, const uint16_t *x, int64_t M, uint16_t *out, float *xsum) {
  if (w.kind == 4)
    specserve_int4_mm(x, M, w.K, (const uint8_t *)w.codes, (const uint16_t *)w.scales, w.group, out, w.N, xsum);
  else if (w.kind == 5)
    specserve_int4q8_mm(x, M, w.K, (const uint8_t *)w.codes, (const uint16_t *)w.scales, w.group, out, w.N, xsum);
  else if (w.kind == 6)
    specserve_blocks_mm(x, M, w.K, (const Blocks *)w.codes, out, w.N, xsum);
  else
    specserve_int8_mm(x, M, w.K, (const int8_t *)w.codes, (const float *)w.scales, out, w.N);
}
}  // namespace

extern "C" {

// One decoder layer over T rows of x [T, H] (updated in place) for sequences whose new blocks all go through
// specserve_attend: the same kernels, in the same order and with the same roundings, as lean._lean_forward's
// per-op path, in one call. lin: qkv, o, gate_up, down. b_qkv: q|k|v's bias [QKV] or null (Qwen2); q_norm,
// k_norm: RMS norms over each query and key head [D] or null (Qwen3, Gemma 3). norm_in, norm_post: the norms
// before the attention and the MLP, or null (OLMo 2); norm_attn_out, norm_mlp_out: the norms of the attention's
// and the MLP's outputs before their residual adds, or null (Gemma 2/3's sandwich, OLMo 2's). flags: 1, the
// norms' weights are float32 and scale before the cast (Gemma's 1 + w, OLMo 2's); 2, the MLP's activation is
// GELU's tanh form (Gemma's GeGLU), else SiLU; 4, q_norm and k_norm span all of a row's query heads and all its
// key heads [heads·D], [kv_heads·D] (OLMo 2). softcap: the attention's (specserve_attend), 0 for none. scratch: bfloat16 of T · (2H + 2·QKV + heads·D + 3I)
// (QKV = (heads + 2·kv_heads)·D, I = gate_up's N / 2); xsum: float32 of T · max(K / group).
void specserve_layer(uint16_t *x, int64_t T, int64_t H, const void *norm_in, const void *norm_post,
                     const void *norm_attn_out, const void *norm_mlp_out, int64_t flags, float eps,
                     const Linear *lin, const uint16_t *b_qkv, const void *q_norm, const void *k_norm,
                     const uint16_t *cos, const uint16_t *sin, uint16_t *k, uint16_t *v,
                     int64_t head_stride, const int64_t *info, int64_t nseq, int64_t heads, int64_t kv_heads,
                     int64_t D, float scale, float softcap, int64_t window, uint16_t *scratch, float *xsum) {
  const int64_t QK = (heads + kv_heads) * D, QKV = QK + kv_heads * D, I = lin[2].N / 2;
  uint16_t *h = scratch, *qkv = h + T * H, *qk = qkv + T * QKV, *att = qk + T * QKV, *o = att + T * heads * D;
  uint16_t *gate_up = o + T * H, *act = gate_up + T * 2 * I;
  const bool f32 = flags & 1;
  if (norm_in != nullptr) norm_rows(x, H, norm_in, f32, T, H, eps, h);
  linear(lin[0], norm_in != nullptr ? h : x, T, qkv, xsum);
  if (b_qkv != nullptr)
    for (int64_t t = 0; t < T; t++) residual_add(qkv + t * QKV, b_qkv, QKV);
  if (q_norm != nullptr && (flags & 4))  // in place, all of a row's heads at once
    for (int64_t t = 0; t < T; t++) {
      norm_rows(qkv + t * QKV, QKV, q_norm, f32, 1, heads * D, eps, qkv + t * QKV);
      norm_rows(qkv + t * QKV + heads * D, QKV, k_norm, f32, 1, kv_heads * D, eps, qkv + t * QKV + heads * D);
    }
  else if (q_norm != nullptr)  // in place, a head a row
    for (int64_t t = 0; t < T; t++) {
      norm_rows(qkv + t * QKV, D, q_norm, f32, heads, D, eps, qkv + t * QKV);
      norm_rows(qkv + t * QKV + heads * D, D, k_norm, f32, kv_heads, D, eps, qkv + t * QKV + heads * D);
    }
  rope(qkv, QKV, T, heads + kv_heads, D, cos, sin, qk);
  specserve_attend(qk, QK, qk + heads * D, QK, qkv + QK, QKV, k, v, head_stride, info, nseq, heads, kv_heads, D,
                   scale, window, softcap, att);
  linear(lin[1], att, T, o, xsum);
  if (norm_attn_out != nullptr) norm_rows(o, H, norm_attn_out, f32, T, H, eps, o);
  residual_add(x, o, T * H);
  if (norm_post != nullptr) norm_rows(x, H, norm_post, f32, T, H, eps, h);
  linear(lin[2], norm_post != nullptr ? h : x, T, gate_up, xsum);
  if (flags & 2)
    specserve_gelu_mul(gate_up, T, I, act);
  else
    specserve_silu_mul(gate_up, T, I, act);
  linear(lin[3], act, T, o, xsum);
  if (norm_mlp_out != nullptr) norm_rows(o, H, norm_mlp_out, f32, T, H, eps, o);
  residual_add(x, o, T * H);
}

// specserve_layer for layers [0, n) in one call (a caller's thread is off its interpreter's lock once a step, not
// once a layer): layer i's norms norm_in[i], norm_post[i], norm_attn_out[i], norm_mlp_out[i], linears
// lin[4i..4i+3], b_qkv[i], q_norm[i] and k_norm[i] (each null where the family has none), sliding window
// window[i], rotary tables cos[i], sin[i], keys and values at k, v + i · layer_stride; flags and softcap as
// specserve_layer's, the same for every layer.
void specserve_layers(uint16_t *x, int64_t T, int64_t H, int64_t n, const void *const *norm_in,
                      const void *const *norm_post, const void *const *norm_attn_out,
                      const void *const *norm_mlp_out, int64_t flags, float eps, const Linear *lin,
                      const uint16_t *const *b_qkv, const void *const *q_norm, const void *const *k_norm,
                      const uint16_t *const *cos, const uint16_t *const *sin, uint16_t *k, uint16_t *v,
                      int64_t layer_stride, int64_t head_stride, const int64_t *info, int64_t nseq, int64_t heads, int64_t kv_heads, int64_t D, float scale,
                      float softcap, const int64_t *window, uint16_t *scratch, float *xsum) {
  for (int64_t i = 0; i < n; i++)
    specserve_layer(x, T, H, norm_in[i], norm_post[i], norm_attn_out[i], norm_mlp_out[i], flags, eps, lin + 4 * i,
                    b_qkv[i], q_norm[i], k_norm[i], cos[i], sin[i], k + i * layer_stride, v + i * layer_stride,
                    head_stride, info, nseq, heads, kv_heads, D, scale, softcap, window[i], scratch, xsum);
}

}  // extern "C"
