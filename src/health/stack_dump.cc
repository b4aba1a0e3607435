#include "health/stack_dump.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ballast::health {
namespace {

// Innermost-frame locations that mean "waiting for the other ranks". One row
// per module; extend here.
constexpr const char* kCollectivePaths[] = {
    "/torch/distributed/",        // all_reduce, barrier, broadcast, work.wait() ...
    "/torch/autograd/",           // backward: DDP's gradient allreduce runs inside it
    "/torch/nn/parallel/",        // DDP forward (buffer broadcast, unused-parameter sync)
    "/torch/_tensor.py",          // Tensor.backward
};

struct Frame {
  std::string path;
  std::string line;
  std::string function;
};

struct Thread {
  bool current = false;
  std::vector<Frame> frames;  // innermost first
};

// `  File "/p/x.py", line 12 in f` -> frame; false for other lines.
bool ParseFrame(absl::string_view text, Frame* f) {
  text = absl::StripLeadingAsciiWhitespace(text);
  if (!absl::ConsumePrefix(&text, "File \"")) return false;
  size_t q = text.find("\", line ");
  if (q == absl::string_view::npos) return false;
  f->path = std::string(text.substr(0, q));
  absl::string_view rest = text.substr(q + 8);
  size_t in = rest.find(" in ");
  f->line = std::string(rest.substr(0, in));
  f->function = in == absl::string_view::npos ? "" : std::string(rest.substr(in + 4));
  return true;
}

}  // namespace

StackSummary SummarizeStackDump(const std::string& text) {
  std::vector<Thread> threads;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    absl::string_view l = absl::StripTrailingAsciiWhitespace(line);
    bool current = absl::StartsWith(l, "Current thread 0x");
    if ((current || absl::StartsWith(l, "Thread 0x")) && absl::EndsWith(l, "(most recent call first):")) {
      threads.push_back(Thread{current, {}});
      continue;
    }
    Frame f;
    if (!threads.empty() && ParseFrame(l, &f)) threads.back().frames.push_back(std::move(f));
  }
  StackSummary s;
  const Thread* main = nullptr;
  for (const Thread& t : threads) {
    bool has_module = false;
    for (const Frame& f : t.frames) has_module |= f.function == "<module>";
    if (t.frames.empty()) continue;
    if (has_module && (main == nullptr || t.current)) main = &t;
  }
  if (main == nullptr) {
    for (const Thread& t : threads) {
      if (!t.frames.empty()) {
        main = &t;
        break;
      }
    }
  }
  if (main == nullptr) return s;
  s.found = true;
  const Frame& top = main->frames.front();
  s.top_frame = absl::StrCat(top.path, ":", top.line, " in ", top.function);
  for (const char* p : kCollectivePaths) s.in_collective |= absl::StrContains(top.path, p);
  return s;
}

}  // namespace ballast::health
