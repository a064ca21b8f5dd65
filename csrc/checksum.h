// XXH3-64 (bit-identical to the reference XXH3_64bits_withSeed), used as the chunk checksum.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvio {

// Streaming form: a chunk whose bytes lie in several places (KV pages scattered over a KV-cache
// tensor, NVMe requests) hashes to the same value as the contiguous chunk. `update_copy` hashes
// `src` while copying it to `dst`, a few KiB at a time, so verifying a copy costs no second pass
// over memory.
class Xxh3 {
 public:
  explicit Xxh3(uint64_t seed = 0);
  void update(const void* data, size_t len) { consume(nullptr, data, len); }
  void update_copy(void* dst, const void* src, size_t len) { consume(dst, src, len); }
  uint64_t digest() const;

  static constexpr size_t kSecretSize = 192;
  static constexpr size_t kBufferSize = 256;  // = 4 stripes; inputs up to 240 bytes stay whole

 private:
  void consume(void* dst, const void* src, size_t len);
  uint64_t seed_;
  uint64_t acc_[8];
  unsigned stripe_in_block_ = 0;  // stripes of the current 1024-byte block consumed so far
  uint64_t total_ = 0;
  size_t buffered_ = 0;
  unsigned char buf_[kBufferSize];
  unsigned char prev_[64];  // the 64 bytes before buf_[0], once any stripe was consumed
  unsigned char secret_[kSecretSize];  // the default secret, derived from the seed
};

uint64_t xxh3_64(const void* data, size_t len, uint64_t seed = 0);

// The stripe kernel in use: "avx2", "sse2" (x86-64 baseline) or "scalar" (other CPUs), chosen
// once from the CPU. xxh3_select_kernel switches to another one this build and CPU can run
// (tests compare them); it returns false, changing nothing, for one they cannot.
const char* xxh3_kernel();
bool xxh3_select_kernel(const char* name);

}  // namespace kvio
