// Bulk copies between staging buffers in host pools and KV-cache tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvio {

struct CopyOp {
  uint64_t dst, src, nbytes;
};

// Copies every op; with threads > 1 the bytes are split over an internal worker pool (the
// calling thread takes a share too). Returns the number of bytes copied.
uint64_t copy_many(const CopyOp* ops, size_t n, unsigned threads);

// Copies every op in order on the calling thread and returns the XXH3-64 of the source bytes
// in that order (= the checksum of the chunk they form), hashing each few KiB as it is copied.
uint64_t copy_many_checksum(const CopyOp* ops, size_t n);

}  // namespace kvio
