// Short bandwidth probes whose results the pool uses as placement weights.
#pragma once

#include <cstdint>

#include "device.h"
#include "host_pool.h"

namespace kvio {

struct DeviceProbe {
  double read_gbps = 0, write_gbps = 0, seconds = 0;
  uint64_t bytes_read = 0, bytes_written = 0;
};

struct MemcpyProbe {
  double gbps = 0, seconds = 0;
  uint64_t bytes = 0;
  unsigned threads = 1;
};

// Writes (if `write`) then reads a scratch extent borrowed from the device's allocator, keeping
// `queue_depth` (0 = the device's) chunks in flight; total time <= `seconds`.
DeviceProbe probe_device(Device& dev, double seconds, uint64_t chunk_bytes, unsigned queue_depth,
                         bool write, HostPool* pool);

MemcpyProbe probe_memcpy(HostPool* pool, double seconds, uint64_t nbytes, unsigned threads);

}  // namespace kvio
