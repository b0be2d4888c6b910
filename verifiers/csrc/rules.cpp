// The kernel's rule table, exported so that verifiers/native.py can check a rule's declaration
// (its kernel id and argument count) against what the kernel implements under that id.

#include "rules.h"

extern "C" {

// The registered name of kernel rule ``id`` (nullptr if there is none), and its argument count.
const char* hr_rule_name(int64_t id) { return id >= 0 && id < kNumRules ? kRules[id].name : nullptr; }

int64_t hr_rule_nargs(int64_t id) { return id >= 0 && id < kNumRules ? kRules[id].nargs : -1; }

}  // extern "C"
