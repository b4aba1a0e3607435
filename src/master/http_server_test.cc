// The master's HTTP interface over real loopback sockets: token checks, the
// job document, the timeline long-poll, the metrics, the dashboard page.
#include "master/http_server.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "master/master_server.h"
#include "nlohmann/json.hpp"

namespace ballast::master {
namespace {

using ::testing::HasSubstr;

constexpr char kToken[] = "t0k/en+";

std::unique_ptr<MasterServer> Start(bool metrics_public, int min_nodes = 2) {
  MasterOptions o;
  o.bind_host = "127.0.0.1";
  o.advertise_host = "127.0.0.1";
  o.token = kToken;
  o.job_id = "http-job";
  o.min_nodes = min_nodes;
  o.max_nodes = 2;
  o.http_port = 0;
  o.metrics_public = metrics_public;
  auto s = MasterServer::Start(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

httplib::Headers Bearer(const std::string& token = kToken) { return {{"Authorization", "Bearer " + token}}; }

TEST(MasterHttp, EveryApiPathNeedsTheTokenButThePageDoesNot) {
  auto m = Start(false);
  ASSERT_NE(m, nullptr);
  ASSERT_GT(m->http_port(), 0);
  EXPECT_EQ(m->dashboard_url(), "http://127.0.0.1:" + std::to_string(m->http_port()) + "/?token=t0k%2Fen%2B");
  httplib::Client c("127.0.0.1", m->http_port());
  for (const char* path : {"/api/v1/job", "/api/v1/events", "/metrics"}) {
    auto none = c.Get(path);
    ASSERT_TRUE(none) << path;
    EXPECT_EQ(none->status, 401) << path;
    EXPECT_THAT(none->body, HasSubstr("Authorization: Bearer TOKEN")) << path;
    EXPECT_EQ(none->get_header_value("WWW-Authenticate"), "Bearer realm=\"ballast\"");
    auto wrong = c.Get(path, Bearer("nope"));
    ASSERT_TRUE(wrong);
    EXPECT_EQ(wrong->status, 401) << path;
    auto ok = c.Get(path, Bearer());
    ASSERT_TRUE(ok);
    EXPECT_EQ(ok->status, 200) << path;
  }
  auto page = c.Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_THAT(page->get_header_value("Content-Type"), HasSubstr("text/html"));
  EXPECT_THAT(page->body, HasSubstr("id=\"goodput\""));
  EXPECT_THAT(page->body, HasSubstr("</html>"));  // the whole page, not a chunk of it
  auto missing = c.Get("/nope", Bearer());
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_THAT(missing->body, HasSubstr("/api/v1/job"));
}

TEST(MasterHttp, MetricsPublicOpensOnlyTheMetrics) {
  auto m = Start(true);
  ASSERT_NE(m, nullptr);
  httplib::Client c("127.0.0.1", m->http_port());
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_THAT(metrics->get_header_value("Content-Type"), HasSubstr("version=0.0.4"));
  EXPECT_THAT(metrics->body, HasSubstr("ballast_info{job_id=\"http-job\",state=\"rendezvous\"} 1"));
  EXPECT_THAT(metrics->body, HasSubstr("ballast_round 0"));
  auto job = c.Get("/api/v1/job");
  ASSERT_TRUE(job);
  EXPECT_EQ(job->status, 401);
}

TEST(MasterHttp, JobIsTheStatusDocumentAndEventsLongPoll) {
  auto m = Start(false, 1);
  ASSERT_NE(m, nullptr);
  httplib::Client c("127.0.0.1", m->http_port());
  c.set_read_timeout(10, 0);
  auto job = c.Get("/api/v1/job", Bearer());
  ASSERT_TRUE(job);
  nlohmann::json doc = nlohmann::json::parse(job->body);
  EXPECT_EQ(doc["job_id"], "http-job");
  EXPECT_EQ(doc["state"], "rendezvous");
  EXPECT_EQ(doc["round"], "0");  // int64 fields are strings in proto JSON
  EXPECT_TRUE(doc["goodput"].contains("parts"));
  EXPECT_TRUE(doc.contains("failures"));

  auto none_yet = c.Get("/api/v1/events?after=0", Bearer());
  ASSERT_TRUE(none_yet);
  EXPECT_EQ(nlohmann::json::parse(none_yet->body)["events"].size(), 0u);
  EXPECT_EQ(c.Get("/api/v1/events?after=x", Bearer())->status, 400);
  EXPECT_EQ(c.Get("/api/v1/events?wait=-1", Bearer())->status, 400);
  // A long-poll waiting for the first event wakes when a node joins.
  std::thread join([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    m->Abort("stopped by the test");
  });
  auto t0 = std::chrono::steady_clock::now();
  auto ev = c.Get("/api/v1/events?after=0&wait=8", Bearer());
  join.join();
  ASSERT_TRUE(ev);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  nlohmann::json events = nlohmann::json::parse(ev->body);
  ASSERT_EQ(events["events"].size(), 1u);
  EXPECT_EQ(events["events"][0]["kind"], "finished");
  EXPECT_THAT(events["events"][0]["message"].get<std::string>(), HasSubstr("stopped by the test"));
  EXPECT_EQ(events["last_seq"], 1);
}

TEST(MasterHttp, LongPollsBeyondTheCapAreAnsweredAtOnce) {
  auto m = Start(false);
  ASSERT_NE(m, nullptr);
  // 12 ask to wait; 8 may: the other 4 are answered at once (no events yet),
  // the 8 when the job's next event comes.
  std::atomic<int> fast_empty{0}, got_event{0};
  std::vector<std::thread> polls;
  for (int i = 0; i < 12; ++i) {
    polls.emplace_back([&] {
      httplib::Client c("127.0.0.1", m->http_port());
      c.set_read_timeout(30, 0);
      auto r = c.Get("/api/v1/events?after=0&wait=20", Bearer());
      ASSERT_TRUE(r && r->status == 200);
      if (nlohmann::json::parse(r->body)["events"].empty()) {
        ++fast_empty;
      } else {
        ++got_event;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));
  httplib::Client c("127.0.0.1", m->http_port());
  auto status = c.Get("/api/v1/job", Bearer());  // a thread is free for it meanwhile
  ASSERT_TRUE(status);
  EXPECT_EQ(status->status, 200);
  EXPECT_EQ(fast_empty.load(), 4);
  m->Abort("done waiting");  // an event: every waiting long-poll returns
  for (auto& t : polls) t.join();
  EXPECT_EQ(fast_empty.load(), 4);
  EXPECT_EQ(got_event.load(), 8);
}

TEST(MasterHttp, ABusyPortIsAClearErrorUnlessItWasADefault) {
  auto first = Start(false);
  ASSERT_NE(first, nullptr);
  MasterOptions o;
  o.bind_host = "127.0.0.1";
  o.token = kToken;
  o.http_port = first->http_port();
  auto second = MasterServer::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("--http-port"));
  o.http_port_is_default = true;  // beside the gRPC port, not asked for: any free port instead
  auto third = MasterServer::Start(o);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_GT((*third)->http_port(), 0);
  EXPECT_NE((*third)->http_port(), first->http_port());
}

}  // namespace
}  // namespace ballast::master
