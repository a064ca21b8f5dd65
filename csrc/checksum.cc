// xxHash64, written from the published algorithm description (4 lanes of 64-bit multiply-rotate).
#include "checksum.h"

#include <cstring>

namespace kvio {
namespace {

constexpr uint64_t P1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t P2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t P3 = 0x165667B19E3779F9ull;
constexpr uint64_t P4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t P5 = 0x27D4EB2F165667C5ull;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64)
  return v;
}
inline uint32_t load32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t lane(uint64_t acc, uint64_t input) { return rotl(acc + input * P2, 31) * P1; }
inline uint64_t fold(uint64_t h, uint64_t v) { return (h ^ lane(0, v)) * P1 + P4; }

}  // namespace

Xxh64::Xxh64(uint64_t seed) : seed_(seed), v_{seed + P1 + P2, seed + P2, seed, seed - P1} {}

void Xxh64::stripe(const unsigned char* p) {
  v_[0] = lane(v_[0], load64(p));
  v_[1] = lane(v_[1], load64(p + 8));
  v_[2] = lane(v_[2], load64(p + 16));
  v_[3] = lane(v_[3], load64(p + 24));
}

void Xxh64::consume(void* dst, const void* src, size_t len) {
  const auto* p = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  auto copy = [&](size_t n) {  // copies what was just hashed, while it is still in L1
    if (d) {
      std::memcpy(d, p, n);
      d += n;
    }
    p += n;
    len -= n;
  };
  total_ += len;
  if (buffered_) {  // complete the stripe left over from the previous update
    const size_t take = len < 32 - buffered_ ? len : 32 - buffered_;
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take;
    copy(take);
    if (buffered_ < 32) return;
    stripe(buf_);
    buffered_ = 0;
  }
  while (len >= 32) {
    stripe(p);
    copy(32);
  }
  std::memcpy(buf_, p, len);
  buffered_ = len;
  copy(len);
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    for (uint64_t v : v_) h = fold(h, v);
  } else {
    h = seed_ + P5;
  }
  h += total_;
  const unsigned char* p = buf_;
  const unsigned char* const end = buf_ + buffered_;
  for (; p + 8 <= end; p += 8) h = rotl(h ^ lane(0, load64(p)), 27) * P1 + P4;
  if (p + 4 <= end) {
    h = rotl(h ^ (static_cast<uint64_t>(load32(p)) * P1), 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl(h ^ (*p * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t len, uint64_t seed) {
  Xxh64 h(seed);
  h.update(data, len);
  return h.digest();
}

}  // namespace kvio
