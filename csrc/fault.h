// Fault injection, compiled only with -DKVPOOL_FAULT_INJECTION=ON (test builds): a Backend
// wrapper that fails chosen requests with a real errno through the normal completion path, so
// the device's error handling, its error counter and the Python engine see what a failing disk
// reports. Rules come from the environment variable KVPOOL_FAULTS (taken when a device opens,
// so a `kvpool serve` subprocess inherits them) or from set_faults():
//
//   device=<name>,op=<read|write>,errno=<EIO|ENOSPC>,after=<N>,count=<M>[;<rule>...]
//
// A rule lets the first N matching requests of that device through, then fails the next M
// (count=0: every one after N). A request is one op of a submit (a chunk or an index record),
// however many host segments it has. How a failed request looks, as a disk would leave it:
//   read EIO     the read is done, then the host buffer is overwritten with 0xDB bytes
//                (undefined contents) and EIO reported;
//   write EIO    the write is done (the medium may hold any part of it), then EIO reported;
//   write ENOSPC nothing is written; ENOSPC reported at once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"

namespace kvio {

struct FaultRule {
  std::string device;
  bool write = false;
  int err = 0;
  uint64_t after = 0;     // matching requests let through first
  uint64_t count = 0;     // then failed; 0 = every one after `after`
  uint64_t seen = 0;      // matching requests so far
  uint64_t injected = 0;  // of them failed by this rule
};

constexpr unsigned char kFaultPoison = 0xDB;

// Parses a spec (rules separated by ';', empty ones skipped); throws Error(Value) naming the
// rule and the field.
std::vector<FaultRule> parse_fault_spec(const std::string& spec);

// Replaces the process's rules (counters restart); "" clears them.
void set_faults(const std::string& spec);
// Installs KVPOOL_FAULTS when it is set and differs from the spec last taken from it, so
// devices reopened under the same spec (a failed one coming back) keep counting. Throws on a
// malformed spec.
void load_env_faults();
// The rules with their counters.
std::vector<FaultRule> current_faults();
// Counts a request against every rule that matches it; the errno of the first rule whose
// window holds it (0: let it through) and, then, a detail naming that rule.
int fault_for(const std::string& device, bool write, std::string* detail);

using BackendFactory = std::function<std::unique_ptr<Backend>(const BackendOptions&)>;
// The backend `make` builds, behind the fault-injecting wrapper.
std::unique_ptr<Backend> with_faults(const BackendOptions& opts, const BackendFactory& make);

}  // namespace kvio
