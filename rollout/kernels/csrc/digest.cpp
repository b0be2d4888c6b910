// A 64-bit digest of a weight's bytes, read at memory bandwidth: rollout/kernels/native_linear.py keeps
// a weight's packed panels across calls while the weight's digest is unchanged (a weight can be
// written without moving its version counter, e.g. through ``.data``, so only its bytes tell).
//
// The bytes run in chunks of kChunk (the last one shorter); each chunk is hashed by its own
// thread in 256-byte steps. Where the CPU has VAES (AES rounds on 512-bit registers), the step
// is 16 lanes of 128 bits: lane i takes blocks i, i + 16, ..., as h = AESENC(h ^ w, key), one
// AES round, a permutation of its 128 bits, so one-to-one in w for a given h. Elsewhere it is 32
// lanes of 64 bits (4 x 8 lanes with AVX-512, or plain C++): lane i takes words i, i + 32, ...,
// as h = ((h ^ w) * kMul) ^ (h >> 29), also one-to-one in w for a given h. Either way any change
// of one word changes its lane and the digest; several changes collide only by chance (about
// 2^-64), not for a structured reason such as two swapped values or a constant added everywhere.
// The AES step runs at the rate memory is read (538 MB in 21 ms on 2 cores of an Intel Xeon, as
// a plain sum; the multiply step 30 ms). The chunks' digests are folded in order with the
// length: the result does not depend on the thread count. Digests are compared only within a
// process (native_linear's stamps), so the two steps need not agree.

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512DQ__) || defined(__VAES__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 1 << 20;  // bytes per work unit
constexpr int kWays = 32;  // 64-bit lanes per chunk
constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;  // odd: multiplying by it is one-to-one
constexpr uint64_t kSeed = 0x243F6A8885A308D3ull;

inline uint64_t step(uint64_t h, uint64_t w) {
  h = (h ^ w) * kMul;
  return h ^ (h >> 29);
}

inline uint64_t finish(uint64_t h) {  // a full-avalanche mix of one lane
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 33);
}

uint64_t chunk_digest(const unsigned char* p, int64_t n) {
  uint64_t lanes[kWays];
  for (int i = 0; i < kWays; ++i) lanes[i] = kSeed + static_cast<uint64_t>(i);
  const int64_t whole = n / (8 * kWays) * (8 * kWays);
#if defined(__VAES__) && defined(__AVX512F__)
  __m512i acc[4];
  for (int j = 0; j < 4; ++j) acc[j] = _mm512_loadu_si512(lanes + 8 * j);
  const __m512i key = _mm512_set1_epi64(static_cast<long long>(kMul));
  for (int64_t o = 0; o < whole; o += 8 * kWays)
    for (int j = 0; j < 4; ++j)
      acc[j] = _mm512_aesenc_epi128(_mm512_xor_si512(acc[j], _mm512_loadu_si512(p + o + 64 * j)), key);
  for (int j = 0; j < 4; ++j) _mm512_storeu_si512(lanes + 8 * j, acc[j]);
#elif defined(__AVX512DQ__)
  __m512i acc[4];
  for (int j = 0; j < 4; ++j) acc[j] = _mm512_loadu_si512(lanes + 8 * j);
  const __m512i mul = _mm512_set1_epi64(static_cast<long long>(kMul));
  for (int64_t o = 0; o < whole; o += 8 * kWays) {
    for (int j = 0; j < 4; ++j) {
      const __m512i w = _mm512_loadu_si512(p + o + 64 * j);
      const __m512i h = _mm512_mullo_epi64(_mm512_xor_si512(acc[j], w), mul);
      acc[j] = _mm512_xor_si512(h, _mm512_srli_epi64(h, 29));
    }
  }
  for (int j = 0; j < 4; ++j) _mm512_storeu_si512(lanes + 8 * j, acc[j]);
#else
  for (int64_t o = 0; o < whole; o += 8 * kWays)
    for (int i = 0; i < kWays; ++i) {
      uint64_t w;
      std::memcpy(&w, p + o + 8 * i, 8);
      lanes[i] = step(lanes[i], w);
    }
#endif
  uint64_t h = kSeed ^ static_cast<uint64_t>(n);
  for (int i = 0; i < kWays; ++i) h = step(h, finish(lanes[i]));
  for (int64_t o = whole; o < n; ++o) h = step(h, p[o]);  // the tail, a byte at a time
  return finish(h);
}

}  // namespace

extern "C" {

// out[i] = the digest of the bytes[i] bytes at data[i] (see the top of the file), the chunks of
// all n buffers shared out among the threads in one parallel region (a region per buffer costs
// more than a small buffer's bytes).
void hr_digest_many(const void* const* data, const int64_t* bytes, int64_t n, uint64_t* out) {
  std::vector<int64_t> first(n + 1, 0);  // buffer i's chunks are [first[i], first[i + 1])
  for (int64_t i = 0; i < n; ++i) first[i + 1] = first[i] + (bytes[i] + kChunk - 1) / kChunk;
  std::vector<uint64_t> parts(first[n]);
  std::vector<int64_t> owner(first[n]);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = first[i]; c < first[i + 1]; ++c) owner[c] = i;
  at::parallel_for(0, first[n], 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t i = owner[c], start = (c - first[i]) * kChunk;
      const auto* p = static_cast<const unsigned char*>(data[i]);
      parts[c] = chunk_digest(p + start, bytes[i] - start < kChunk ? bytes[i] - start : kChunk);
    }
  });
  for (int64_t i = 0; i < n; ++i) {
    uint64_t h = finish(kSeed ^ static_cast<uint64_t>(bytes[i]));
    for (int64_t c = first[i]; c < first[i + 1]; ++c) h = step(h, parts[c]);
    out[i] = finish(h);
  }
}

// The digest of ``bytes`` bytes at ``data``: hr_digest_many of that one buffer.
uint64_t hr_digest(const void* data, int64_t bytes) {
  uint64_t out;
  hr_digest_many(&data, &bytes, 1, &out);
  return out;
}

}  // extern "C"
