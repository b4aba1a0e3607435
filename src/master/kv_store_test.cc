#include "master/kv_store.h"

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/limits.h"
#include "gtest/gtest.h"

namespace ballast::master {
namespace {

struct Log {
  std::vector<std::pair<std::string, absl::StatusOr<std::string>>> got;
  KvStore::Callback Cb(std::string name) {
    return [this, name](absl::StatusOr<std::string> v) { got.emplace_back(name, std::move(v)); };
  }
};

TEST(KvStore, EachWaiterIsAnsweredOnceBySetDeadlineCancelOrTheEnd) {
  KvStore kv;
  Log log;
  const absl::Time t0 = absl::Now();
  kv.AddWaiter("k", t0 + absl::Seconds(10), log.Cb("set1"));
  kv.AddWaiter("k", t0 + absl::Seconds(10), log.Cb("set2"));
  kv.AddWaiter("other", t0 + absl::Seconds(1), log.Cb("deadline"));
  const uint64_t cancelled = kv.AddWaiter("other", t0 + absl::Seconds(10), log.Cb("cancel"));
  kv.AddWaiter("never", t0 + absl::Seconds(10), log.Cb("end"));
  EXPECT_EQ(kv.waiters(), 5u);

  KvStore::Answers answers;
  ASSERT_TRUE(kv.Set("k", "v", &answers).ok());
  EXPECT_EQ(answers.size(), 2u);
  kv.TakeExpired(t0 + absl::Seconds(2), &answers);
  EXPECT_EQ(answers.size(), 3u);
  KvStore::Callback c = kv.TakeWaiter(cancelled);
  ASSERT_TRUE(c);
  EXPECT_FALSE(kv.TakeWaiter(cancelled));  // once only
  kv.TakeAll(absl::UnavailableError("end"), &answers);
  EXPECT_EQ(kv.waiters(), 0u);
  KvStore::RunAnswers(&answers);
  EXPECT_TRUE(answers.empty());
  ASSERT_EQ(log.got.size(), 4u);
  EXPECT_EQ(*log.got[0].second, "v");
  EXPECT_EQ(*log.got[1].second, "v");
  EXPECT_EQ(log.got[2].second.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(log.got[3].first, "end");
  EXPECT_EQ(log.got[3].second.status().code(), absl::StatusCode::kUnavailable);
  ASSERT_NE(kv.Find("k"), nullptr);
  EXPECT_EQ(kv.Find("nope"), nullptr);
}

TEST(KvStore, SizesAndTheKeyCountAreBounded) {
  EXPECT_EQ(KvStore::CheckEntry("", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvStore::CheckEntry(std::string(kMaxKvKeyBytes + 1, 'k'), "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvStore::CheckEntry("k", std::string(kMaxKvValueBytes + 1, 'v')).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(KvStore::CheckEntry("k", std::string(kMaxKvValueBytes, 'v')).ok());
  KvStore kv;
  KvStore::Answers none;
  for (size_t i = 0; i < kMaxKvKeys; ++i) ASSERT_TRUE(kv.Set(std::to_string(i), "", &none).ok());
  absl::Status full = kv.Set("one more", "", &none);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("200000 keys"), std::string::npos) << full;
  EXPECT_TRUE(kv.Set("7", "overwrite is fine", &none).ok());
}

}  // namespace
}  // namespace ballast::master
