// Background copy threads (the checkpoint persister, the replica sender and
// the replica server's puts) yield the cores and the disk to training.
//
// LowerThisThread(nice) raises the calling thread's nice value to `nice` (a
// Linux nice value is per thread) and, for nice > 0, puts its I/O in the
// best-effort class at the lowest level. Under contention a thread at nice 10
// gets about a tenth of the CPU time of a training process at nice 0 (CFS
// weights 110 and 1024); on idle cores it runs at full speed, so a GPU job's
// copies are no slower and a CPU-bound step loses little to them. Never
// raises a priority (that needs CAP_SYS_NICE): a thread already nicer keeps
// its value. nice 0 does nothing.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace ballast {

// --ckpt-copy-nice's default (ballast run, and the drivers that pass it on).
inline constexpr int kDefaultCopyNice = 10;

// The calling thread's name (at most 15 bytes, truncated), seen in
// /proc/<pid>/task/<tid>/comm, top -H and perf.
void NameThisThread(const std::string& name);

// See above. nice: 0..19. An error only when the kernel refused.
absl::Status LowerThisThread(int nice);

// A copy thread's start: names the thread `name` and lowers it to `nice`; a
// refusal (a container's seccomp profile, say) is logged once per process as
// a warning and the copies run at the agent's priority.
void LowerThisThreadForCopies(int nice, const std::string& name);

// The calling thread's nice value and I/O priority class (0 none, 1 real
// time, 2 best effort, 3 idle) and level; for tests.
int ThisThreadNice();
int ThisThreadIoPriority(int* level);

}  // namespace ballast
