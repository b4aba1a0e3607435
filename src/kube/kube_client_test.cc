// The Kubernetes client against a fake API server (cpp-httplib on loopback):
// what the API server answers is scripted, what the client makes of it is
// checked. The real API server is exercised by tests/kubernetes/.
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "kube/informer.h"
#include "kube/kube_client.h"

namespace ballast::kube {
namespace {

using ::testing::HasSubstr;

class FakeApiServer {
 public:
  FakeApiServer() {
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) usleep(1000);
  }
  ~FakeApiServer() {
    server_.stop();
    thread_.join();
  }
  httplib::Server& server() { return server_; }
  KubeClient Client() {
    KubeConfig c;
    c.server = "http://127.0.0.1:" + std::to_string(port_);
    c.token = "t0ken";
    return KubeClient(c);
  }

 private:
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
};

std::string StatusBody(int code, const std::string& reason, const std::string& message) {
  return Json{{"kind", "Status"}, {"apiVersion", "v1"}, {"status", "Failure"},
              {"code", code},     {"reason", reason},   {"message", message}}
      .dump();
}

TEST(KubeClient, SendsTokenAndBodyAndParsesTheAnswer) {
  FakeApiServer fake;
  std::string auth, body, ctype;
  fake.server().Post("/api/v1/namespaces/ns/pods", [&](const httplib::Request& req, httplib::Response& res) {
    auth = req.get_header_value("Authorization");
    ctype = req.get_header_value("Content-Type");
    body = req.body;
    res.status = 201;
    res.set_content(R"({"metadata":{"name":"p","resourceVersion":"7"}})", "application/json");
  });
  KubeClient c = fake.Client();
  auto r = c.Create(CollectionPath("v1", "pods", "ns"), Json{{"metadata", {{"name", "p"}}}}, "create pod ns/p");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Str(*r, {"metadata", "resourceVersion"}), "7");
  EXPECT_EQ(auth, "Bearer t0ken");
  EXPECT_EQ(ctype, "application/json");
  EXPECT_EQ(Json::parse(body)["metadata"]["name"], "p");
}

TEST(KubeClient, ApiErrorsGetCodesByWhatToDoAndNameTheObjectAndVerb) {
  FakeApiServer fake;
  fake.server().Get("/api/v1/namespaces/ns/pods/gone", [](const httplib::Request&, httplib::Response& res) {
    res.status = 404;
    res.set_content(StatusBody(404, "NotFound", "pods \"gone\" not found"), "application/json");
  });
  fake.server().Post("/api/v1/namespaces/ns/pods", [](const httplib::Request&, httplib::Response& res) {
    res.status = 409;
    res.set_content(StatusBody(409, "AlreadyExists", "pods \"p\" already exists"), "application/json");
  });
  fake.server().Put("/api/v1/namespaces/ns/pods/p", [](const httplib::Request&, httplib::Response& res) {
    res.status = 409;
    res.set_content(StatusBody(409, "Conflict", "the object has been modified"), "application/json");
  });
  fake.server().Delete("/api/v1/namespaces/ns/pods/p", [](const httplib::Request&, httplib::Response& res) {
    res.status = 403;
    res.set_content(StatusBody(403, "Forbidden", "pods \"p\" is forbidden: User \"x\" cannot delete"),
                    "application/json");
  });
  fake.server().Patch("/api/v1/namespaces/ns/pods/p", [](const httplib::Request&, httplib::Response& res) {
    res.status = 503;
    res.set_content("upstream down", "text/plain");
  });
  KubeClient c = fake.Client();
  auto g = c.Get(ObjectPath("v1", "pods", "ns", "gone"), "get pod ns/gone");
  EXPECT_EQ(g.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(g.status().message(), "get pod ns/gone: HTTP 404 NotFound: pods \"gone\" not found");
  EXPECT_EQ(HttpStatus(g.status()), 404);
  EXPECT_EQ(c.Create(CollectionPath("v1", "pods", "ns"), Json::object(), "create pod ns/p").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(c.Replace(ObjectPath("v1", "pods", "ns", "p"), Json::object(), "update pod ns/p").status().code(),
            absl::StatusCode::kAborted);
  auto d = c.Delete(ObjectPath("v1", "pods", "ns", "p"), Json{{"gracePeriodSeconds", 0}}, "delete pod ns/p");
  EXPECT_EQ(d.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("delete pod ns/p: HTTP 403 Forbidden"));
  auto p = c.Patch(ObjectPath("v1", "pods", "ns", "p"), Json::object(), "patch pod ns/p");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("upstream down"));
}

TEST(KubeClient, UnreachableServerIsUnavailableNamingTheServer) {
  KubeConfig cfg;
  cfg.server = "http://127.0.0.1:1";
  KubeClient c(cfg);
  auto r = c.Get("/api/v1/pods", "list pods");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("list pods: cannot reach the Kubernetes API server at http://127.0.0.1:1"));
}

TEST(KubeClient, WatchDeliversEventsLineByLineAcrossChunks) {
  FakeApiServer fake;
  fake.server().Get("/api/v1/pods", [](const httplib::Request& req, httplib::Response& res) {
    ASSERT_EQ(req.get_param_value("watch"), "1");
    res.set_chunked_content_provider("application/json", [](size_t, httplib::DataSink& sink) {
      std::string a = R"({"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"2"}}})";
      std::string b = "\n{\"type\":\"BOOKMARK\",\"object\":{\"metadata\":{\"resourceVersion\":\"3\"}}}\n";
      sink.write(a.data(), 20);  // an event split across writes
      sink.write(a.data() + 20, a.size() - 20);
      sink.write(b.data(), b.size());
      sink.done();
      return true;
    });
  });
  KubeClient c = fake.Client();
  std::vector<std::string> seen;
  absl::Status s = c.Watch("/api/v1/pods?watch=1", "watch pods", [&](const WatchEvent& e) {
    seen.push_back(e.type + ":" + Str(e.object, {"metadata", "resourceVersion"}));
    return true;
  }, nullptr);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(seen, (std::vector<std::string>{"ADDED:2", "BOOKMARK:3"}));
}

// A fake collection for the informer: a list answer and a scripted watch.
struct FakeCollection {
  std::mutex mu;
  Json items = Json::array();
  std::string list_rv = "10";
  std::vector<std::string> watch_rvs;  // resourceVersions the watches asked for
  std::vector<std::string> watch_script;  // lines of the next watch; then it ends
};

TEST(Informer, ListsThenWatchesAndRelistsOnGoneDeliveringTheDifference) {
  FakeApiServer fake;
  FakeCollection col;
  col.items = Json::array({Json{{"metadata", {{"name", "a"}, {"namespace", "ns"}, {"resourceVersion", "5"}}}},
                           Json{{"metadata", {{"name", "b"}, {"namespace", "ns"}, {"resourceVersion", "6"}}}}});
  int watch_calls = 0;
  fake.server().Get("/api/v1/namespaces/ns/pods", [&](const httplib::Request& req, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(col.mu);
    EXPECT_EQ(req.get_param_value("labelSelector"), "app=x");
    if (req.get_param_value("watch") != "1") {
      res.set_content(Json{{"kind", "PodList"}, {"metadata", {{"resourceVersion", col.list_rv}}}, {"items", col.items}}
                          .dump(),
                      "application/json");
      return;
    }
    EXPECT_EQ(req.get_param_value("allowWatchBookmarks"), "true");
    col.watch_rvs.push_back(req.get_param_value("resourceVersion"));
    std::string body;
    if (++watch_calls == 1) {
      // A change, then "too old": the informer relists.
      body = R"({"type":"MODIFIED","object":{"metadata":{"name":"a","namespace":"ns","resourceVersion":"11"}}})"
             "\n"
             R"({"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired","message":"too old"}})"
             "\n";
      // Meanwhile b was deleted and c created, unseen by the watch.
      col.items = Json::array({Json{{"metadata", {{"name", "a"}, {"namespace", "ns"}, {"resourceVersion", "11"}}}},
                               Json{{"metadata", {{"name", "c"}, {"namespace", "ns"}, {"resourceVersion", "12"}}}}});
      col.list_rv = "12";
    } else {
      usleep(200 * 1000);  // an idle stream the informer ends by Stop()
    }
    res.set_content(body, "application/json");
  });
  KubeClient client = fake.Client();
  std::mutex mu;
  std::vector<std::string> events;
  Informer inf(&client, {CollectionPath("v1", "pods", "ns"), "app=x", "", "pods", 60},
               [&](const std::string& type, const Json& obj) {
                 std::lock_guard<std::mutex> lock(mu);
                 events.push_back(type + " " + Str(obj, {"metadata", "name"}) + "@" +
                                  Str(obj, {"metadata", "resourceVersion"}));
               });
  inf.Start();
  ASSERT_TRUE(inf.WaitForSync(10));
  for (int i = 0; i < 100 && inf.lists() < 2; ++i) usleep(50 * 1000);
  for (int i = 0; i < 100 && inf.watches() < 3; ++i) usleep(50 * 1000);
  inf.Stop();
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(events, (std::vector<std::string>{"ADDED a@5", "ADDED b@6", "MODIFIED a@11", "DELETED b@6",
                                              "ADDED c@12"}));
  std::lock_guard<std::mutex> lock2(col.mu);
  ASSERT_GE(col.watch_rvs.size(), 2u);
  EXPECT_EQ(col.watch_rvs[0], "10");  // from the list
  EXPECT_EQ(col.watch_rvs[1], "12");  // from the relist
  EXPECT_TRUE(inf.Get("ns/c").has_value());
  EXPECT_FALSE(inf.Get("ns/b").has_value());
}

TEST(KubeConfig, KubeconfigWithTokenAndCaFileRelativeToIt) {
  auto dir = std::filesystem::temp_directory_path() / ("kubecfg-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "ca.crt") << "PEM";
  std::ofstream(dir / "config") << R"(apiVersion: v1
kind: Config
current-context: test
clusters:
- name: c1
  cluster:
    server: https://127.0.0.1:6443/
    certificate-authority: ca.crt
users:
- name: u1
  user:
    token: abc
contexts:
- name: test
  context:
    cluster: c1
    user: u1
    namespace: team-a
)";
  auto cfg = KubeConfig::FromKubeconfig((dir / "config").string());
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->server, "https://127.0.0.1:6443");
  EXPECT_EQ(cfg->token, "abc");
  EXPECT_EQ(cfg->ca_file, (dir / "ca.crt").string());
  EXPECT_EQ(cfg->namespace_name, "team-a");
  auto missing = KubeConfig::FromKubeconfig((dir / "config").string(), "nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("no context 'nope'"));
  std::filesystem::remove_all(dir);
}

TEST(KubePaths, CoreAndGroupCollections) {
  EXPECT_EQ(CollectionPath("v1", "pods", "ns"), "/api/v1/namespaces/ns/pods");
  EXPECT_EQ(CollectionPath("v1", "nodes", ""), "/api/v1/nodes");
  EXPECT_EQ(ObjectPath("ballast.dev/v1alpha1", "elasticjobs", "ns", "j"),
            "/apis/ballast.dev/v1alpha1/namespaces/ns/elasticjobs/j");
  EXPECT_EQ(UrlEncode("a=b,c!=d"), "a%3Db%2Cc%21%3Dd");
}

}  // namespace
}  // namespace ballast::kube
