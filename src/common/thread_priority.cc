#include "common/thread_priority.h"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace ballast {
namespace {

// linux/ioprio.h
constexpr int kIoprioWhoProcess = 1;
constexpr int kIoprioClassShift = 13;
constexpr int kIoprioClassBestEffort = 2;
constexpr int kIoprioLowest = 7;

pid_t Tid() { return static_cast<pid_t>(syscall(SYS_gettid)); }

}  // namespace

void NameThisThread(const std::string& name) { pthread_setname_np(pthread_self(), name.substr(0, 15).c_str()); }

absl::Status LowerThisThread(int nice) {
  if (nice <= 0) return absl::OkStatus();
  const pid_t tid = Tid();
  errno = 0;
  const int now = getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
  if (errno == 0 && now < nice && setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot set this thread's nice value to ", nice));
  }
  if (syscall(SYS_ioprio_set, kIoprioWhoProcess, tid, (kIoprioClassBestEffort << kIoprioClassShift) | kIoprioLowest) !=
      0) {
    return absl::ErrnoToStatus(errno, "cannot lower this thread's I/O priority");
  }
  return absl::OkStatus();
}

void LowerThisThreadForCopies(int nice, const std::string& name) {
  NameThisThread(name);
  if (absl::Status s = LowerThisThread(nice); !s.ok()) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      spdlog::warn("checkpoint copies run at the agent's priority: {} (--ckpt-copy-nice {})", std::string(s.message()),
                   nice);
    });
  }
}

int ThisThreadNice() {
  errno = 0;
  return getpriority(PRIO_PROCESS, static_cast<id_t>(Tid()));
}

int ThisThreadIoPriority(int* level) {
  const long v = syscall(SYS_ioprio_get, kIoprioWhoProcess, Tid());
  if (v < 0) return -1;
  if (level != nullptr) *level = static_cast<int>(v & ((1 << kIoprioClassShift) - 1));
  return static_cast<int>(v >> kIoprioClassShift);
}

}  // namespace ballast
