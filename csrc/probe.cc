#include "probe.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <cstring>
#include <random>

#include "common.h"
#include "copy.h"

namespace kvio {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Host memory for a probe: a slice of `pool` when it has room (registered-buffer path),
// otherwise a private anonymous mapping.
class ScratchBuffer {
 public:
  ScratchBuffer(HostPool* pool, uint64_t nbytes) : nbytes_(nbytes) {
    if (pool) {
      try {
        offset_ = pool->allocator().alloc(nbytes, 4096);
        pool_ = pool;
        addr_ = pool->address() + offset_;
        return;
      } catch (const Error&) {
        // pool too full: fall through to private memory
      }
    }
    void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw_errno("probe", "mmap", -1, nbytes, errno);
    addr_ = reinterpret_cast<uint64_t>(p);
  }
  ~ScratchBuffer() {
    if (pool_) {
      pool_->allocator().free(offset_);
    } else {
      munmap(reinterpret_cast<void*>(addr_), nbytes_);
    }
  }
  uint64_t addr() const { return addr_; }

 private:
  uint64_t nbytes_;
  HostPool* pool_ = nullptr;
  uint64_t offset_ = 0;
  uint64_t addr_ = 0;
};

class ScratchExtent {
 public:
  ScratchExtent(Device& dev, uint64_t nbytes) : dev_(dev), offset_(dev.allocator().alloc(nbytes)) {}
  ~ScratchExtent() { dev_.allocator().free(offset_); }
  uint64_t offset() const { return offset_; }

 private:
  Device& dev_;
  uint64_t offset_;
};

void raise_first_error(const std::vector<IoResult>& results, const std::string& device) {
  for (const IoResult& r : results) {
    if (r.status == Status::Error) {
      throw Error(ErrorKind::Io, device, static_cast<int64_t>(r.offset), r.err, r.message);
    }
  }
}

// Streams chunks over [base, base + span) until `budget` seconds pass; returns bytes moved.
uint64_t stream(Device& dev, bool write, uint64_t base, uint64_t span, uint64_t chunk,
                unsigned depth, uint64_t host, double budget, uint64_t* high_water) {
  const unsigned per_ticket = std::max(1u, depth / 2);
  const uint64_t slots = span / chunk;
  uint64_t next = 0, moved = 0;
  std::deque<uint64_t> tickets;
  unsigned slot_base = 0;  // host buffer halves alternate between the two tickets
  auto submit_one = [&] {
    std::vector<IoOp> ops;
    for (unsigned i = 0; i < per_ticket; ++i) {
      const uint64_t off = base + (next++ % slots) * chunk;
      ops.push_back({off, host + (slot_base * per_ticket + i) * chunk, chunk, std::nullopt, {}});
    }
    if (high_water) *high_water = std::max(*high_water, std::min(next, slots) * chunk);
    slot_base ^= 1;
    tickets.push_back(dev.submit(write, ops));
  };
  const auto t0 = Clock::now();
  submit_one();
  submit_one();
  while (!tickets.empty()) {
    std::vector<IoResult> res;
    dev.wait(tickets.front(), -1, &res);
    tickets.pop_front();
    raise_first_error(res, dev.name());
    for (const auto& r : res) moved += r.length;
    if (since(t0) < budget) submit_one();
  }
  return moved;
}

}  // namespace

DeviceProbe probe_device(Device& dev, double seconds, uint64_t chunk_bytes, unsigned queue_depth,
                         bool write, HostPool* pool) {
  if (seconds <= 0) {
    throw Error(ErrorKind::Value, dev.name(), -1, EINVAL, "probe_device: seconds must be > 0");
  }
  const uint64_t gran = dev.allocator().granularity();
  const uint64_t chunk = round_up(std::max<uint64_t>(chunk_bytes, 1), gran);
  const unsigned depth = std::max(2u, queue_depth ? queue_depth : dev.queue_depth());
  const uint64_t per_ticket = std::max(1u, depth / 2);
  // Up to 1 GiB of scratch space, but never more than the device can spare.
  const uint64_t largest = dev.allocator().largest_free();
  const uint64_t span = std::min<uint64_t>(largest, 1ull << 30) / chunk * chunk;
  if (span < chunk) {
    throw Error(ErrorKind::PoolFull, dev.name(), -1, ENOSPC,
                "device '" + dev.name() + "': probe needs one free " + std::to_string(chunk) +
                    "-byte extent, largest free is " + std::to_string(largest));
  }
  ScratchExtent extent(dev, span);
  ScratchBuffer host(pool, 2 * per_ticket * chunk);
  std::mt19937_64 rng(0x6b76696f);
  auto* words = reinterpret_cast<uint64_t*>(host.addr());
  for (uint64_t i = 0; i < 2 * per_ticket * chunk / 8; ++i) words[i] = rng();

  DeviceProbe out;
  const auto t0 = Clock::now();
  uint64_t written_span = span;
  if (write) {
    uint64_t high = 0;
    auto tw = Clock::now();
    out.bytes_written = stream(dev, true, extent.offset(), span, chunk, depth, host.addr(),
                               seconds / 2, &high);
    out.write_gbps = out.bytes_written / since(tw) / 1e9;
    written_span = std::max(chunk, high);
  }
  // Read back what was just written: unwritten file extents read as zeros without disk I/O.
  auto tr = Clock::now();
  const double left = std::max(0.05, seconds - since(t0));
  out.bytes_read = stream(dev, false, extent.offset(), written_span, chunk, depth, host.addr(),
                          left, nullptr);
  out.read_gbps = out.bytes_read / since(tr) / 1e9;
  out.seconds = since(t0);
  return out;
}

MemcpyProbe probe_memcpy(HostPool* pool, double seconds, uint64_t nbytes, unsigned threads) {
  if (seconds <= 0 || nbytes == 0) {
    throw Error(ErrorKind::Value, "memcpy", -1, EINVAL,
                "probe_memcpy: seconds and nbytes must be > 0");
  }
  if (pool) nbytes = std::min(nbytes, pool->allocator().largest_free() / 2 / 4096 * 4096);
  if (nbytes == 0) {
    throw Error(ErrorKind::PoolFull, pool->name(), -1, ENOSPC,
                "host pool '" + pool->name() + "': no room for a memcpy probe");
  }
  ScratchBuffer buf(pool, 2 * nbytes);
  std::memset(reinterpret_cast<void*>(buf.addr()), 0x5a, 2 * nbytes);
  const CopyOp op{buf.addr() + nbytes, buf.addr(), nbytes};
  MemcpyProbe out;
  out.threads = std::max(1u, threads);
  const auto t0 = Clock::now();
  unsigned rounds = 0;
  while (rounds < 3 || since(t0) < seconds) {
    out.bytes += copy_many(&op, 1, out.threads);
    ++rounds;
  }
  out.seconds = since(t0);
  out.gbps = out.bytes / out.seconds / 1e9;
  return out;
}

}  // namespace kvio
