// specserve's CPU kernels for a bfloat16 step on AVX-512 CPUs with bfloat16 dot products (models/cpukernels.py
// builds and loads this): weight-only quantized products, attention over the pool's arena, RMS norm. Each row
// of a result is computed the same way whatever else is computed with it, so a verify block's rows equal
// decode steps' bit for bit.
//
// Quantized products (models/quant.py):
// y[m, n] = sum_k x[m, k] * w[n, k] for bfloat16 activations x and int4 or int8 weights w, the weights read
// once for up to 8 rows of x (torch's CPU kernels read them again for every 4 rows). Codes are widened to
// exact bfloat16 values and multiplied with `vdpbf16ps` (two products a lane, summed in float32).
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
#include <vector>

namespace {

constexpr int kMaxRows = 8;

inline __m512 dot2(__m512 acc, __m512i w, const uint16_t *x) {
  int32_t pair;
  memcpy(&pair, x, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
}

inline void store_bf16(uint16_t *out, __m512 v, __mmask16 m = 0xffff) {  // round to nearest even
  _mm256_mask_storeu_epi16(out, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// Rows [0, MR) of x against NT blocks of 16 outputs starting at block nb.
template <int MR, int NT>
void int4_tile(const uint16_t *x, int64_t K, const float *xsum, int64_t groups, int64_t G, const uint8_t *codes,
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
void int8_tile(const uint16_t *x, int64_t K, const int8_t *codes, const float *scales, int64_t nb, uint16_t *out,
               int64_t N) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; m++)
    for (int t = 0; t < NT; t++) acc[m][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    for (int t = 0; t < NT; t++) {
      const int8_t *c = codes + ((nb + t) * (K / 2) + k / 2) * 32;
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

// Tiles a thread takes at a time: threads take work as they come, so one that another process preempts
// holds up the step by at most its current chunk (a static split waits for its whole share).
inline int64_t share(int64_t tiles) {
  const int64_t chunk = tiles / (8 * omp_get_max_threads());
  return chunk > 0 ? chunk : 1;
}

// Blocks per tile: enough independent sums to hide the dot product's latency, few enough to stay in registers.
constexpr int tile_blocks(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

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

inline __mmask16 tail_mask(int64_t n) {  // the first min(n, 16) lanes
  return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

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

inline __m512 load_bf16(const uint16_t *p, __mmask16 m = 0xffff) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// e^x for x <= 0 (x - max of a softmax): range reduction to |r| <= ln2/2, a degree-6 polynomial.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lane j of the result: the sum of v[j]'s 16 lanes (a transpose as it adds: 45 operations for 16 sums).
inline __m512 sum16(const __m512 *v) {
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

// One query row of one head against keys [0, L) (rows of D bfloat16 values, `stride` apart): softmax(q·k ·
// scale) · v into out. D % 32 == 0, D <= 256.
void attend_row(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t stride, int64_t L, int64_t D,
                float scale, uint16_t *out, std::vector<float> &scores) {
  scores.resize(L + 16);
  float *s = scores.data();
  __m512 top16 = _mm512_set1_ps(-INFINITY);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {  // 16 keys' dot products, summed across lanes together
    const int64_t keys = L - t0 < 16 ? L - t0 : 16;
    __m512 dots[16];
    for (int64_t j = 0; j < 16; j++) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; j < keys && c < D; c += 32) {
        __m512i kv = _mm512_loadu_si512((const void *)(k + (t0 + j) * stride + c));
        __m512i qv = _mm512_loadu_si512((const void *)(q + c));
        acc = _mm512_dpbf16_ps(acc, (__m512bh)kv, (__m512bh)qv);
      }
      dots[j] = acc;
    }
    const __mmask16 m = tail_mask(keys);
    const __m512 row = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(s + t0, m, row);
    top16 = _mm512_mask_max_ps(top16, m, top16, row);
  }
  const float top = _mm512_reduce_max_ps(top16);
  __m512 sum = _mm512_setzero_ps(), mx = _mm512_set1_ps(top);
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 m = tail_mask(L - t);
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mx));
    e = _mm512_maskz_mov_ps(m, e);
    _mm512_mask_storeu_ps(s + t, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(sum);
  __m512 acc[16];  // D / 16 <= 16
  const int64_t chunks = D / 16;
  for (int64_t c = 0; c < chunks; c++) acc[c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t++) {
    __m512 p = _mm512_set1_ps(s[t]);
    for (int64_t c = 0; c < chunks; c++) acc[c] = _mm512_fmadd_ps(p, load_bf16(v + t * stride + c * 16), acc[c]);
  }
  for (int64_t c = 0; c < chunks; c++) store_bf16(out + c * 16, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
}


inline __m512 round_bf16(__m512 v) {  // v rounded to bfloat16 (nearest even), kept as float32
  __m512i b = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}

// One linear layer of a fused step: kind 4 (int4 groups) or 8 (int8 rows), in the layout of the mm kernels.
struct Linear {
  int64_t kind;
  const void *codes;
  const void *scales;
  int64_t group;
  int64_t N;
  int64_t K;
};

}  // namespace

extern "C" {

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
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t rows = M - m0 < kMaxRows ? M - m0 : kMaxRows;
    const uint16_t *xm = x + m0 * K;
    const float *sm = xsum + m0 * groups;
    uint16_t *om = out + m0 * N;
    by_rows(rows, [&](auto r) {
      constexpr int MR = decltype(r)::value, NT = tile_blocks(MR);
      over_blocks<NT>(N / 16, [&](int64_t nb) { int4_tile<MR, NT>(xm, K, sm, groups, G, codes, sb, nb, om, N); },
                      [&](int64_t nb) { int4_tile<MR, 1>(xm, K, sm, groups, G, codes, sb, nb, om, N); });
    });
  }
}

// x: bfloat16 [M, K]; codes: N/16 x K/2 x 32 bytes; scales: float [N]; out: bfloat16 [M, N]. N % 16 == 0, K even.
void specserve_int8_mm(const uint16_t *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                       uint16_t *out, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t rows = M - m0 < kMaxRows ? M - m0 : kMaxRows;
    const uint16_t *xm = x + m0 * K;
    uint16_t *om = out + m0 * N;
    by_rows(rows, [&](auto r) {
      constexpr int MR = decltype(r)::value, NT = tile_blocks(MR);
      over_blocks<NT>(N / 16, [&](int64_t nb) { int8_tile<MR, NT>(xm, K, codes, scales, nb, om, N); },
                      [&](int64_t nb) { int8_tile<MR, 1>(xm, K, codes, scales, nb, om, N); });
    });
  }
}

// Attention of short new blocks against one layer of the pool's arena (k, v: [kv_heads, positions, D], head
// `head_stride` elements apart), after writing the blocks' keys and values into it. Sequence j (info[4j..]:
// arena offset of its block, cached length, new tokens, first row in q) has query i see its cache and its new
// tokens up to itself. q: [T, heads, D] rows `q_stride` apart; k_new, v_new: [T, kv_heads, D]; out: [T, heads·D].
void specserve_attend(const uint16_t *q, int64_t q_stride, const uint16_t *k_new, int64_t k_stride,
                      const uint16_t *v_new, int64_t v_stride, uint16_t *k, uint16_t *v, int64_t head_stride,
                      const int64_t *info, int64_t nseq, int64_t heads, int64_t kv_heads, int64_t D, float scale,
                      uint16_t *out) {
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
  const int64_t group = heads / kv_heads, tasks = rows * heads;
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t x = 0; x < tasks; x++) {
      const int64_t j = task[2 * (x / heads)], i = task[2 * (x / heads) + 1], h = x % heads;
      const int64_t base = info[4 * j], start = info[4 * j + 1], row = info[4 * j + 3] + i;
      const int64_t g = h / group;
      attend_row(q + row * q_stride + h * D, k + g * head_stride + base * D, v + g * head_stride + base * D, D,
                 start + i + 1, D, scale, out + row * heads * D + h * D, scores);
    }
  }
}

// weight · bfloat16(x / rms(x)) for rows of x [M, H] (`x_stride` apart): the normalisation in float32, the
// scaling in bfloat16, as `lean._rms`.
void specserve_rms_norm(const uint16_t *x, int64_t x_stride, const uint16_t *weight, int64_t M, int64_t H,
                        float eps, uint16_t *out) {
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; m++) {
    const uint16_t *row = x + m * x_stride;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t c = 0; c < H; c += 16) {
      __m512 a = load_bf16(row + c, tail_mask(H - c));
      ss = _mm512_fmadd_ps(a, a, ss);
    }
    const float r = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps);
    for (int64_t c = 0; c < H; c++) {
      const float y = bf16_to_float(float_to_bf16(bf16_to_float(row[c]) * r));
      out[m * H + c] = float_to_bf16(y * bf16_to_float(weight[c]));
    }
  }
}


// act[t, i] = bfloat16(bfloat16(silu(gate)) · up) for gate_up [T, 2I] (gate first): SiLU in float32.
void specserve_silu_mul(const uint16_t *gate_up, int64_t T, int64_t I, uint16_t *act) {
  for (int64_t t = 0; t < T; t++) {
    const uint16_t *g = gate_up + t * 2 * I, *u = g + I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = tail_mask(I - i);
      __m512 x = load_bf16(g + i, m);
      __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // e^-|x|
      __m512 one = _mm512_set1_ps(1.0f);
      __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
      __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
      __m512 y = _mm512_mul_ps(round_bf16(_mm512_mul_ps(x, sig)), load_bf16(u + i, m));
      store_bf16(act + t * I + i, y, m);
    }
  }
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
        __m512 a = load_bf16(x + d), c = load_bf16(cos + t * D + d), s = load_bf16(sin + t * D + d);
        __m512 r = d < half ? _mm512_sub_ps(_mm512_setzero_ps(), load_bf16(x + d + half)) : load_bf16(x + d - half);
        __m512 y = _mm512_add_ps(round_bf16(_mm512_mul_ps(a, c)), round_bf16(_mm512_mul_ps(r, s)));
        store_bf16(o + d, y);
      }
    }
}

void residual_add(uint16_t *x, const uint16_t *y, int64_t n) {  // x = bfloat16(x + y)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    store_bf16(x + i, _mm512_add_ps(load_bf16(x + i, m), load_bf16(y + i, m)), m);
  }
}

void linear(const Linear &w, const uint16_t *x, int64_t M, uint16_t *out, float *xsum) {
  if (w.kind == 4)
    specserve_int4_mm(x, M, w.K, (const uint8_t *)w.codes, (const uint16_t *)w.scales, w.group, out, w.N, xsum);
  else
    specserve_int8_mm(x, M, w.K, (const int8_t *)w.codes, (const float *)w.scales, out, w.N);
}
}  // namespace

extern "C" {

// One decoder layer over T rows of x [T, H] (updated in place) for sequences whose new blocks all go through
// specserve_attend: the same kernels, in the same order and with the same roundings, as lean._lean_forward's
// per-op path, in one call. lin: qkv, o, gate_up, down. scratch: bfloat16 of T · (2H + 2·QKV + heads·D + 3I)
// (QKV = (heads + 2·kv_heads)·D, I = gate_up's N / 2); xsum: float32 of T · max(K / group).
void specserve_layer(uint16_t *x, int64_t T, int64_t H, const uint16_t *norm_in, const uint16_t *norm_post, float eps,
                     const Linear *lin, const uint16_t *cos, const uint16_t *sin, uint16_t *k, uint16_t *v,
                     int64_t head_stride, const int64_t *info, int64_t nseq, int64_t heads, int64_t kv_heads,
                     int64_t D, float scale, uint16_t *scratch, float *xsum) {
  const int64_t QK = (heads + kv_heads) * D, QKV = QK + kv_heads * D, I = lin[2].N / 2;
  uint16_t *h = scratch, *qkv = h + T * H, *qk = qkv + T * QKV, *att = qk + T * QKV, *o = att + T * heads * D;
  uint16_t *gate_up = o + T * H, *act = gate_up + T * 2 * I;
  specserve_rms_norm(x, H, norm_in, T, H, eps, h);
  linear(lin[0], h, T, qkv, xsum);
  rope(qkv, QKV, T, heads + kv_heads, D, cos, sin, qk);
  specserve_attend(qk, QK, qk + heads * D, QK, qkv + QK, QKV, k, v, head_stride, info, nseq, heads, kv_heads, D,
                   scale, att);
  linear(lin[1], att, T, o, xsum);
  residual_add(x, o, T * H);
  specserve_rms_norm(x, H, norm_post, T, H, eps, h);
  linear(lin[2], h, T, gate_up, xsum);
  specserve_silu_mul(gate_up, T, I, act);
  linear(lin[3], act, T, o, xsum);
  residual_add(x, o, T * H);
}

}  // extern "C"
