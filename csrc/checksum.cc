// XXH3-64, written from the published algorithm description
// (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md): inputs up to 240 bytes are
// mixed whole with a 192-byte secret; longer ones run 8 64-bit accumulators over 64-byte stripes
// (1024-byte blocks, a scramble after each), then the last 64 bytes as a final stripe, a merge
// and an avalanche. The stripe loop, where the time goes, has AVX2, SSE2 and scalar kernels.
#include "checksum.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvio {
namespace {

constexpr uint64_t kP32_1 = 0x9E3779B1ull;
constexpr uint64_t kP32_2 = 0x85EBCA77ull;
constexpr uint64_t kP32_3 = 0xC2B2AE3Dull;
constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP64_2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP64_3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP64_4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP64_5 = 0x27D4EB2F165667C5ull;
constexpr uint64_t kPMx1 = 0x165667919E3779F9ull;
constexpr uint64_t kPMx2 = 0x9FB21C651E98DF25ull;

constexpr size_t kStripe = 64;
constexpr size_t kStripesPerBlock = (Xxh3::kSecretSize - kStripe) / 8;  // 16: 1024-byte blocks
constexpr size_t kScrambleSecret = Xxh3::kSecretSize - kStripe;         // 128
constexpr size_t kLastStripeSecret = Xxh3::kSecretSize - kStripe - 7;   // 121
constexpr size_t kMergeSecret = 11;
constexpr size_t kMidSizeMax = 240;

// The default secret of XXH3: a constant table of the specification (address above; "Copyright
// (c) Yann Collet", the document may be copied with that notice; the same table is in the
// BSD-2-Clause reference library), reproduced here as data.
alignas(64) constexpr unsigned char kSecret[Xxh3::kSecretSize] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64), as the spec reads
  return v;
}
inline uint32_t load32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t mul_fold(uint64_t a, uint64_t b) {  // 64x64 -> 128, low half xor high half
  const unsigned __int128 m = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
}
inline uint64_t avalanche(uint64_t x) {
  x ^= x >> 37;
  x *= kPMx1;
  return x ^ (x >> 32);
}
inline uint64_t avalanche_xxh64(uint64_t x) {
  x ^= x >> 33;
  x *= kP64_2;
  x ^= x >> 29;
  x *= kP64_3;
  return x ^ (x >> 32);
}
inline uint64_t mix16(const unsigned char* p, const unsigned char* s, uint64_t seed) {
  return mul_fold(load64(p) ^ (load64(s) + seed), load64(p + 8) ^ (load64(s + 8) - seed));
}

// Inputs of 0-240 bytes (the default secret and the seed).
uint64_t hash_short(const unsigned char* p, size_t len, uint64_t seed) {
  const unsigned char* s = kSecret;
  if (len == 0) return avalanche_xxh64(seed ^ load64(s + 56) ^ load64(s + 64));
  if (len <= 3) {
    const uint32_t combined = static_cast<uint32_t>(p[len - 1]) |
                              static_cast<uint32_t>(len << 8) |
                              static_cast<uint32_t>(p[0]) << 16 |
                              static_cast<uint32_t>(p[len >> 1]) << 24;
    return avalanche_xxh64((static_cast<uint64_t>(load32(s) ^ load32(s + 4)) + seed) ^ combined);
  }
  if (len <= 8) {
    const uint64_t modified_seed =
        seed ^ static_cast<uint64_t>(__builtin_bswap32(static_cast<uint32_t>(seed))) << 32;
    const uint64_t combined =
        static_cast<uint64_t>(load32(p + len - 4)) | static_cast<uint64_t>(load32(p)) << 32;
    uint64_t v = ((load64(s + 8) ^ load64(s + 16)) - modified_seed) ^ combined;
    v ^= rotl(v, 49) ^ rotl(v, 24);
    v *= kPMx2;
    v ^= (v >> 35) + len;
    v *= kPMx2;
    return v ^ (v >> 28);
  }
  if (len <= 16) {
    const uint64_t lo = ((load64(s + 24) ^ load64(s + 32)) + seed) ^ load64(p);
    const uint64_t hi = ((load64(s + 40) ^ load64(s + 48)) - seed) ^ load64(p + len - 8);
    return avalanche(len + __builtin_bswap64(lo) + hi + mul_fold(lo, hi));
  }
  uint64_t acc = len * kP64_1;
  if (len <= 128) {  // pairs of 16-byte pieces from both ends, meeting in the middle
    for (size_t i = 0; i <= (len - 1) / 32; ++i) {
      acc += mix16(p + 16 * i, s + 32 * i, seed);
      acc += mix16(p + len - 16 * (i + 1), s + 32 * i + 16, seed);
    }
    return avalanche(acc);
  }
  for (size_t i = 0; i < 8; ++i) acc += mix16(p + 16 * i, s + 16 * i, seed);
  acc = avalanche(acc);
  for (size_t i = 8; i < len / 16; ++i) acc += mix16(p + 16 * i, s + 16 * (i - 8) + 3, seed);
  acc += mix16(p + len - 16, s + 136 - 17, seed);
  return avalanche(acc);
}

// ---- Stripe kernels: consume n stripes at p; after the 16th stripe of a block, scramble.

void accumulate_scalar(uint64_t* acc, const unsigned char* p, const unsigned char* s) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t d = load64(p + 8 * i);
    const uint64_t v = d ^ load64(s + 8 * i);
    acc[i ^ 1] += d;
    acc[i] += (v & 0xFFFFFFFFull) * (v >> 32);
  }
}

void stripes_scalar(uint64_t* acc, const unsigned char* p, size_t n, unsigned* in_block,
                    const unsigned char* secret) {
  unsigned k = *in_block;
  while (n) {
    const size_t take = std::min<size_t>(kStripesPerBlock - k, n);
    for (size_t j = 0; j < take; ++j, p += kStripe) accumulate_scalar(acc, p, secret + 8 * (k + j));
    k += static_cast<unsigned>(take);
    n -= take;
    if (k == kStripesPerBlock) {
      for (int i = 0; i < 8; ++i) {
        const uint64_t a = acc[i] ^ (acc[i] >> 47) ^ load64(secret + kScrambleSecret + 8 * i);
        acc[i] = a * kP32_1;
      }
      k = 0;
    }
  }
  *in_block = k;
}

#if defined(__x86_64__)
// Per 64-bit lane: acc += lo32(d ^ s) * hi32(d ^ s) + (the other lane of d's 128-bit pair).
// Scramble: acc = (acc ^ acc >> 47 ^ s) * P32_1, as two 32x32 products.

void stripes_sse2(uint64_t* acc, const unsigned char* p, size_t n, unsigned* in_block,
                  const unsigned char* secret) {
  __m128i a[4];
  for (int h = 0; h < 4; ++h) a[h] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc) + h);
  const __m128i prime = _mm_set1_epi64x(static_cast<long long>(kP32_1));
  unsigned k = *in_block;
  while (n) {
    const size_t take = std::min<size_t>(kStripesPerBlock - k, n);
    for (size_t j = 0; j < take; ++j, p += kStripe) {
      const auto* s = reinterpret_cast<const __m128i*>(secret + 8 * (k + j));
      for (int h = 0; h < 4; ++h) {
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + h);
        const __m128i v = _mm_xor_si128(d, _mm_loadu_si128(s + h));
        const __m128i prod = _mm_mul_epu32(v, _mm_srli_epi64(v, 32));
        const __m128i swapped = _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
        a[h] = _mm_add_epi64(a[h], _mm_add_epi64(prod, swapped));
      }
    }
    k += static_cast<unsigned>(take);
    n -= take;
    if (k == kStripesPerBlock) {
      const auto* s = reinterpret_cast<const __m128i*>(secret + kScrambleSecret);
      for (int h = 0; h < 4; ++h) {
        const __m128i x = _mm_xor_si128(_mm_xor_si128(a[h], _mm_srli_epi64(a[h], 47)),
                                        _mm_loadu_si128(s + h));
        const __m128i lo = _mm_mul_epu32(x, prime);
        const __m128i hi = _mm_mul_epu32(_mm_srli_epi64(x, 32), prime);
        a[h] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
      }
      k = 0;
    }
  }
  for (int h = 0; h < 4; ++h) _mm_storeu_si128(reinterpret_cast<__m128i*>(acc) + h, a[h]);
  *in_block = k;
}

__attribute__((target("avx2"))) void stripes_avx2(uint64_t* acc, const unsigned char* p,
                                                  size_t n, unsigned* in_block,
                                                  const unsigned char* secret) {
  __m256i a[2];
  for (int h = 0; h < 2; ++h) {
    a[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc) + h);
  }
  const __m256i prime = _mm256_set1_epi64x(static_cast<long long>(kP32_1));
  unsigned k = *in_block;
  while (n) {
    const size_t take = std::min<size_t>(kStripesPerBlock - k, n);
    for (size_t j = 0; j < take; ++j, p += kStripe) {
      const auto* s = reinterpret_cast<const __m256i*>(secret + 8 * (k + j));
      for (int h = 0; h < 2; ++h) {
        const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + h);
        const __m256i v = _mm256_xor_si256(d, _mm256_loadu_si256(s + h));
        const __m256i prod = _mm256_mul_epu32(v, _mm256_srli_epi64(v, 32));
        const __m256i swapped = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
        a[h] = _mm256_add_epi64(a[h], _mm256_add_epi64(prod, swapped));
      }
    }
    k += static_cast<unsigned>(take);
    n -= take;
    if (k == kStripesPerBlock) {
      const auto* s = reinterpret_cast<const __m256i*>(secret + kScrambleSecret);
      for (int h = 0; h < 2; ++h) {
        const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a[h], _mm256_srli_epi64(a[h], 47)),
                                           _mm256_loadu_si256(s + h));
        const __m256i lo = _mm256_mul_epu32(x, prime);
        const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
        a[h] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
      }
      k = 0;
    }
  }
  for (int h = 0; h < 2; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc) + h, a[h]);
  *in_block = k;
}
#endif

using StripesFn = void (*)(uint64_t*, const unsigned char*, size_t, unsigned*,
                           const unsigned char*);
struct Kernel {
  const char* name;
  StripesFn fn;
};
constexpr Kernel kKernels[] = {
#if defined(__x86_64__)
    {"avx2", stripes_avx2},
    {"sse2", stripes_sse2},
#endif
    {"scalar", stripes_scalar},
};

bool cpu_runs([[maybe_unused]] const Kernel& k) {
#if defined(__x86_64__)
  if (k.fn == stripes_avx2) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
  }
#endif
  return true;
}

std::atomic<const Kernel*>& active_kernel() {
  static std::atomic<const Kernel*> active{[] {
    for (const Kernel& k : kKernels) {
      if (cpu_runs(k)) return &k;  // the table lists the fastest first
    }
    return &kKernels[0];
  }()};
  return active;
}

inline StripesFn stripes_fn() { return active_kernel().load(std::memory_order_relaxed)->fn; }

void derive_secret(unsigned char* out, uint64_t seed) {
  for (size_t i = 0; i < Xxh3::kSecretSize; i += 16) {
    const uint64_t lo = load64(kSecret + i) + seed, hi = load64(kSecret + i + 8) - seed;
    std::memcpy(out + i, &lo, 8);
    std::memcpy(out + i + 8, &hi, 8);
  }
}

void init_acc(uint64_t* acc) {
  const uint64_t init[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};
  std::memcpy(acc, init, sizeof(init));
}

// Inputs over 240 bytes, once every stripe but the last was consumed: the last 64 bytes of the
// input (which may overlap stripes already consumed), the merge and the avalanche.
uint64_t finish_long(uint64_t* acc, const unsigned char* last_stripe, uint64_t total,
                     const unsigned char* secret) {
  accumulate_scalar(acc, last_stripe, secret + kLastStripeSecret);
  uint64_t h = total * kP64_1;
  for (int i = 0; i < 4; ++i) {
    const unsigned char* s = secret + kMergeSecret + 16 * i;
    h += mul_fold(acc[2 * i] ^ load64(s), acc[2 * i + 1] ^ load64(s + 8));
  }
  return avalanche(h);
}

constexpr size_t kCopyPiece = 64;  // stripes hashed then copied at a time (4 KiB, stays in L1)

}  // namespace

Xxh3::Xxh3(uint64_t seed) : seed_(seed) {
  init_acc(acc_);
  derive_secret(secret_, seed);
}

// Invariant: a stripe is consumed only once a later byte is known to exist, since the final
// stripe of the input is hashed differently (finish_long); hence up to kBufferSize bytes wait
// in buf_ and inputs of at most 240 bytes are never consumed at all.
void Xxh3::consume(void* dst, const void* src, size_t len) {
  const auto* p = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  total_ += len;
  if (buffered_ + len <= kBufferSize) {
    std::memcpy(buf_ + buffered_, p, len);
    if (d) std::memcpy(d, p, len);
    buffered_ += len;
    return;
  }
  const StripesFn stripes = stripes_fn();
  if (buffered_) {  // top the buffer up and consume it: more bytes follow
    const size_t take = kBufferSize - buffered_;
    std::memcpy(buf_ + buffered_, p, take);
    if (d) {
      std::memcpy(d, p, take);
      d += take;
    }
    p += take;
    len -= take;
    stripes(acc_, buf_, kBufferSize / kStripe, &stripe_in_block_, secret_);
  }
  // Every whole stripe of the input but the last straight from the input, hashed then copied a
  // piece at a time while the piece is in L1.
  const size_t n = (len - 1) / kStripe;
  for (size_t i = 0; i < n; i += kCopyPiece) {
    const size_t bytes = std::min(kCopyPiece, n - i) * kStripe;
    stripes(acc_, p, bytes / kStripe, &stripe_in_block_, secret_);
    if (d) {
      std::memcpy(d, p, bytes);
      d += bytes;
    }
    p += bytes;
  }
  len -= n * kStripe;  // 1..64 bytes left
  // The final stripe may reach back before what stays buffered: keep the 64 bytes before it
  // (from the input, or, when no stripe came straight from it, the buffer just consumed).
  std::memcpy(prev_, n ? p - kStripe : buf_ + kBufferSize - kStripe, kStripe);
  std::memcpy(buf_, p, len);
  if (d) std::memcpy(d, p, len);
  buffered_ = len;
}

uint64_t Xxh3::digest() const {
  if (total_ <= kMidSizeMax) return hash_short(buf_, total_, seed_);
  uint64_t acc[8];
  std::memcpy(acc, acc_, sizeof(acc));
  unsigned k = stripe_in_block_;
  stripes_fn()(acc, buf_, (buffered_ - 1) / kStripe, &k, secret_);
  unsigned char last[kStripe];
  if (buffered_ >= kStripe) {
    std::memcpy(last, buf_ + buffered_ - kStripe, kStripe);
  } else {
    std::memcpy(last, prev_ + buffered_, kStripe - buffered_);
    std::memcpy(last + kStripe - buffered_, buf_, buffered_);
  }
  return finish_long(acc, last, total_, secret_);
}

uint64_t xxh3_64(const void* data, size_t len, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (len <= kMidSizeMax) return hash_short(p, len, seed);
  unsigned char derived[Xxh3::kSecretSize];
  const unsigned char* secret = kSecret;
  if (seed) {
    derive_secret(derived, seed);
    secret = derived;
  }
  uint64_t acc[8];
  init_acc(acc);
  unsigned k = 0;
  stripes_fn()(acc, p, (len - 1) / kStripe, &k, secret);
  return finish_long(acc, p + len - kStripe, len, secret);
}

const char* xxh3_kernel() { return active_kernel().load()->name; }

bool xxh3_select_kernel(const char* name) {
  for (const Kernel& k : kKernels) {
    if (std::strcmp(k.name, name) == 0 && cpu_runs(k)) {
      active_kernel().store(&k);
      return true;
    }
  }
  return false;
}

}  // namespace kvio
