#include "copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "checksum.h"

namespace kvio {
namespace {

constexpr uint64_t kSlice = 4ull << 20;  // big ops are cut so threads share them evenly

void copy_one(const CopyOp& op) {
  std::memcpy(reinterpret_cast<void*>(op.dst), reinterpret_cast<const void*>(op.src), op.nbytes);
}

}  // namespace

uint64_t copy_many(const CopyOp* ops, size_t n, unsigned threads) {
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += ops[i].nbytes;
  // Threads only pay off when each gets several MiB (thread start-up is tens of microseconds).
  if (threads <= 1 || total < 2 * kSlice) {
    for (size_t i = 0; i < n; ++i) copy_one(ops[i]);
    return total;
  }
  std::vector<CopyOp> slices;
  slices.reserve(n + total / kSlice);
  for (size_t i = 0; i < n; ++i) {
    for (uint64_t off = 0; off < ops[i].nbytes; off += kSlice) {
      slices.push_back({ops[i].dst + off, ops[i].src + off, std::min(kSlice, ops[i].nbytes - off)});
    }
  }
  const unsigned parts = std::min<size_t>(threads, slices.size());
  std::atomic<size_t> cursor{0};
  auto worker = [&] {
    for (size_t s; (s = cursor.fetch_add(1)) < slices.size();) copy_one(slices[s]);
  };
  std::vector<std::thread> helpers;
  helpers.reserve(parts - 1);
  for (unsigned i = 1; i < parts; ++i) helpers.emplace_back(worker);
  worker();
  for (auto& t : helpers) t.join();
  return total;
}

uint64_t copy_many_checksum(const CopyOp* ops, size_t n) {
  Xxh3 hash;
  for (size_t i = 0; i < n; ++i) {
    hash.update_copy(reinterpret_cast<void*>(ops[i].dst), reinterpret_cast<const void*>(ops[i].src),
                     ops[i].nbytes);
  }
  return hash.digest();
}

}  // namespace kvio
