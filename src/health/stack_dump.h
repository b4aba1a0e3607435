// Reading Python stack dumps (faulthandler's format) of hung workers, to tell
// the worker that stopped making progress from the ones that wait for it: in
// data-parallel training every healthy rank ends up blocked in a collective
// (an allreduce inside backward, a barrier) waiting for the hung one, while
// the hung rank itself sits elsewhere (a dead loop, a sleep, a stuck I/O
// call, a GPU wait in user code).
//
// faulthandler writes, per thread, "Thread 0x... (most recent call first):" or
// "Current thread 0x... (most recent call first):" followed by lines
//   File "/path/file.py", line 12 in function
// innermost first. The main thread is the one whose frames reach "<module>".
//
// Thread safety: stateless free functions.
#pragma once

#include <string>

namespace ballast::health {

struct StackSummary {
  bool found = false;          // the text holds a faulthandler dump
  bool in_collective = false;  // the main thread's innermost frame is in torch's
                               // distributed, autograd or DDP code
  std::string top_frame;       // "path:line in function" of that frame
};

// Summarizes the dump in `text` (other lines are skipped). With several
// threads reaching "<module>" (several dumps), the current thread's is used.
StackSummary SummarizeStackDump(const std::string& text);

// Which hung rank to blame first (lower first): 0 stopped outside any
// collective (the others wait for it); 1 no stack dump (it did not answer:
// stopped by a signal, or stuck outside Python); 2 waiting in a collective.
inline int HangBlameTier(bool stack_found, bool in_collective) {
  return !stack_found ? 1 : (in_collective ? 2 : 0);
}

}  // namespace ballast::health
