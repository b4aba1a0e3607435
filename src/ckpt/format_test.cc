#include "ckpt/format.h"

#include <random>

#include "ckpt/checksum.h"
#include "ckpt/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ballast::ckpt {
namespace {

using ::testing::HasSubstr;
using test_util::BuildImage;
using test_util::State;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(CkptChecksum64, AppendOfPartsEqualsWholeForAnySplit) {
  auto data = RandomBytes(64 * 100 + 17, 1);
  const uint64_t whole = ChecksumBytes(data.data(), data.size());
  for (size_t split : {0, 64, 640, 64 * 99, 64 * 100}) {
    Checksum64 a, b;
    a.Update(data.data(), split);
    b.Update(data.data() + split, data.size() - split);
    a.Append(b);
    EXPECT_EQ(a.Digest(), whole) << "split " << split;
  }
  Checksum64 three[3];
  three[0].Update(data.data(), 128);
  three[1].Update(data.data() + 128, 64 * 50);
  three[2].Update(data.data() + 128 + 64 * 50, data.size() - 128 - 64 * 50);
  Checksum64 total;
  for (auto& c : three) total.Append(c);
  EXPECT_EQ(total.Digest(), whole);
}

TEST(CkptChecksum64, DetectsEverySingleBitFlipAndLengthChange) {
  auto data = RandomBytes(1000, 2);
  const uint64_t base = ChecksumBytes(data.data(), data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      data[i] ^= static_cast<uint8_t>(1u << bit);
      ASSERT_NE(ChecksumBytes(data.data(), data.size()), base) << i << ":" << bit;
      data[i] ^= static_cast<uint8_t>(1u << bit);
    }
  }
  // Zero padding of the last row does not hide a length change.
  std::vector<uint8_t> zeros(100, 0);
  EXPECT_NE(ChecksumBytes(zeros.data(), 100), ChecksumBytes(zeros.data(), 99));
  EXPECT_NE(ChecksumBytes(zeros.data(), 64), ChecksumBytes(zeros.data(), 0));
}

TEST(CkptChecksum64, DetectsSwappedWords) {
  auto data = RandomBytes(64 * 4, 3);
  const uint64_t base = ChecksumBytes(data.data(), data.size());
  std::swap_ranges(data.begin(), data.begin() + 8, data.begin() + 64);  // same lane, rows 0/1
  EXPECT_NE(ChecksumBytes(data.data(), data.size()), base);
}

TEST(CkptDType, SizesAndNamesRoundTrip) {
  const std::pair<DType, size_t> expected[] = {
      {DType::kFloat32, 4},    {DType::kFloat64, 8},     {DType::kFloat16, 2},
      {DType::kBFloat16, 2},   {DType::kComplex32, 4},   {DType::kComplex64, 8},
      {DType::kComplex128, 16}, {DType::kUInt8, 1},      {DType::kInt8, 1},
      {DType::kInt16, 2},      {DType::kInt32, 4},       {DType::kInt64, 8},
      {DType::kBool, 1},       {DType::kUInt16, 2},      {DType::kUInt32, 4},
      {DType::kUInt64, 8},     {DType::kFloat8E4M3FN, 1}, {DType::kFloat8E5M2, 1},
      {DType::kBlob, 1}};
  for (auto [dtype, size] : expected) {
    EXPECT_EQ(DTypeSize(dtype), size) << DTypeName(dtype);
    EXPECT_EQ(*DTypeFromName(DTypeName(dtype)), dtype);
  }
  EXPECT_EQ(*DTypeFromName("torch.bfloat16"), DType::kBFloat16);
  EXPECT_EQ(DTypeFromName("float128").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(IsValidDType(200));
}

TEST(CkptPlanLayout, AlignsEveryEntryTo64Bytes) {
  std::vector<Entry> entries = {
      {"a", DType::kUInt8, {3}, 0, 3},
      {"b", DType::kFloat64, {2, 5}, 0, 80},
      {"c", DType::kBlob, {}, 0, 1},
      {"empty", DType::kFloat32, {0, 7}, 0, 0},
      {"d", DType::kInt16, {}, 0, 2},
  };
  absl::StatusOr<Layout> layout = PlanLayout(&entries);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(entries[0].offset, 0u);
  EXPECT_EQ(entries[1].offset, 64u);
  EXPECT_EQ(entries[2].offset, 192u);
  EXPECT_EQ(entries[3].offset, 256u);
  EXPECT_EQ(entries[4].offset, 256u);
  EXPECT_EQ(layout->data_bytes, 320u);
  EXPECT_EQ(layout->data_offset % 64, 0u);
  EXPECT_EQ(layout->index_bytes, SerializedIndexSize(entries));
  EXPECT_EQ(layout->image_bytes, layout->data_offset + 320);
}

TEST(CkptPlanLayout, RejectsInconsistentEntries) {
  auto code = [](std::vector<Entry> e) { return PlanLayout(&e).status(); };
  EXPECT_THAT(code({{"x", DType::kFloat32, {2}, 0, 7}}).message(), HasSubstr("does not match"));
  EXPECT_THAT(code({{"x", DType::kUInt8, {1}, 0, 1}, {"x", DType::kUInt8, {1}, 0, 1}}).message(),
              HasSubstr("duplicate"));
  EXPECT_EQ(code({{"", DType::kUInt8, {1}, 0, 1}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{"b", DType::kBlob, {4}, 0, 4}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{"n", DType::kUInt8, {-1}, 0, 0}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{"o", DType::kInt64, {INT64_MAX, 4}, 0, 0}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{"t", static_cast<DType>(99), {1}, 0, 1}}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CkptIndex, SerializeParseRoundTrip) {
  std::vector<Entry> entries = {
      {"model.layers.0.weight", DType::kBFloat16, {4096, 11008}, 0, 4096ULL * 11008 * 2},
      {"optim/step", DType::kInt64, {}, 0, 8},
      {"rng", DType::kBlob, {}, 0, 5000},
      {"\xc3\xa9t\xc3\xa9", DType::kComplex128, {1, 0, 3}, 0, 0},
  };
  Layout layout = *PlanLayout(&entries);
  std::string index = SerializeIndex(entries);
  ASSERT_EQ(index.size(), layout.index_bytes);
  auto parsed = ParseIndex(reinterpret_cast<const uint8_t*>(index.data()), index.size(),
                           entries.size(), layout.data_bytes, "t");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    EXPECT_EQ((*parsed)[i].key, entries[i].key);
    EXPECT_EQ((*parsed)[i].dtype, entries[i].dtype);
    EXPECT_EQ((*parsed)[i].shape, entries[i].shape);
    EXPECT_EQ((*parsed)[i].offset, entries[i].offset);
    EXPECT_EQ((*parsed)[i].nbytes, entries[i].nbytes);
  }
}

TEST(CkptIndex, DataRangeBeyondDataSizeIsDataLossWithPosition) {
  std::vector<Entry> entries = {{"a", DType::kUInt8, {64}, 0, 64}, {"b", DType::kUInt8, {10}, 0, 10}};
  Layout layout = *PlanLayout(&entries);
  std::string index = SerializeIndex(entries);
  auto parsed = ParseIndex(reinterpret_cast<const uint8_t*>(index.data()), index.size(), 2,
                           /*data_bytes=*/70, "file.ballast");
  ASSERT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("checkpoint file.ballast is corrupt: entry 1 data range [64,74) exceeds "
                        "data size 70"));
  (void)layout;
}

TEST(CkptImage, AllDTypesAndOddShapesRoundTripByteExact) {
  State state;
  uint8_t seed = 1;
  for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                   DType::kComplex32, DType::kComplex64, DType::kComplex128, DType::kUInt8,
                   DType::kInt8, DType::kInt16, DType::kInt32, DType::kInt64, DType::kBool,
                   DType::kUInt16, DType::kUInt32, DType::kUInt64, DType::kFloat8E4M3FN,
                   DType::kFloat8E5M2}) {
    for (const std::vector<int64_t>& shape :
         std::vector<std::vector<int64_t>>{{}, {0}, {1}, {3, 5, 7}, {2, 0, 4}, {1, 1, 1, 1, 13}}) {
      state.Add(absl::StrCat(DTypeName(dt), "/", shape.size(), "/", seed), dt, shape, seed);
      ++seed;
    }
  }
  state.Add("blob", DType::kBlob, {}, 777, 9);
  state.Add("empty_blob", DType::kBlob, {}, 0, 9);
  std::vector<uint8_t> image = BuildImage(42, state.views);
  auto parsed = ParseImage(image.data(), image.size(), "mem");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->header.step, 42u);
  ASSERT_EQ(parsed->entries.size(), state.views.size());
  for (size_t i = 0; i < state.views.size(); ++i) {
    const Entry& e = parsed->entries[i];
    EXPECT_EQ(e.key, state.views[i].key);
    EXPECT_EQ(e.shape, state.views[i].shape);
    EXPECT_EQ(e.dtype, state.views[i].dtype);
    ASSERT_EQ(e.nbytes, state.views[i].nbytes);
    EXPECT_EQ(e.offset % kDataAlignment, 0u);
    if (e.nbytes > 0) {
      EXPECT_EQ(std::memcmp(parsed->data + e.offset, state.buffers[i].data(), e.nbytes), 0)
          << e.key;
    }
  }
}

TEST(CkptImage, EmptyStateRoundTrips) {
  std::vector<uint8_t> image = BuildImage(7, {});
  auto parsed = ParseImage(image.data(), image.size(), "mem");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->header.step, 7u);
  EXPECT_TRUE(parsed->entries.empty());
}

class CkptCorruptImage : public ::testing::Test {
 protected:
  void SetUp() override {
    state_.Add("w", DType::kFloat32, {16, 16}, 1);
    state_.Add("b", DType::kBlob, {}, 100, 2);
    image_ = BuildImage(5, state_.views);
  }
  absl::Status Parse(const std::vector<uint8_t>& img) {
    return ParseImage(img.data(), img.size(), "x.ballast").status();
  }
  State state_;
  std::vector<uint8_t> image_;
};

TEST_F(CkptCorruptImage, EachKindGivesDataLossWithClearMessage) {
  ASSERT_TRUE(Parse(image_).ok());
  auto expect = [&](std::vector<uint8_t> img, const char* text) {
    absl::Status s = Parse(img);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << text;
    EXPECT_THAT(s.message(), HasSubstr(text));
    EXPECT_THAT(s.message(), HasSubstr("x.ballast"));
  };
  auto img = image_;
  img[0] = 'X';
  expect(img, "bad magic");
  img = image_;
  img[20] ^= 1;  // step
  expect(img, "header checksum mismatch");
  img = image_;
  img[kHeaderBytes + 2] ^= 1;  // index
  expect(img, "index checksum mismatch");
  img = image_;
  img.back() ^= 0x80;
  expect(img, "data checksum mismatch");
  expect(std::vector<uint8_t>(image_.begin(), image_.begin() + 100), "truncated");
  expect(std::vector<uint8_t>(image_.begin(), image_.end() - 1), "truncated");
  expect({}, "truncated: 0 bytes");
  img = image_;
  img.push_back(0);
  expect(img, "unexpected bytes");
}

TEST_F(CkptCorruptImage, NewerFormatVersionSaysToUpgrade) {
  auto img = image_;
  img[8] = 9;
  // Reseal the header so the version check is what fails.
  uint64_t sum = ChecksumBytes(img.data(), 120);
  std::memcpy(img.data() + 120, &sum, 8);
  absl::Status s = Parse(img);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("newer Ballast"));
}

}  // namespace
}  // namespace ballast::ckpt
