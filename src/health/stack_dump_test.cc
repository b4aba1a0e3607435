#include "health/stack_dump.h"

#include "gtest/gtest.h"

namespace ballast::health {
namespace {

// Real dumps (faulthandler, SIGUSR1) of a 2-rank gloo DDP job in which rank 1
// sleeps at step 2: rank 0 waits in backward for the gradient allreduce.
constexpr char kWaitingRank[] =
    "Current thread 0x00007f8489e282c0 (most recent call first):\n"
    "  File \"/usr/lib/python3/dist-packages/torch/autograd/__init__.py\", line 197 in backward\n"
    "  File \"/usr/lib/python3/dist-packages/torch/_tensor.py\", line 488 in backward\n"
    "  File \"/tmp/stk/w.py\", line 12 in <module>\n";
constexpr char kHungRank[] =
    "Current thread 0x00007f7b45a012c0 (most recent call first):\n"
    "  File \"/tmp/stk/w.py\", line 10 in <module>\n";

TEST(StackDump, RankWaitingInBackwardIsInACollective) {
  StackSummary s = SummarizeStackDump(kWaitingRank);
  EXPECT_TRUE(s.found);
  EXPECT_TRUE(s.in_collective);
  EXPECT_EQ(s.top_frame, "/usr/lib/python3/dist-packages/torch/autograd/__init__.py:197 in backward");
}

TEST(StackDump, HungRankIsNotInACollective) {
  StackSummary s = SummarizeStackDump(kHungRank);
  EXPECT_TRUE(s.found);
  EXPECT_FALSE(s.in_collective);
  EXPECT_EQ(s.top_frame, "/tmp/stk/w.py:10 in <module>");
}

TEST(StackDump, MainThreadIsTheOneReachingModule) {
  std::string text =
      "some earlier output line\n"
      "Thread 0x00007f0000000001 (most recent call first):\n"
      "  File \"/usr/lib/python3.11/threading.py\", line 320 in wait\n"
      "  File \"/usr/lib/python3.11/threading.py\", line 1002 in _bootstrap\n"
      "\n"
      "Thread 0x00007f0000000002 (most recent call first):\n"
      "  File \"/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py\", line 1536 in all_reduce\n"
      "  File \"/job/train.py\", line 40 in step\n"
      "  File \"/job/train.py\", line 80 in <module>\n";
  StackSummary s = SummarizeStackDump(text);
  EXPECT_TRUE(s.in_collective);
  EXPECT_EQ(s.top_frame, "/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py:1536 in all_reduce");
}

TEST(StackDump, NoDumpIsNotFound) {
  EXPECT_FALSE(SummarizeStackDump("").found);
  EXPECT_FALSE(SummarizeStackDump("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n").found);
}

}  // namespace
}  // namespace ballast::health
