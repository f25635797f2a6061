"""Decode attention on CPU in one C++ kernel that reads the paged KV cache where it lies.

The portable path (attention.py) gathers a decode's context out of the cache into an fp32 copy
and runs SDPA over that copy: per cached token and layer it reads the bf16 row, writes it twice
as wide and reads it again, which made most of a compiled single-sequence step's growth with the
context (5.8 us per context token per step on 2 Zen 5 cores). This kernel reads each K and V row
once, in the cache's dtype, by slot, and keeps the softmax in fp32: the context is cut into
chunks that the threads share (any number of sequences and KV heads keeps both cores busy), and
the chunks' partial softmax sums are merged per query head as flash-decoding does.

The kernel is C++ built at start-up with the compiler torch.compile's CPU kernels use (the same
engines need one: compile_decode), for the CPU it runs on (-march=native), and registered as the
operator `kvpilot::paged_decode_attention`, so a compiled graph calls it like an ATen kernel. The
built library is kept in the compile cache root's `kernels/` folder, named by a hash of its
source, torch's version and the CPU's flags, so a node of another CPU type builds its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

OPERATOR = "kvpilot::paged_decode_attention"
# The folder of the compile cache root that holds built libraries, one file per CPU type.
KERNELS = "kernels"
# Context tokens per work item: small enough that one sequence's context splits over the threads,
# large enough that the merge and the per-item buffers stay cheap.
_CHUNK = 128

_SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = CHUNK;
constexpr int64_t kMaxDim = 512;

// The cache rows a step reads are cold (a step streams ~all weights between two reads of a
// layer's KV) and scattered by slot; asking for rows ahead keeps several misses in flight.
constexpr int64_t kPrefetch = 8;

template <typename T>
inline void prefetch_row(const T* src, int64_t n) {
  const char* p = reinterpret_cast<const char*>(src);
  for (int64_t b = 0; b < n * int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
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

template <typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* slots, const int64_t* lengths,
            float* out, int64_t sequences, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width,
            float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t chunks = (width + kChunk - 1) / kChunk;
  const int64_t row = kv_heads * dim;
  const int64_t items = sequences * kv_heads * chunks;
  // Per work item and query head of its KV head: the chunk's max score, its sum of exp(score - max)
  // and the exp-weighted sum of its values.
  std::vector<float> chunk_max(items * group, -std::numeric_limits<float>::infinity());
  std::vector<float> chunk_sum(items * group, 0.f);
  std::vector<float> chunk_acc(items * group * dim, 0.f);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * kChunk);
    std::vector<float> query(group * dim);
    float values[kMaxDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / (kv_heads * chunks), kv = (item / chunks) % kv_heads, chunk = item % chunks;
      const int64_t first = chunk * kChunk, last = std::min(first + kChunk, lengths[seq]), n = last - first;
      if (n <= 0) continue;
      const float* q_heads = q + (seq * heads + kv * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) query[i] = q_heads[i] * scale;
      const int64_t* seq_slots = slots + seq * width + first;
      for (int64_t t = 0; t < n; ++t) {
        if (t + kPrefetch < n) prefetch_row(k_cache + seq_slots[t + kPrefetch] * row + kv * dim, dim);
        load_row(k_cache + seq_slots[t] * row + kv * dim, values, dim);
        for (int64_t g = 0; g < group; ++g) scores[g * kChunk + t] = dot(query.data() + g * dim, values, dim);
      }
      float* maxes = chunk_max.data() + item * group;
      float* sums = chunk_sum.data() + item * group;
      for (int64_t g = 0; g < group; ++g) sums[g] = exp_minus_max(scores.data() + g * kChunk, n, maxes + g);
      float* acc = chunk_acc.data() + item * group * dim;
      for (int64_t t = 0; t < n; ++t) {
        if (t + kPrefetch < n) prefetch_row(v_cache + seq_slots[t + kPrefetch] * row + kv * dim, dim);
        load_row(v_cache + seq_slots[t] * row + kv * dim, values, dim);
        for (int64_t g = 0; g < group; ++g) add_scaled(acc + g * dim, values, scores[g * kChunk + t], dim);
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
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
              slots.size(0) == q.size(0), "slots: [sequences, width] int64");
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
           slots.data_ptr<int64_t>(), length, out.data_ptr<float>(), sequences, heads, kv_heads, dim,
           slots.size(1), static_cast<float>(scale));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "caches: bf16 or fp32");
    attend(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(),
           length, out.data_ptr<float>(), sequences, heads, kv_heads, dim, slots.size(1),
           static_cast<float>(scale));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvpilot, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lengths, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpilot, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
""".replace("CHUNK", str(_CHUNK))

# What ATen's AVX512 vectors use (as inductor requires for its own AVX512 kernels).
_AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})

_loaded = False


def library_name(flags: frozenset[str]) -> str:
    """The built library's file name: its source, torch's version and the CPU's flags decide it."""
    digest = hashlib.sha256("\n".join([_SOURCE, torch.__version__, *sorted(flags)]).encode()).hexdigest()[:16]
    return f"kvpilot_cpu_attention_{digest}"


def load(root: Path | None, cpu_flags: frozenset[str]) -> None:
    """Build the kernel for a CPU of these flags (or take it from `root`) and register its
    operator; raises on failure."""
    global _loaded
    if _loaded:
        return
    name = library_name(cpu_flags)
    cached = root / KERNELS / f"{name}.so" if root is not None else None
    if cached is not None and cached.is_file():
        torch.ops.load_library(str(cached))
        log.info("event=cpu_attention_kernel source=cache path=%s", cached)
    else:
        _build(name, cached, vector_isa(cpu_flags))
    torch.library.register_fake(OPERATOR)(_fake)
    _loaded = True


def vector_isa(cpu_flags: frozenset[str]) -> str | None:
    """The widest of ATen's vector implementations (at::vec) this CPU runs: the one the kernel is
    built with. None: at::vec's portable scalar one."""
    if _AVX512_FLAGS <= cpu_flags:
        return "AVX512"
    if {"avx2", "fma"} <= cpu_flags:
        return "AVX2"
    return None


def _build(name: str, cached: Path | None, isa: str | None) -> None:
    """Build and load the library in a directory of its own; publish it under `cached` by rename,
    so an engine reading the cache finds a whole library or none."""
    from torch.utils.cpp_extension import load_inline  # the build tooling, only when building

    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=cached.parent if cached is not None else None))
    # torch's builder runs `ninja` from PATH: the one pip installed beside this Python comes first.
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        load_inline(
            name,
            cpp_sources=_SOURCE,
            extra_cflags=["-O3", "-march=native", "-fopenmp"]
            + ([f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"] if isa else ["-DCPU_CAPABILITY=DEFAULT"]),
            extra_ldflags=["-fopenmp"],
            build_directory=str(work),
            is_python_module=False,
        )
        log.info("event=cpu_attention_kernel source=built vector_isa=%s", isa or "none")
        if cached is not None:
            os.replace(work / f"{name}.so", cached)
    finally:
        os.environ["PATH"] = path
        shutil.rmtree(work, ignore_errors=True)


def _fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """Attention of one query per sequence over its cached context. q: [sequences, heads, dim]
    fp32; caches [slots, kv_heads, dim]; slots [sequences, width] (padded); lengths [sequences]:
    how many of a row's slots are its context. Returns [sequences, heads, dim] fp32."""
    return torch.ops.kvpilot.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, slots, lengths, q.shape[-1] ** -0.5
    )
