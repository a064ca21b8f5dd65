// C++ tests of fault injection (built with -DKVPOOL_FAULT_INJECTION=ON; run by ctest).
// Usage: kvio_fault_tests <scratch-dir> (a real filesystem: O_DIRECT).
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "device.h"
#include "fault.h"
#include "host_pool.h"

#include "check.h"

using namespace kvio;


static bool rejected(const std::string& spec, const std::string& says) {
  try {
    parse_fault_spec(spec);
  } catch (const Error& e) {
    return e.kind() == ErrorKind::Value && std::string(e.what()).find(says) != std::string::npos;
  }
  return false;
}

static void test_parser() {
  auto rules = parse_fault_spec(
      " device=ssd1,op=read,errno=EIO,after=3,count=2 ; device=ssd0.rank1 , op = write ,"
      "errno=ENOSPC;");
  CHECK(rules.size() == 2);
  if (rules.size() == 2) {
    CHECK(rules[0].device == "ssd1" && !rules[0].write && rules[0].err == EIO);
    CHECK(rules[0].after == 3 && rules[0].count == 2);
    CHECK(rules[1].device == "ssd0.rank1" && rules[1].write && rules[1].err == ENOSPC);
    CHECK(rules[1].after == 0 && rules[1].count == 0);
  }
  CHECK(parse_fault_spec("").empty() && parse_fault_spec(" ; ").empty());
  CHECK(rejected("device=a,op=read,errno=EIO,bogus=1", "unknown field 'bogus'"));
  CHECK(rejected("device=a,op=trim,errno=EIO", "op must be read or write"));
  CHECK(rejected("device=a,op=read,errno=EBADF", "errno must be EIO or ENOSPC"));
  CHECK(rejected("device=a,op=read,errno=ENOSPC", "ENOSPC is a write error"));
  CHECK(rejected("op=read,errno=EIO", "device, op and errno are required"));
  CHECK(rejected("device=a,op=read", "device, op and errno are required"));
  CHECK(rejected("device=a,op=read,errno=EIO,after=-1", "after must be a non-negative integer"));
  CHECK(rejected("device=a,op=read,errno=EIO,count=", "count must be a non-negative integer"));
  CHECK(rejected("device=a,op=read,errno=EIO;device=b,op", "rule 2 'device=b,op'"));
  set_faults("device=a,op=read,errno=EIO");
  bool threw = false;
  try {
    set_faults("device=a,op=read,errno=EIO,after=x");
  } catch (const Error&) {
    threw = true;
  }
  CHECK(threw && current_faults().size() == 1);  // a bad spec leaves the rules as they were
  set_faults("");
  CHECK(current_faults().empty());
}

// fault_for: skip `after` matching requests, fail `count`, then let everything through.
static void test_after_count() {
  set_faults("device=a,op=read,errno=EIO,after=2,count=3;device=a,op=write,errno=ENOSPC,after=1");
  std::string detail;
  std::vector<int> reads;
  for (int i = 0; i < 8; ++i) reads.push_back(fault_for("a", false, &detail));
  CHECK((reads == std::vector<int>{0, 0, EIO, EIO, EIO, 0, 0, 0}));
  CHECK(fault_for("b", false, &detail) == 0);  // another device
  CHECK(fault_for("a", true, &detail) == 0);   // count=0: every write after the first
  for (int i = 0; i < 5; ++i) CHECK(fault_for("a", true, &detail) == ENOSPC);
  CHECK(detail == "injected fault (KVPOOL_FAULTS rule 2)");
  auto rules = current_faults();
  CHECK(rules.size() == 2 && rules[0].seen == 8 && rules[0].injected == 3);
  CHECK(rules.size() == 2 && rules[1].seen == 6 && rules[1].injected == 5);
  // Overlapping rules: both count the request, the first in its window decides.
  set_faults("device=a,op=read,errno=EIO,after=1,count=1;device=a,op=read,errno=EIO,count=1");
  CHECK(fault_for("a", false, &detail) == EIO && detail.find("rule 2") != std::string::npos);
  CHECK(fault_for("a", false, &detail) == EIO && detail.find("rule 1") != std::string::npos);
  CHECK(fault_for("a", false, &detail) == 0);
  rules = current_faults();
  CHECK(rules.size() == 2 && rules[0].seen == 3 && rules[1].seen == 3);
  set_faults("");
}

static std::vector<unsigned char> file_bytes(const std::string& path, uint64_t off, uint64_t n) {
  std::vector<unsigned char> out(n);
  const int fd = ::open(path.c_str(), O_RDONLY);
  CHECK(fd >= 0 && ::pread(fd, out.data(), n, static_cast<off_t>(off)) == static_cast<ssize_t>(n));
  ::close(fd);
  return out;
}

// Through a real device: the errno arrives in the op's result through the completion path,
// counted once per op, with the medium and host buffers left as a failing disk leaves them.
static void test_device(const std::string& path, const std::string& backend) {
  ::unlink(path.c_str());
  DeviceOptions o;
  o.path = path;
  o.capacity = 4 * kMiB;
  o.backend = backend;
  o.name = "faulty";
  Device d(o);
  auto pool = std::make_shared<HostPool>(kMiB, -1, false, false, "ft");
  d.register_host_pools({pool});
  const uint64_t chunk = 64 * 1024, base = pool->address();
  auto* bytes = static_cast<unsigned char*>(pool->data());
  for (int k = 0; k < 4; ++k) std::memset(bytes + k * chunk, 0x10 + k, chunk);
  std::vector<IoOp> writes;
  for (uint64_t k = 0; k < 4; ++k) writes.push_back({k * chunk, base + k * chunk, chunk, {}, {}});
  std::vector<IoResult> res;

  // Write EIO: the write happens, the op still fails (the data must not be trusted).
  set_faults("device=faulty,op=write,errno=EIO,after=1,count=1;"
             "device=other,op=write,errno=EIO");
  CHECK(d.wait(d.submit(true, writes), -1, &res));
  CHECK(res.size() == 4 && res[0].status == Status::Ok && res[2].status == Status::Ok);
  CHECK(res.size() == 4 && res[1].status == Status::Error && res[1].err == EIO);
  CHECK(res.size() == 4 && res[1].message.find("injected fault") != std::string::npos);
  CHECK(d.stats().errors == 1 && d.stats().writes == 3);
  CHECK(file_bytes(path, chunk, chunk) == std::vector<unsigned char>(chunk, 0x11));

  // Write ENOSPC: nothing written.
  set_faults("device=faulty,op=write,errno=ENOSPC,after=3");
  for (int k = 0; k < 4; ++k) std::memset(bytes + k * chunk, 0x20 + k, chunk);
  CHECK(d.wait(d.submit(true, writes), -1, &res));
  CHECK(res.size() == 4 && res[2].status == Status::Ok && res[3].status == Status::Error);
  CHECK(res.size() == 4 && res[3].err == ENOSPC);
  CHECK(file_bytes(path, 3 * chunk, chunk) == std::vector<unsigned char>(chunk, 0x13));
  CHECK(d.stats().errors == 2);

  // Read EIO on a scattered op (two segments): the op fails as one, counted once, and its host
  // buffers hold poison, not the chunk; the next read of it (rule spent) is whole again.
  set_faults("device=faulty,op=read,errno=EIO,after=1,count=1");
  const uint64_t dst = base + 8 * chunk;
  std::memset(bytes + 8 * chunk, 0, 4 * chunk);
  const IoOp first{0, dst, chunk, {}, {}};
  const IoOp scattered{chunk, 0, chunk, {}, {{dst + chunk, chunk / 2}, {dst + 3 * chunk, chunk / 2}}};
  CHECK(d.wait(d.submit(false, {first, scattered}), -1, &res));
  CHECK(res.size() == 2 && res[0].status == Status::Ok && res[1].err == EIO);
  CHECK(bytes[8 * chunk] == 0x20);
  CHECK(bytes[9 * chunk] == kFaultPoison && bytes[11 * chunk + chunk / 2 - 1] == kFaultPoison);
  CHECK(d.stats().errors == 3 && d.stats().reads == 1);
  CHECK(d.wait(d.submit(false, {scattered}), -1, &res));
  CHECK(res.size() == 1 && res[0].status == Status::Ok);
  CHECK(bytes[9 * chunk] == 0x21 && bytes[11 * chunk + chunk / 2 - 1] == 0x21);
  auto rules = current_faults();
  CHECK(rules.size() == 1 && rules[0].seen == 3 && rules[0].injected == 1);
  set_faults("");
  d.close();
  ::unlink(path.c_str());
}

// KVPOOL_FAULTS is taken when a device opens; reopening under the same value keeps counting
// (a failed device that comes back), a new value replaces the rules, a bad one fails the open.
static void test_env(const std::string& path) {
  ::unlink(path.c_str());
  DeviceOptions o;
  o.path = path;
  o.capacity = kMiB;
  o.backend = "posix";
  o.name = "envdev";
  std::string detail;
  ::setenv("KVPOOL_FAULTS", "device=envdev,op=write,errno=EIO,count=1", 1);
  set_faults("device=x,op=read,errno=EIO");
  { Device d(o); }
  auto rules = current_faults();
  CHECK(rules.size() == 1 && rules[0].device == "envdev");
  CHECK(fault_for("envdev", true, &detail) == EIO);
  { Device d(o); }
  CHECK(fault_for("envdev", true, &detail) == 0);  // the same spec: its counter went on
  ::setenv("KVPOOL_FAULTS", "device=envdev,op=write,errno=EIO,after=1", 1);
  { Device d(o); }
  rules = current_faults();
  CHECK(rules.size() == 1 && rules[0].after == 1 && rules[0].seen == 0);
  ::setenv("KVPOOL_FAULTS", "device=envdev,op=read,errno=ENOSPC", 1);
  bool threw = false;
  try {
    Device d(o);
  } catch (const Error& e) {
    threw = e.kind() == ErrorKind::Value &&
            std::string(e.what()).find("ENOSPC is a write error") != std::string::npos;
  }
  CHECK(threw);
  ::unsetenv("KVPOOL_FAULTS");
  set_faults("");
  ::unlink(path.c_str());
}

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  ::unsetenv("KVPOOL_FAULTS");
  test_parser();
  test_after_count();
  test_device(dir + "/kvio_fault_uring.img", "uring");
  test_device(dir + "/kvio_fault_posix.img", "posix");
  test_env(dir + "/kvio_fault_env.img");
  return finish("kvio fault tests");
}
