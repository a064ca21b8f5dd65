// C++ unit tests of the I/O engine core (run by ctest). Usage: kvio_unit_tests <scratch-dir>
// The scratch dir must be on a real filesystem (O_DIRECT), e.g. the CMake build dir.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checksum.h"
#include "common.h"
#include "copy.h"
#include "device.h"
#include "extent_allocator.h"
#include "host_pool.h"
#include "log.h"
#include "probe.h"

#include "check.h"

using namespace kvio;


template <typename F>
static bool throws_kind(ErrorKind kind, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.kind() == kind;
  }
  return false;
}

static void test_xxh3() {
  // Reference values of XXH3_64bits / XXH3_64bits_withSeed (Python xxhash.xxh3_64_intdigest).
  CHECK(xxh3_64("", 0) == 0x2D06800538D394C2ull);
  CHECK(xxh3_64("a", 1) == 0xE6C632B61E964E1Full);
  CHECK(xxh3_64("abc", 3) == 0x78AF5F94892F3950ull);
  CHECK(xxh3_64("abc", 3, 1) == 0x6B4467B443C76228ull);
  const char* fox = "The quick brown fox jumps over the lazy dog";
  CHECK(xxh3_64(fox, std::strlen(fox)) == 0xCE7D19A5418FB365ull);
  // One length of each path (0, 1-3, 4-8, 9-16, 17-128, 129-240, long; block edges), seed 0 and
  // a 64-bit seed (which the long path turns into a derived secret).
  std::vector<unsigned char> buf(5000);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 7 + 3);
  constexpr uint64_t kSeed = 0x9E3779B97F4A7C15ull;
  struct Vec {
    size_t len;
    uint64_t seed0, seeded;
  };
  const Vec vecs[] = {
      {0, 0x2D06800538D394C2ull, 0x602B0E2CD6662C8Bull},
      {1, 0x13E608BC156DEFEDull, 0x1B4C466098160569ull},
      {3, 0xA9088DDA485B481Cull, 0xA8BACD847619199Eull},
      {4, 0x6D9253B16C8B1ED3ull, 0xE1C585329CF1878Eull},
      {8, 0x60539DB630471163ull, 0xBC53D62E02F670A4ull},
      {9, 0xFEFF668361D723A8ull, 0xD4FB426F424E6E62ull},
      {16, 0xB8C859B0F030B585ull, 0x7775D23337D796B5ull},
      {17, 0x714A04408E79B80Full, 0x7D1872B1361C0FA6ull},
      {128, 0x67425A03650261BFull, 0xE9E239440DAC1B3Cull},
      {129, 0xC664BF3311C6ABC4ull, 0xB11455AB08C506D4ull},
      {240, 0x64556DC6B462A6CFull, 0x6EA73B2BE19B57C5ull},
      {241, 0x8BEADD3A8874FE17ull, 0xA0462D397650B282ull},
      {1024, 0x9B81661C641C72B1ull, 0xE955D0AFE88A0F51ull},
      {1025, 0x806C2072ED713576ull, 0xCBDB289911B2614Bull},
      {2048, 0xABE604813BA62ED1ull, 0xF4F759FB3540761Cull},
      {2049, 0x55AED42C9F1554B6ull, 0x48BDDF09C6482093ull},
      {5000, 0x799AADDD7339581Dull, 0x4EAE2D7F035DB6BBull},
  };
  // Every stripe kernel this CPU runs gives the reference values, one-shot and streamed over
  // uneven pieces (copying while hashing too); the last piece sizes leave the final stripe
  // spanning bytes that were consumed in an earlier update.
  const std::string chosen = xxh3_kernel();
  std::printf("xxh3 kernel: %s\n", chosen.c_str());
  std::mt19937_64 rng(42);
  std::vector<unsigned char> copy(buf.size());
  for (const char* kernel : {"avx2", "sse2", "scalar"}) {
    if (!xxh3_select_kernel(kernel)) continue;
    for (const Vec& v : vecs) {
      CHECK(xxh3_64(buf.data(), v.len) == v.seed0);
      CHECK(xxh3_64(buf.data(), v.len, kSeed) == v.seeded);
      for (size_t piece : {1, 7, 63, 64, 65, 200, 255, 256, 257, 1000, 1024, 0}) {
        Xxh3 a, b(kSeed);
        for (size_t off = 0; off < v.len;) {
          const size_t n = std::min(piece ? piece : 1 + rng() % 700, v.len - off);
          a.update(buf.data() + off, n);
          b.update_copy(copy.data() + off, buf.data() + off, n);
          off += n;
        }
        CHECK(a.digest() == v.seed0);
        CHECK(b.digest() == v.seeded);
        CHECK(std::equal(buf.begin(), buf.begin() + v.len, copy.begin()));
        std::fill(copy.begin(), copy.end(), 0);
      }
    }
  }
  CHECK(!xxh3_select_kernel("unknown"));
  CHECK(xxh3_select_kernel(chosen.c_str()));
}

static void test_allocator() {
  ExtentAllocator a("device", "t", 1 << 20, 4096);
  const uint64_t x = a.alloc(4096), y = a.alloc(5000), z = a.alloc(4096);
  CHECK(x % 4096 == 0 && y % 4096 == 0 && z % 4096 == 0);
  CHECK(a.size_of(y) == 8192);
  CHECK(a.used_bytes() == 16384);
  a.free(y);
  CHECK(a.used_bytes() == 8192);
  CHECK(throws_kind(ErrorKind::Value, [&] { a.free(y); }));     // double free
  CHECK(throws_kind(ErrorKind::Value, [&] { a.free(12345); })); // not an extent
  a.free(x);
  a.free(z);
  CHECK(a.used_bytes() == 0 && a.largest_free() == (1u << 20));  // fully coalesced
  const uint64_t aligned = a.alloc(4096, 65536);
  CHECK(aligned % 65536 == 0);
  a.free(aligned);
  CHECK(a.largest_free() == (1u << 20));
  std::vector<uint64_t> offs;
  for (int i = 0; i < 256; ++i) offs.push_back(a.alloc(4096));
  CHECK(a.free_bytes() == 0);
  CHECK(throws_kind(ErrorKind::PoolFull, [&] { a.alloc(1); }));
  // Free every other extent: fragmentation means an 8 KiB request cannot fit.
  for (size_t i = 0; i < offs.size(); i += 2) a.free(offs[i]);
  CHECK(a.free_bytes() == 128 * 4096);
  CHECK(throws_kind(ErrorKind::PoolFull, [&] { a.alloc(8192); }));
  for (size_t i = 1; i < offs.size(); i += 2) a.free(offs[i]);
  CHECK(a.largest_free() == (1u << 20));
}

static void test_host_pool() {
  HostPool p(3 * kMiB, -1, true, false, "t");
  CHECK(p.capacity() == 4 * kMiB);
  CHECK(p.address() % kHugePage == 0);
  std::memset(p.data(), 1, p.capacity());
  CHECK(p.allocator().alloc(kMiB) == 0);
}

static void test_shared_host_pool() {
  // A shared pool lives in a 0600 memfd; a second mapping of it (what an engine gets over the
  // socket) sees the bytes in place and writes through, and attaching writes nothing.
  HostPool p(3 * kMiB, -1, true, false, "shared", true);
  CHECK(p.shared() && p.fd() >= 0 && p.capacity() == 4 * kMiB);
  struct stat st {};
  CHECK(fstat(p.fd(), &st) == 0 && (st.st_mode & 0777) == 0600);
  std::memset(p.data(), 7, p.capacity());
  auto a = HostPool::attach(p.fd(), p.capacity(), false, "a");
  CHECK(a->data() != p.data() && a->data()[kMiB] == 7 && a->data()[p.capacity() - 1] == 7);
  a->data()[123] = 42;
  CHECK(p.data()[123] == 42);
  CHECK(throws_kind(ErrorKind::Value, [&] { HostPool::attach(p.fd(), 2 * p.capacity(), false, "x"); }));
  CHECK(throws_kind(ErrorKind::Value, [&] { HostPool::attach(-1, kMiB, false, "x"); }));
  HostPool priv(kMiB, -1, false, false, "private");
  CHECK(!priv.shared() && priv.fd() == -1);
}

static void test_copy() {
  std::vector<unsigned char> a(24 << 20), b(24 << 20, 0);
  std::mt19937 rng(1);
  for (auto& c : a) c = static_cast<unsigned char>(rng());
  std::vector<CopyOp> ops;
  // Reverse the order of 1 MiB blocks, copied by 2 threads.
  const uint64_t blk = 1 << 20;
  for (uint64_t i = 0; i < 24; ++i) {
    ops.push_back({reinterpret_cast<uint64_t>(b.data()) + (23 - i) * blk,
                   reinterpret_cast<uint64_t>(a.data()) + i * blk, blk});
  }
  CHECK(copy_many(ops.data(), ops.size(), 2) == 24 * blk);
  bool same = true;
  for (uint64_t i = 0; i < 24; ++i) same &= std::memcmp(b.data() + (23 - i) * blk, a.data() + i * blk, blk) == 0;
  CHECK(same);
}

static void roundtrip(const std::string& path, const std::string& backend) {
  DeviceOptions o;
  o.path = path;
  o.capacity = 16 * kMiB;
  o.backend = backend;
  Device d(o);
  CHECK(d.capacity() == 16 * kMiB);
  HostPool pool(8 * kMiB, -1, true, false, "rt");
  d.register_host_pools({std::shared_ptr<HostPool>(&pool, [](HostPool*) {})});
  std::mt19937_64 rng(7);
  auto* w = reinterpret_cast<uint64_t*>(pool.data());
  for (uint64_t i = 0; i < 4 * kMiB / 8; ++i) w[i] = rng();
  std::vector<IoOp> writes, reads;
  for (int i = 0; i < 16; ++i) {
    const uint64_t len = 64 * 1024 * (i % 4 + 1);
    writes.push_back({i * kMiB, pool.address() + i * 256 * 1024, len, std::nullopt});
  }
  std::vector<IoResult> wres, rres;
  CHECK(d.wait(d.submit(true, writes), -1, &wres));
  for (auto& r : wres) CHECK(r.status == Status::Ok && r.checksum != 0);
  for (size_t i = 0; i < writes.size(); ++i) {
    reads.push_back({writes[i].offset, pool.address() + 4 * kMiB + i * 256 * 1024,
                     writes[i].length, wres[i].checksum});
  }
  CHECK(d.wait(d.submit(false, reads), -1, &rres));
  for (size_t i = 0; i < rres.size(); ++i) {
    CHECK(rres[i].status == Status::Ok);
    CHECK(std::memcmp(reinterpret_cast<void*>(reads[i].addr),
                      reinterpret_cast<void*>(writes[i].addr), writes[i].length) == 0);
  }
  // Wrong expected checksum -> corrupt, never ok.
  std::vector<IoOp> bad{{0, pool.address() + 4 * kMiB, writes[0].length, wres[0].checksum ^ 1}};
  CHECK(d.wait(d.submit(false, bad), -1, &rres));
  CHECK(rres[0].status == Status::Corrupt && rres[0].err == EBADMSG);
  if (backend == "uring") {
    std::vector<IoOp> mis{{1, pool.address(), 4096, std::nullopt}};
    CHECK(throws_kind(ErrorKind::Alignment, [&] { d.submit(false, mis); }));
  }
  std::vector<IoOp> past{{16 * kMiB, pool.address(), 4096, std::nullopt}};
  CHECK(throws_kind(ErrorKind::Io, [&] { d.submit(true, past); }));
  d.close();
  CHECK(throws_kind(ErrorKind::Io, [&] { d.submit(true, writes); }));
  ::unlink(path.c_str());
}


// Several threads submit and wait on one device while buffers are re-registered and a probe
// runs: exercises the ring thread's queues and control path (run under TSan in development).
static void concurrency(const std::string& path, const std::string& backend) {
  DeviceOptions o;
  o.path = path;
  o.capacity = 64 * kMiB;
  o.backend = backend;
  o.queue_depth = 8;
  Device d(o);
  auto pool = std::make_shared<HostPool>(16 * kMiB, -1, false, false, "cc");
  std::memset(pool->data(), 0x33, pool->capacity());
  d.register_host_pools({pool});
  const uint64_t chunk = 128 * 1024;
  const uint64_t region = pool->address() + pool->allocator().alloc(16 * chunk);  // not the probe's
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        std::vector<IoOp> ops;
        for (int i = 0; i < 4; ++i) {
          const uint64_t k = (t * 4 + i);
          ops.push_back({k * chunk, region + k * chunk, chunk, std::nullopt});
        }
        std::vector<IoResult> res;
        d.wait(d.submit(round % 2 == 0, ops), -1, &res);
        for (auto& r : res) bad += r.status != Status::Ok;
      }
    });
  }
  threads.emplace_back([&] {
    for (int i = 0; i < 5; ++i) d.register_host_pools({pool});
  });
  const DeviceProbe p = probe_device(d, 0.2, kMiB, 4, true, pool.get());
  for (auto& th : threads) th.join();
  CHECK(bad == 0);
  CHECK(p.read_gbps > 0 && p.write_gbps > 0);
  CHECK(d.stats().inflight == 0);
  d.close();
  ::unlink(path.c_str());
}

// The SPDK log path: a burst per source, the rest counted and reported once, bounded queue.
static void test_rate_limited_log() {
  using C = RateLimitedLog::Clock;
  RateLimitedLog log(3, std::chrono::seconds(10), 8);
  const C::time_point t0{};
  for (int i = 0; i < 100; ++i) log.add(kLogError, "nvme_qpair.c:650", "aborting queued i/o", t0);
  log.add(kLogWarning, "other.c:1", "another source", t0);
  auto out = log.drain();
  CHECK(out.size() == 4);  // 3 of the flood + the other source
  CHECK(out.size() == 4 && out[3].message == "another source" && out[0].level == kLogError);
  CHECK(!log.pending());
  // Next window: the suppressed count comes first, then the new message.
  log.add(kLogError, "nvme_qpair.c:650", "aborting queued i/o", t0 + std::chrono::seconds(11));
  out = log.drain();
  CHECK(out.size() == 2);
  CHECK(out.size() == 2 && out[0].message.find("97 similar messages suppressed") == 0);
  // Queue bound: distinct sources beyond the capacity are dropped and counted.
  for (int i = 0; i < 20; ++i) log.add(kLogInfo, "src" + std::to_string(i), "m", t0);
  out = log.drain();
  CHECK(out.size() == 9);
  CHECK(out.size() == 9 && out[8].message.find("12 engine log messages dropped") == 0);
}

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  test_xxh3();
  test_allocator();
  test_host_pool();
  test_shared_host_pool();
  test_copy();
  test_rate_limited_log();
  roundtrip(dir + "/kvio_unit_uring.img", "uring");
  roundtrip(dir + "/kvio_unit_posix.img", "posix");
  concurrency(dir + "/kvio_unit_cc_uring.img", "uring");
  concurrency(dir + "/kvio_unit_cc_posix.img", "posix");
  return finish("kvio unit tests");
}
