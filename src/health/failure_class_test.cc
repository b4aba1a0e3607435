#include "health/failure_class.h"

#include <signal.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::health {
namespace {

using ::testing::HasSubstr;

TEST(Classify, PlainExitCode) {
  FailureClass c = Classify({.exit_code = 3});
  EXPECT_EQ(c.kind, FailureKind::kExitCode);
  EXPECT_EQ(c.cause, "exit code 3");
  EXPECT_EQ(c.max_retries, -1);
}

TEST(Classify, SignalsByName) {
  EXPECT_EQ(Classify({.signal = SIGKILL}).kind, FailureKind::kKilled);
  EXPECT_EQ(Classify({.signal = SIGKILL}).cause, "killed by SIGKILL (signal 9)");
  EXPECT_EQ(Classify({.signal = SIGSEGV}).cause, "segmentation fault (killed by SIGSEGV (signal 11))");
  EXPECT_EQ(Classify({.signal = SIGSEGV}).kind, FailureKind::kSegfault);
  EXPECT_EQ(Classify({.signal = SIGBUS}).rule, "sigbus");
  EXPECT_EQ(Classify({.signal = SIGABRT}).kind, FailureKind::kAbort);
  EXPECT_EQ(Classify({.signal = SIGUSR1}).rule, "signal");
}

TEST(Classify, OomKillerBeatsPlainSigkillAndIsNotRetriedForever) {
  FailureClass c = Classify({.signal = SIGKILL, .oom_killed = true});
  EXPECT_EQ(c.kind, FailureKind::kOomKilled);
  EXPECT_THAT(c.cause, HasSubstr("OOM killer"));
  EXPECT_EQ(c.max_retries, 1);
}

TEST(Classify, CudaOutOfMemoryFromStderrWinsOverCudaError) {
  FailureClass c = Classify({.exit_code = 1,
                             .stderr_tail = "Traceback...\ntorch.cuda.OutOfMemoryError: CUDA out of memory. "
                                            "Tried to allocate 2.00 GiB\nCUDA error: out of memory"});
  EXPECT_EQ(c.kind, FailureKind::kOutOfMemory);
  EXPECT_EQ(c.rule, "cuda-oom");
  EXPECT_THAT(c.cause, HasSubstr("Tried to allocate 2.00 GiB"));
  EXPECT_EQ(c.max_retries, 1);
}

TEST(Classify, HostOutOfMemory) {
  EXPECT_EQ(Classify({.exit_code = 1, .stderr_tail = "MemoryError"}).kind, FailureKind::kOutOfMemory);
  EXPECT_EQ(Classify({.exit_code = 1, .stderr_tail = "RuntimeError: [enforce fail at alloc_cpu.cpp:75] "
                                                     "DefaultCPUAllocator: can't allocate memory"})
                .rule,
            "host-oom");
}

TEST(Classify, NcclAndCudaErrors) {
  FailureClass n = Classify({.exit_code = 1, .stderr_tail = "RuntimeError: NCCL error in: ..., unhandled system error"});
  EXPECT_EQ(n.kind, FailureKind::kNcclError);
  EXPECT_THAT(n.cause, HasSubstr("NCCL error in"));
  FailureClass c = Classify({.exit_code = 1, .stderr_tail = "RuntimeError: CUDA error: an illegal memory access"});
  EXPECT_EQ(c.kind, FailureKind::kCudaError);
  // A segfault with a CUDA message is reported as the CUDA error: more useful.
  EXPECT_EQ(Classify({.signal = SIGSEGV, .stderr_tail = "CUDA error: misaligned address"}).kind,
            FailureKind::kCudaError);
}

TEST(Classify, HangAndCheckFailureComeFromTheSupervisor) {
  FailureClass h = Classify({.signal = SIGKILL, .hang = true});
  EXPECT_EQ(h.kind, FailureKind::kHang);
  EXPECT_EQ(Classify({.check_failed = true}).cause, "failed the pre-flight check");
}

TEST(Classify, UnreachableAddressAndStoreTimeoutGetOneRetry) {
  FailureClass u = Classify({.master_addr_unreachable = true});
  EXPECT_EQ(u.kind, FailureKind::kUnreachable);
  EXPECT_EQ(u.max_retries, 1);
  EXPECT_STREQ(FailureKindName(u.kind), "unreachable");
  FailureClass t = Classify({.store_timeout = true});
  EXPECT_EQ(t.kind, FailureKind::kStoreTimeout);
  EXPECT_EQ(t.max_retries, 1);
  EXPECT_STREQ(FailureKindName(t.kind), "store-timeout");
}

TEST(Classify, LostCheckpointIsNotRetried) {
  FailureClass c = Classify({.exit_code = 1,
                             .stderr_tail = "Traceback (most recent call last):\n"
                                            "ballast.checkpoint.CheckpointLostError: ranks 0-3 hold step 17 in "
                                            "memory, but no checkpoint ... covers step 17 for ranks 4-5"});
  EXPECT_EQ(c.kind, FailureKind::kCheckpointLost);
  EXPECT_EQ(c.max_retries, 0);
  EXPECT_THAT(c.cause, ::testing::HasSubstr("ranks 0-3 hold step 17"));
  EXPECT_STREQ(FailureKindName(c.kind), "checkpoint-lost");
}

TEST(Classify, LongMatchingLineIsTrimmed) {
  std::string tail = "NCCL error " + std::string(500, 'x');
  EXPECT_LE(Classify({.exit_code = 1, .stderr_tail = tail}).cause.size(), 220u);
}

TEST(FailureKindName, Names) {
  EXPECT_STREQ(FailureKindName(FailureKind::kOomKilled), "oom-killed");
  EXPECT_STREQ(FailureKindName(FailureKind::kNcclError), "nccl-error");
}

TEST(FailureKindName, ParseIsItsInverseAndRefusesOtherText) {
  for (int k = 0; k <= static_cast<int>(FailureKind::kCheckpointLost); ++k) {
    const auto kind = static_cast<FailureKind>(k);
    EXPECT_EQ(ParseFailureKind(FailureKindName(kind)), kind) << FailureKindName(kind);
  }
  EXPECT_EQ(ParseFailureKind(""), std::nullopt);
  EXPECT_EQ(ParseFailureKind("Hang"), std::nullopt);
  EXPECT_EQ(ParseFailureKind("unknown"), std::nullopt);
}

TEST(LooksLikePeerLoss, GlooAndNcclLinesThatSayAPeerWentAway) {
  EXPECT_TRUE(LooksLikePeerLoss("Traceback\nRuntimeError: [./gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                                "[127.0.0.1]:908\n"));
  EXPECT_TRUE(LooksLikePeerLoss("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error "
                                "[10.0.0.2]:21202: Connection reset by peer"));
  EXPECT_TRUE(LooksLikePeerLoss("torch.distributed.DistBackendError: NCCL error: remote process exited or there "
                                "was a network error, NCCL version 2.21.5\nncclRemoteError: ..."));
  EXPECT_FALSE(LooksLikePeerLoss("ValueError: bad batch\n"));
  EXPECT_FALSE(LooksLikePeerLoss(""));
}

}  // namespace
}  // namespace ballast::health
