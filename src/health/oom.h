// How many times the kernel's OOM killer acted in this process's memory
// cgroup: the agent reads it when a worker starts and when one dies of
// SIGKILL, and a rise means the OOM killer was the killer (FailureKind
// kOomKilled), not a person or a scheduler. Workers stay in their agent's
// cgroup, so the count covers them.
//
// cgroup v2: "0::<path>" in /proc/self/cgroup, the "oom_kill N" line of
// <root>/<path>/memory.events. cgroup v1: the "memory" controller's path,
// the "oom_kill N" line of <root>/memory/<path>/memory.oom_control (kernel
// 4.13+). nullopt when neither can be read (then a SIGKILL stays "killed").
//
// Thread safety: a free function.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace ballast::health {

std::optional<int64_t> CgroupOomKills(const std::string& proc_cgroup = "/proc/self/cgroup",
                                      const std::string& cgroup_root = "/sys/fs/cgroup");

}  // namespace ballast::health
