// xxHash64 of a memory range (bit-identical to the reference XXH64), used as the chunk checksum.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvio {

uint64_t xxh64(const void* data, size_t len, uint64_t seed = 0);

}  // namespace kvio
