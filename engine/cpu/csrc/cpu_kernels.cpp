// The CPU kernels of engine/cpu/kernels.py (its docstring says what they do and why), built by
// its loader once per ISA level. The constants the Python side shares with them come from it as
// defines (-D), so the two cannot disagree.
#if !defined(KVPILOT_CHUNK) || !defined(KVPILOT_INT4_GROUP_COLUMNS)
#error "build with kvpilot.engine.cpu.kernels.build(), which defines KVPILOT_CHUNK and KVPILOT_INT4_GROUP_COLUMNS"
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = KVPILOT_CHUNK;
constexpr int64_t kMaxDim = 512;

// The cache rows a step reads are cold (a step streams ~all weights between two reads of a
// layer's KV) and scattered by slot; asking for rows ahead keeps several misses in flight.
constexpr int64_t kPrefetch = 8;

template <typename T>
inline void prefetch_row(const T* src, int64_t n) {
  const char* p = reinterpret_cast<const char*>(src);
  for (int64_t b = 0; b < n * int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// A bf16 row widened to fp32.
inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512)
  // at::vec::convert is a scalar loop for bf16 -> fp32: widen 16 at a time (bf16 is fp32's top half).
  for (; d + 16 <= n; d += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; d + 8 <= n; d += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
  }
#endif
  at::vec::convert(src + d, dst + d, n - d);
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

#if defined(CPU_CAPABILITY_AVX512)
// 128-bit lanes (a0 + a1, a2 + a3, b0 + b1, b2 + b3) of a = (a0, a1, a2, a3) and b likewise.
inline __m512 add_lane_pairs(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

// The sums of 16 vectors' lanes as one vector (lane i: the sum of acc[i]), in 45 shuffles and adds
// where 16 horizontal reductions take ~130: pairs are interleaved and added, halving the count.
inline __m512 sum_lanes_16(const __m512* acc) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)
    pairs[i] =
        _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]), _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Each 128-bit lane of quads[i] now holds partial sums of acc[4i..4i+3]; add the four lanes.
  return add_lane_pairs(add_lane_pairs(quads[0], quads[1]), add_lane_pairs(quads[2], quads[3]));
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// The sums of 8 vectors' lanes as one vector (lane i: the sum of acc[i]).
inline __m256 sum_lanes_8(const __m256* acc) {
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0: the sums of acc[0..3] over lanes 0-3, then over lanes 4-7; u1 likewise for acc[4..7].
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// scores[t] = q . keys[t] for n rows of `dim` fp32 keys; a whole vector of keys' dot products per
// lane-sum where the ISA has one.
inline void dots(const float* q, const float* const* keys, int64_t n, int64_t dim, float* scores) {
  int64_t t = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  constexpr int kLanes = Vec::size();
  if (dim % kLanes == 0) {
    for (; t + kLanes <= n; t += kLanes) {
      Vec acc[kLanes];
      for (int i = 0; i < kLanes; ++i) acc[i] = Vec(0.f);
      for (int64_t d = 0; d < dim; d += kLanes) {
        const Vec qd = Vec::loadu(q + d);
        for (int i = 0; i < kLanes; ++i) acc[i] = at::vec::fmadd(qd, Vec::loadu(keys[t + i] + d), acc[i]);
      }
      // A Vec is its one register (at::vec's layout), so the array reads as the ISA's vectors.
#if defined(CPU_CAPABILITY_AVX512)
      static_assert(sizeof(Vec) == sizeof(__m512));
      _mm512_storeu_ps(scores + t, sum_lanes_16(reinterpret_cast<const __m512*>(acc)));
#else
      static_assert(sizeof(Vec) == sizeof(__m256));
      _mm256_storeu_ps(scores + t, sum_lanes_8(reinterpret_cast<const __m256*>(acc)));
#endif
    }
  }
#endif
  for (; t < n; ++t) scores[t] = dot(q, keys[t], dim);
}

// out[d] = sum over t of p[t] * values[t][d], for n rows of `dim` fp32 values: four vectors of
// `out` stay in registers over all rows.
inline void weighted_sum(const float* p, const float* const* values, int64_t n, int64_t dim, float* out) {
  constexpr int64_t kBlock = 4 * Vec::size();
  int64_t d = 0;
  for (; d + kBlock <= dim; d += kBlock) {
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    for (int64_t t = 0; t < n; ++t) {
      const float* v = values[t] + d;
      const Vec w(p[t]);
      a0 = at::vec::fmadd(w, Vec::loadu(v), a0);
      a1 = at::vec::fmadd(w, Vec::loadu(v + Vec::size()), a1);
      a2 = at::vec::fmadd(w, Vec::loadu(v + 2 * Vec::size()), a2);
      a3 = at::vec::fmadd(w, Vec::loadu(v + 3 * Vec::size()), a3);
    }
    a0.store(out + d);
    a1.store(out + d + Vec::size());
    a2.store(out + d + 2 * Vec::size());
    a3.store(out + d + 3 * Vec::size());
  }
  for (; d < dim; ++d) {
    float a = 0.f;
    for (int64_t t = 0; t < n; ++t) a += p[t] * values[t][d];
    out[d] = a;
  }
}

inline void add_scaled(float* acc, const float* x, float p, int64_t n) {
  const Vec scale(p);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    at::vec::fmadd(scale, Vec::loadu(x + d), Vec::loadu(acc + d)).store(acc + d);
  }
  for (; d < n; ++d) acc[d] += p * x[d];
}

// Softmax numerators of n scores in place; returns their max in *max and their sum.
inline float exp_minus_max(float* s, int64_t n, float* max) {
  float m = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
  at::vec::map([m](Vec x) { return (x - Vec(m)).exp_u20(); }, s, s, n);
  *max = m;
  return at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
}

// One KV head's rows of a chunk's slots as fp32: an fp32 cache's own rows (asked for ahead of
// use), another dtype's widened into `rows` (asking for the rows ahead while it widens).
template <typename T>
inline void load_rows(const T* cache, const int64_t* slots, int64_t n, int64_t row, int64_t offset, int64_t dim,
                      float* rows, const float** pointers) {
  for (int64_t t = 0; t < n; ++t) {
    const T* source = cache + slots[t] * row + offset;
    if constexpr (std::is_same_v<T, float>) {
      prefetch_row(source, dim);
      pointers[t] = source;
    } else {
      if (t + kPrefetch < n) prefetch_row(cache + slots[t + kPrefetch] * row + offset, dim);
      load_row(source, rows + t * dim, dim);
      pointers[t] = rows + t * dim;
    }
  }
}

// Context tokens per work item: the longest chunk (kChunk) unless that leaves the threads fewer
// than four items each (a short context's few KV heads would leave a core idle).
inline int64_t chunk_length(int64_t sequences, int64_t kv_heads, int64_t width) {
  const int64_t wanted = 4 * at::get_num_threads();
  int64_t chunk = kChunk;
  while (chunk > 32 && sequences * kv_heads * ((width + chunk - 1) / chunk) < wanted) chunk /= 2;
  return chunk;
}

template <typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* slots, const int64_t* lengths,
            float* out, int64_t sequences, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t chunk_len = chunk_length(sequences, kv_heads, width);
  const int64_t chunks = (width + chunk_len - 1) / chunk_len;
  const int64_t row = kv_heads * dim;
  const int64_t items = sequences * kv_heads * chunks;
  // Per (sequence, KV head, chunk) and query head of its KV head: the chunk's max score, its sum of
  // exp(score - max) and the exp-weighted sum of its values.
  std::vector<float> chunk_max(items * group, -std::numeric_limits<float>::infinity());
  std::vector<float> chunk_sum(items * group, 0.f);
  std::vector<float> chunk_acc(items * group * dim, 0.f);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * chunk_len);
    std::vector<float> query(group * dim);
    std::vector<float> rows(chunk_len * dim);
    std::vector<const float*> pointers(chunk_len);
    for (int64_t item = begin; item < end; ++item) {
      // A thread's run of items walks a chunk's KV heads side by side, so it reads whole cache
      // rows of adjacent slots, not one head's slice of every slot (0.89-0.93x the time from 600
      // tokens of context, cold, on a Zen 3; equal below). Results are kept per (kv, chunk).
      const int64_t seq = item / (kv_heads * chunks), chunk = (item / kv_heads) % chunks, kv = item % kv_heads;
      const int64_t stored = (seq * kv_heads + kv) * chunks + chunk;
      const int64_t first = chunk * chunk_len, last = std::min(first + chunk_len, lengths[seq]), n = last - first;
      if (n <= 0) continue;
      const float* q_heads = q + (seq * heads + kv * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) query[i] = q_heads[i] * scale;
      const int64_t* seq_slots = slots + seq * width + first;
      if constexpr (std::is_same_v<T, float>) {
        // The chunk's values too, so that their misses overlap the scores' work.
        for (int64_t t = 0; t < n; ++t) prefetch_row(v_cache + seq_slots[t] * row + kv * dim, dim);
      }
      load_rows(k_cache, seq_slots, n, row, kv * dim, dim, rows.data(), pointers.data());
      float* maxes = chunk_max.data() + stored * group;
      float* sums = chunk_sum.data() + stored * group;
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * chunk_len;
        dots(query.data() + g * dim, pointers.data(), n, dim, s);
        sums[g] = exp_minus_max(s, n, maxes + g);
      }
      load_rows(v_cache, seq_slots, n, row, kv * dim, dim, rows.data(), pointers.data());
      float* acc = chunk_acc.data() + stored * group * dim;
      for (int64_t g = 0; g < group; ++g) {
        weighted_sum(scores.data() + g * chunk_len, pointers.data(), n, dim, acc + g * dim);
      }
    }
  });
  for (int64_t seq = 0; seq < sequences; ++seq) {
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      const int64_t base = (seq * kv_heads + kv) * chunks;
      for (int64_t g = 0; g < group; ++g) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) m = std::max(m, chunk_max[(base + c) * group + g]);
        float* o = out + (seq * heads + kv * group + g) * dim;
        std::fill(o, o + dim, 0.f);
        float total = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t at = (base + c) * group + g;
          if (chunk_sum[at] == 0.f) continue;
          const float w = std::exp(chunk_max[at] - m);
          total += chunk_sum[at] * w;
          add_scaled(o, chunk_acc.data() + at * dim, w, dim);
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
      }
    }
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& slots, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [sequences, heads, dim] fp32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches: [slots, kv_heads, dim], one dtype");
  TORCH_CHECK(
      slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == q.size(0),
      "slots: [sequences, width] int64");
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong && lengths.size(0) == q.size(0),
              "lengths: [sequences] int64");
  const int64_t sequences = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && dim <= kMaxDim && heads % kv_heads == 0, "head shapes do not match");
  auto out = at::empty_like(q);
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t s = 0; s < sequences; ++s)
    TORCH_CHECK(length[s] >= 1 && length[s] <= slots.size(1), "a length is outside 1..width");
  if (k_cache.scalar_type() == at::kBFloat16) {
    attend(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
           slots.data_ptr<int64_t>(), length, out.data_ptr<float>(), sequences, heads, kv_heads, dim, slots.size(1),
           static_cast<float>(scale));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "caches: bf16 or fp32");
    attend(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(), length,
           out.data_ptr<float>(), sequences, heads, kv_heads, dim, slots.size(1), static_cast<float>(scale));
  }
  return out;
}

// Weight-only INT4 and INT8 matmuls for the few tokens of a decode step: what PyTorch's packed kernels
// compute, from the same buffers, at the machine's memory bandwidth where those reach about half of it
// (bench/history/2026-12-02-serving-cpu-decode.md, "Matmuls in C++").

#if defined(__AVX512BF16__)
// PyTorch's CPU int4 layout: per block of 64 output rows, byte [k, r] holds row r (low nibble)
// and row r + 32 (high nibble) of column k, so two columns of a block are two 32-byte loads.
constexpr int64_t kInt4Rows = 64;

// Lane i of accumulator a holds output row int4_row(a, i) of the block: the unpacks that pair
// columns k and k + 1 for the bf16 dot products interleave rows within 128-bit lanes.
inline int64_t int4_row(int a, int i) { return 8 * (i / 4) + i % 4 + 4 * (a & 1) + 32 * (a >> 1); }

// One block's 64 outputs for M tokens, summed over the groups: per group, the exact products
// (q - 8) * x (bf16 holds every q - 8 and x exactly; the dot products add in fp32) scaled by the
// group's scale, plus its zero times the sum of x over the group.
template <int M>
void int4_block(const uint8_t* packed, const uint16_t* x, const float* xsum, const uint32_t* scales_zeros, int64_t K,
                int64_t N, int64_t group, float* out) {
  // bf16 of q - 8 for q = 0..15, indexed by q (twice: the permute reads 32 lanes).
  const __m512i as_bf16 =
      _mm512_set_epi16(0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, -0x4080, -0x4000, -0x3fc0,
                       -0x3f80, -0x3f60, -0x3f40, -0x3f20, -0x3f00, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000,
                       0x3f80, 0x0000, -0x4080, -0x4000, -0x3fc0, -0x3f80, -0x3f60, -0x3f40, -0x3f20, -0x3f00);
  const __m512i nibble = _mm512_set1_epi16(0xF);
  const __m512i even = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i odd = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t groups = K / group;
  std::fill(out, out + M * kInt4Rows, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < 4; ++a) acc[m][a] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
      const __m256i* columns = reinterpret_cast<const __m256i*>(packed + k * 32);
      const __m512i c0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(columns));
      const __m512i c1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(columns + 1));
      const __m512i lo0 = _mm512_permutexvar_epi16(_mm512_and_si512(c0, nibble), as_bf16);
      const __m512i lo1 = _mm512_permutexvar_epi16(_mm512_and_si512(c1, nibble), as_bf16);
      const __m512i hi0 = _mm512_permutexvar_epi16(_mm512_srli_epi16(c0, 4), as_bf16);
      const __m512i hi1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(c1, 4), as_bf16);
      const __m512bh w[4] = {(__m512bh)_mm512_unpacklo_epi16(lo0, lo1), (__m512bh)_mm512_unpackhi_epi16(lo0, lo1),
                             (__m512bh)_mm512_unpacklo_epi16(hi0, hi1), (__m512bh)_mm512_unpackhi_epi16(hi0, hi1)};
      for (int m = 0; m < M; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * K + k, sizeof(pair));
        const __m512bh xk = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int a = 0; a < 4; ++a) acc[m][a] = _mm512_dpbf16_ps(acc[m][a], w[a], xk);
      }
    }
    // The block's (scale, zero) bf16 pairs for this group, gathered into the accumulators' order.
    const uint32_t* pairs = scales_zeros + g * N;
    const __m512i p0 = _mm512_loadu_si512(pairs), p1 = _mm512_loadu_si512(pairs + 16);
    const __m512i p2 = _mm512_loadu_si512(pairs + 32), p3 = _mm512_loadu_si512(pairs + 48);
    const __m512i sz[4] = {_mm512_permutex2var_epi32(p0, even, p1), _mm512_permutex2var_epi32(p0, odd, p1),
                           _mm512_permutex2var_epi32(p2, even, p3), _mm512_permutex2var_epi32(p2, odd, p3)};
    for (int a = 0; a < 4; ++a) {
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(sz[a], 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(sz[a], high));
      for (int m = 0; m < M; ++m) {
        float* o = out + m * kInt4Rows + a * 16;
        const __m512 y = _mm512_fmadd_ps(scale, acc[m][a], _mm512_loadu_ps(o));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[m * groups + g]), y));
      }
    }
  }
}

template <int M>
void int4_tokens(const uint8_t* packed, const uint16_t* x, const float* xsum, const uint32_t* scales_zeros,
                 at::BFloat16* y, int64_t K, int64_t N, int64_t group) {
  at::parallel_for(0, N / kInt4Rows, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[M * kInt4Rows];
    for (int64_t b = begin; b < end; ++b) {
      int4_block<M>(packed + b * kInt4Rows * K / 2, x, xsum, scales_zeros + b * kInt4Rows, K, N, group, out);
      for (int m = 0; m < M; ++m)
        for (int a = 0; a < 4; ++a)
          for (int i = 0; i < 16; ++i) y[m * N + b * kInt4Rows + int4_row(a, i)] = out[m * kInt4Rows + a * 16 + i];
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Without bf16 dot products: integer products, as llama.cpp's Q4 x Q8 multiplies, but exact to
// well under bf16's rounding. Each token's group of input columns becomes 16-bit integers by its
// largest magnitude (|x| <= 127 x 256, a step of 2^-15 of that magnitude, where bf16 rounds each
// value by up to 2^-9 of itself) split into two int8 halves, x = 256 high + low; q x high and
// q x low add exactly in integers (maddubs: 16 rows x 2 columns per instruction) and each group's
// sum is scaled back in fp32: scale x step x sum((q - 8) x) + zero x sum(x). Of PyTorch's layout
// (Rows 32 or 64 per block), a column's Rows / 2 bytes are chunks of 16: byte i of chunk c holds
// rows 16 c + i (low nibble) and Rows / 2 + 16 c + i (high); two columns' chunks interleaved byte
// by byte put each row's pair of values side by side.
struct Int16Activations {
  std::vector<int8_t> high, low;     // [tokens, in]
  std::vector<float> step, sum;      // [tokens, groups]: the integers' unit; sum(x) in fp32
  std::vector<int32_t> integer_sum;  // [tokens, groups]: sum of the 16-bit integers
};

// Eight bf16 as fp32 (bf16 is fp32's top half).
inline __m256 bf16x8(const at::BFloat16* x) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float lanes_sum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// Vectorized: a decode step makes ~120 of these calls, each on a few hundred inputs.
inline Int16Activations int16_activations(const at::BFloat16* x, int64_t tokens, int64_t K, int64_t group) {
  constexpr float kLargest = 127.f * 256.f;
  const int64_t groups = K / group, whole = group / 8 * 8;
  Int16Activations a{std::vector<int8_t>(tokens * K), std::vector<int8_t>(tokens * K),
                     std::vector<float>(tokens * groups), std::vector<float>(tokens * groups),
                     std::vector<int32_t>(tokens * groups)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t i = 0; i < tokens * groups; ++i) {
    const at::BFloat16* xg = x + i * group;
    __m256 largest8 = _mm256_setzero_ps(), sum8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < whole; j += 8) {
      const __m256 v = bf16x8(xg + j);
      largest8 = _mm256_max_ps(largest8, _mm256_and_ps(v, magnitude));
      sum8 = _mm256_add_ps(sum8, v);
    }
    float largest = lanes_max(largest8), sum = lanes_sum(sum8);
    for (int64_t j = whole; j < group; ++j) {
      largest = std::max(largest, std::abs(float(xg[j])));
      sum += float(xg[j]);
    }
    a.step[i] = largest / kLargest;
    a.sum[i] = sum;
    const float inverse = largest > 0.f ? kLargest / largest : 0.f;
    int8_t* high = a.high.data() + i * group;
    int8_t* low = a.low.data() + i * group;
    __m256i sum_v = _mm256_setzero_si256();
    for (int64_t j = 0; j < whole; j += 8) {
      // Rounded to nearest, ties to even (the default rounding mode), as lrintf below.
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(bf16x8(xg + j), _mm256_set1_ps(inverse)));
      const __m256i h = _mm256_srai_epi32(_mm256_add_epi32(v, _mm256_set1_epi32(128)), 8);  // -127..127
      const __m256i l = _mm256_sub_epi32(v, _mm256_slli_epi32(h, 8));                       // -128..127
      sum_v = _mm256_add_epi32(sum_v, v);
      alignas(32) int32_t hs[8], ls[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(hs), h);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ls), l);
      for (int t = 0; t < 8; ++t) {
        high[j + t] = static_cast<int8_t>(hs[t]);
        low[j + t] = static_cast<int8_t>(ls[t]);
      }
    }
    alignas(32) int32_t sums[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), sum_v);
    int32_t integer_sum = sums[0] + sums[1] + sums[2] + sums[3] + sums[4] + sums[5] + sums[6] + sums[7];
    for (int64_t j = whole; j < group; ++j) {
      const int32_t v = static_cast<int32_t>(std::lrintf(float(xg[j]) * inverse));
      high[j] = static_cast<int8_t>((v + 128) >> 8);
      low[j] = static_cast<int8_t>(v - 256 * ((v + 128) >> 8));
      integer_sum += v;
    }
    a.integer_sum[i] = integer_sum;
  }
  return a;
}

// The inputs a step multiplies, as int4_block_int16 pairs them: for 64-row blocks both lanes
// take columns (k, k + 1); for 32-row blocks lane 0 takes (k, k + 2) and lane 1 (k + 1, k + 3).
template <int Rows>
inline __m256i step_inputs(const int8_t* x) {
  if constexpr (Rows == 64) {
    int16_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return _mm256_set1_epi16(pair);
  } else {
    int32_t quad;
    std::memcpy(&quad, x, sizeof(quad));
    const __m256i spread = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,  //
                                            1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
    return _mm256_shuffle_epi8(_mm256_set1_epi32(quad), spread);
  }
}

// Each step multiplies 64 bytes of weights, two 256-bit loads a and b, whose in-lane byte
// unpacks put each row's pair of values side by side with no lane crossing. 64-row blocks: a and
// b are columns k and k + 1, so lane 0 of the unpacks holds chunk 0's rows and lane 1 chunk 1's:
// low nibbles of the low unpack are rows 0-7 | 16-23, of the high one 8-15 | 24-31, high nibbles 32
// rows on. 32-row blocks: a holds columns k, k + 1 and b k + 2, k + 3, so both lanes hold rows
// 0-7 (low unpack) and 8-15 (high), high nibbles 16 rows on, of different columns: the lanes add.
// The small loops are unrolled whole so that every accumulator stays in a register (3-7 % faster
// at 32 rows than GCC's own choice).
template <int Rows, int M>
void int4_block_int16(const uint8_t* block, const int8_t* high, const int8_t* low, const float* step,
                      const int32_t* integer_sum, const float* xsum, const uint32_t* scales_zeros, int64_t K, int64_t N,
                      int64_t group, float* out) {
  static_assert(Rows == 32 || Rows == 64);
  constexpr int kColumns = 128 / Rows;  // per step
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i top_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t groups = K / group;
  std::fill(out, out + M * Rows, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * group, last = first + group;
    // Per token, the group's sums for rows 8 a .. 8 a + 7, of the high halves and of the low ones.
    __m256i sums_high[M][Rows / 8], sums_low[M][Rows / 8];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int a = 0; a < Rows / 8; ++a) sums_high[m][a] = sums_low[m][a] = _mm256_setzero_si256();
    // 8 steps at a time: at most 8 pairs per int16 lane, 8 x 2 x 15 x 128 < 2^15.
    for (int64_t k0 = first; k0 < last; k0 += 8 * kColumns) {
      __m256i part_high[M][4], part_low[M][4];
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
        for (int p = 0; p < 4; ++p) part_high[m][p] = part_low[m][p] = _mm256_setzero_si256();
#pragma GCC unroll 16
      for (int64_t k = k0; k < k0 + 8 * kColumns; k += kColumns) {
        const uint8_t* at = block + k * Rows / 2;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32));
        const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
        const __m256i w[4] = {_mm256_and_si256(lo, nibble), _mm256_and_si256(hi, nibble),
                              _mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble),
                              _mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble)};
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          const __m256i xh = step_inputs<Rows>(high + m * K + k), xl = step_inputs<Rows>(low + m * K + k);
#pragma GCC unroll 16
          for (int p = 0; p < 4; ++p) {
            part_high[m][p] = _mm256_add_epi16(part_high[m][p], _mm256_maddubs_epi16(w[p], xh));
            part_low[m][p] = _mm256_add_epi16(part_low[m][p], _mm256_maddubs_epi16(w[p], xl));
          }
        }
      }
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
        for (int p = 0; p < 4; ++p) {
          auto widen = [&](__m256i part, __m256i* sums) {
            const __m128i lane0 = _mm256_castsi256_si128(part), lane1 = _mm256_extracti128_si256(part, 1);
            if constexpr (Rows == 64) {
              const int a = 4 * (p >> 1) + (p & 1);
              sums[a] = _mm256_add_epi32(sums[a], _mm256_cvtepi16_epi32(lane0));
              sums[a + 2] = _mm256_add_epi32(sums[a + 2], _mm256_cvtepi16_epi32(lane1));
            } else {
              sums[p] = _mm256_add_epi32(sums[p], _mm256_cvtepi16_epi32(lane0));
              sums[p] = _mm256_add_epi32(sums[p], _mm256_cvtepi16_epi32(lane1));
            }
          };
          widen(part_high[m][p], sums_high[m]);
          widen(part_low[m][p], sums_low[m]);
        }
    }
    const uint32_t* pairs = scales_zeros + g * N;
#pragma GCC unroll 16
    for (int a = 0; a < Rows / 8; ++a) {
      const __m256i sz = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 8 * a));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(sz, 16));
      const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(sz, top_half));
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const int64_t at = m * groups + g;
        // sum((q - 8) v) = 256 sum(q high) + sum(q low) - 8 sum(v): below 2^31 for groups up to 2^10.
        const __m256i whole = _mm256_add_epi32(_mm256_slli_epi32(sums_high[m][a], 8), sums_low[m][a]);
        const __m256i products = _mm256_sub_epi32(whole, _mm256_set1_epi32(8 * integer_sum[at]));
        const __m256 y = _mm256_fmadd_ps(zero, _mm256_set1_ps(xsum[at]), _mm256_loadu_ps(out + m * Rows + 8 * a));
        const __m256 unit = _mm256_mul_ps(scale, _mm256_set1_ps(step[at]));
        _mm256_storeu_ps(out + m * Rows + 8 * a, _mm256_fmadd_ps(unit, _mm256_cvtepi32_ps(products), y));
      }
    }
  }
}

template <int Rows>
void int4_mm_int16(const Int16Activations& x, const uint8_t* packed, const uint32_t* scales_zeros, at::BFloat16* y,
                   int64_t M, int64_t K, int64_t N, int64_t group) {
  const int64_t groups = K / group;
  at::parallel_for(0, N / Rows, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[2 * Rows];
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = packed + b * Rows * K / 2;
      const uint32_t* sz = scales_zeros + b * Rows;
      // Tokens in pairs (registers hold two tokens' sums), each over the block's weights while
      // they are in cache.
      for (int64_t m = 0; m < M; m += 2) {
        const int64_t tile = std::min<int64_t>(2, M - m), at = m * groups;
        const int8_t *high = x.high.data() + m * K, *low = x.low.data() + m * K;
        if (tile == 2) {
          int4_block_int16<Rows, 2>(block, high, low, x.step.data() + at, x.integer_sum.data() + at, x.sum.data() + at,
                                    sz, K, N, group, out);
        } else {
          int4_block_int16<Rows, 1>(block, high, low, x.step.data() + at, x.integer_sum.data() + at, x.sum.data() + at,
                                    sz, K, N, group, out);
        }
        for (int64_t t = 0; t < tile; ++t)
          for (int r = 0; r < Rows; ++r) y[(m + t) * N + b * Rows + r] = out[t * Rows + r];
      }
    }
  });
}
#endif

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros,
                   int64_t rows) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: [tokens, in] bf16");
  TORCH_CHECK(rows == 32 || rows == 64, "rows: PyTorch's CPU int4 layout's block of 32 or 64 rows");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  group % KVPILOT_INT4_GROUP_COLUMNS == 0 && K % group == 0 && scales_zeros.size(0) == K / group &&
                  scales_zeros.size(2) == 2,
              "scales_zeros: [in / group, out, 2] bf16, for a group of a multiple of ", KVPILOT_INT4_GROUP_COLUMNS,
              " columns that divides in");
  const int64_t N = scales_zeros.size(1), groups = K / group;
  TORCH_CHECK(
      packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() * 2 == N * K && N % rows == 0,
      "packed: PyTorch's CPU int4 layout of [out, in], out a multiple of its block");
  TORCH_CHECK(group <= 1024, "group: at most 1024 columns (the integer sums' range)");
  auto y = at::empty({M, N}, x.options());
  const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint32_t* sz = reinterpret_cast<const uint32_t*>(scales_zeros.data_ptr<at::BFloat16>());
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
#if defined(__AVX512BF16__)
  if (rows == 64) {
    std::vector<float> xsum(M * groups);
    for (int64_t i = 0; i < M * groups; ++i)
      for (int64_t j = 0; j < group; ++j) xsum[i] += float(xb[i * group + j]);
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(xb);
    // Tokens in tiles of up to four: each decode of the weights serves a tile.
    for (int64_t m = 0; m < M; m += 4) {
      const float* s = xsum.data() + m * groups;
      at::BFloat16* o = out + m * N;
      switch (std::min<int64_t>(4, M - m)) {
        case 4:
          int4_tokens<4>(w, xs + m * K, s, sz, o, K, N, group);
          break;
        case 3:
          int4_tokens<3>(w, xs + m * K, s, sz, o, K, N, group);
          break;
        case 2:
          int4_tokens<2>(w, xs + m * K, s, sz, o, K, N, group);
          break;
        default:
          int4_tokens<1>(w, xs + m * K, s, sz, o, K, N, group);
      }
    }
    return y;
  }
#endif
  const Int16Activations activations = int16_activations(xb, M, K, group);
  if (rows == 32) {
    int4_mm_int16<32>(activations, w, sz, out, M, K, N, group);
  } else {
    int4_mm_int16<64>(activations, w, sz, out, M, K, N, group);
  }
  return y;
#else
  TORCH_CHECK(false, "kvpilot::int4_mm needs AVX2 and FMA, which this library was not built for");
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// y[m, n] = scale[n] * sum_k w[n, k] x[m, k]: int8 exact in fp32, products and sums in fp32.
template <int M>
void int8_rows(const int8_t* w, const float* x, const at::BFloat16* scales, at::BFloat16* y, int64_t K, int64_t N,
               int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = w + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
      const __m512 wk = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wk, _mm512_loadu_ps(x + m * K + k), acc[m]);
    }
    const float scale = float(scales[n]);
    for (int m = 0; m < M; ++m) {
      float sum = _mm512_reduce_add_ps(acc[m]);
      for (int64_t j = k; j < K; ++j) sum += float(row[j]) * x[m * K + j];
      y[m * N + n] = sum * scale;
    }
  }
}

template <int M>
void int8_tokens(const int8_t* w, const float* x, const at::BFloat16* scales, at::BFloat16* y, int64_t K, int64_t N) {
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) { int8_rows<M>(w, x, scales, y, K, N, begin, end); });
}
#elif defined(CPU_CAPABILITY_AVX2)
// With AVX2 only, integer products as int4_mm's, of signed weights: each token's block of 32
// inputs as 16-bit integers (|v| <= 127 x 255, a step of 2^-15 of the block's largest input)
// split as v = 255 high + low with both halves in -127..127, so that maddubs can take |w| and the
// halves with w's sign; the pairs' sums (< 2^15) add in int32.
constexpr int64_t kInt8Block = 32;

struct Int8Activations {
  std::vector<int8_t> high, low;  // [tokens, blocks x 32]
  std::vector<float> step;        // [tokens, blocks]
};

inline Int8Activations int8_activations(const float* x, int64_t tokens, int64_t K) {
  constexpr float kLargest = 127.f * 255.f;
  const int64_t blocks = K / kInt8Block, width = blocks * kInt8Block;
  Int8Activations a{std::vector<int8_t>(tokens * width), std::vector<int8_t>(tokens * width),
                    std::vector<float>(tokens * blocks)};
  for (int64_t m = 0; m < tokens; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * kInt8Block;
      float largest = 0.f;
      for (int64_t j = 0; j < kInt8Block; ++j) largest = std::max(largest, std::abs(xb[j]));
      a.step[m * blocks + b] = largest / kLargest;
      const float inverse = largest > 0.f ? kLargest / largest : 0.f;
      for (int64_t j = 0; j < kInt8Block; ++j) {
        const int32_t v = static_cast<int32_t>(std::lrintf(xb[j] * inverse));
        const int32_t high = static_cast<int32_t>(std::lrintf(static_cast<float>(v) / 255.f));
        a.high[m * width + b * kInt8Block + j] = static_cast<int8_t>(high);
        a.low[m * width + b * kInt8Block + j] = static_cast<int8_t>(v - 255 * high);
      }
    }
  return a;
}

template <int M>
void int8_rows(const int8_t* w, const float* x, const Int8Activations& a, const at::BFloat16* scales, at::BFloat16* y,
               int64_t K, int64_t N, int64_t begin, int64_t end) {
  const int64_t blocks = K / kInt8Block, width = blocks * kInt8Block;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = w + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256i wk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kInt8Block));
      const __m256i magnitude = _mm256_abs_epi8(wk);
      for (int m = 0; m < M; ++m) {
        const int64_t at = m * width + b * kInt8Block;
        const __m256i high = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.high[at])), wk);
        const __m256i low = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.low[at])), wk);
        const __m256i sum_high = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, high), ones);
        const __m256i sum_low = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, low), ones);
        const __m256i whole = _mm256_add_epi32(_mm256_mullo_epi32(sum_high, _mm256_set1_epi32(255)), sum_low);
        acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(a.step[m * blocks + b]), _mm256_cvtepi32_ps(whole), acc[m]);
      }
    }
    const float scale = float(scales[n]);
    for (int m = 0; m < M; ++m) {
      float sum = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, Vec(acc[m]));
      for (int64_t j = width; j < K; ++j) sum += float(row[j]) * x[m * K + j];
      y[m * N + n] = sum * scale;
    }
  }
}

template <int M>
void int8_tokens(const int8_t* w, const float* x, const at::BFloat16* scales, at::BFloat16* y, int64_t K, int64_t N) {
  const Int8Activations a = int8_activations(x, M, K);
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) { int8_rows<M>(w, x, a, scales, y, K, N, begin, end); });
}
#endif

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [tokens, in] bf16");
  TORCH_CHECK(
      weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.size(1) == x.size(1),
      "weight: [out, in] int8");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kBFloat16 && scales.size(0) == weight.size(0),
              "scales: [out] bf16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = at::empty({M, N}, x.options());
  const auto xf = x.to(at::kFloat).contiguous();
  const int8_t* w = weight.data_ptr<int8_t>();
  const at::BFloat16* s = scales.data_ptr<at::BFloat16>();
  // Tokens in tiles of up to eight: each pass over the weight serves a tile.
  for (int64_t m = 0; m < M; m += 8) {
    const float* xm = xf.data_ptr<float>() + m * K;
    at::BFloat16* out = y.data_ptr<at::BFloat16>() + m * N;
    switch (std::min<int64_t>(8, M - m)) {
      case 8:
        int8_tokens<8>(w, xm, s, out, K, N);
        break;
      case 7:
        int8_tokens<7>(w, xm, s, out, K, N);
        break;
      case 6:
        int8_tokens<6>(w, xm, s, out, K, N);
        break;
      case 5:
        int8_tokens<5>(w, xm, s, out, K, N);
        break;
      case 4:
        int8_tokens<4>(w, xm, s, out, K, N);
        break;
      case 3:
        int8_tokens<3>(w, xm, s, out, K, N);
        break;
      case 2:
        int8_tokens<2>(w, xm, s, out, K, N);
        break;
      default:
        int8_tokens<1>(w, xm, s, out, K, N);
    }
  }
  return y;
#else
  TORCH_CHECK(false, "kvpilot::int8_mm needs AVX2 or AVX512 vectors, which this library was not built for");
#endif
}

}  // namespace

TORCH_LIBRARY(kvpilot, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lengths, "
      "float scale) -> Tensor");
  m.def("int4_mm(Tensor x, Tensor packed, int group, Tensor scales_zeros, int rows) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor weight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpilot, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
}
