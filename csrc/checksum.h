// xxHash64 (bit-identical to the reference XXH64), used as the chunk checksum.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvio {

// Streaming form: a chunk whose bytes lie in several places (KV pages scattered over a KV-cache
// tensor) hashes to the same value as the contiguous chunk. `update_copy` hashes `src` while
// copying it to `dst`, so verifying a copy costs no second pass over memory.
class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t len) { consume(nullptr, data, len); }
  void update_copy(void* dst, const void* src, size_t len) { consume(dst, src, len); }
  uint64_t digest() const;

 private:
  void consume(void* dst, const void* src, size_t len);
  void stripe(const unsigned char* p);
  uint64_t seed_;
  uint64_t v_[4];
  uint64_t total_ = 0;
  unsigned char buf_[32];
  size_t buffered_ = 0;
};

uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0);

}  // namespace kvio
