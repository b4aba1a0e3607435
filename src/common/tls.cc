#include "common/tls.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/limits.h"

namespace ballast {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read the file (pass a readable PEM file)"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string pem = ss.str();
  if (pem.find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": not a PEM file (no -----BEGIN line)"));
  }
  return pem;
}

// Both of cert and key, or neither.
absl::Status CheckPair(const TlsFiles& tls) {
  if (tls.cert.empty() != tls.key.empty()) {
    return absl::InvalidArgumentError(tls.cert.empty() ? "--tls-key needs --tls-cert (its certificate)"
                                                       : "--tls-cert needs --tls-key (its private key)");
  }
  return absl::OkStatus();
}

}  // namespace

void TlsFiles::FillFromEnv() {
  auto fill = [](std::string* field, const char* var) {
    if (!field->empty()) return;
    if (const char* v = std::getenv(var); v != nullptr) *field = v;
  };
  fill(&cert, "BALLAST_TLS_CERT");
  fill(&key, "BALLAST_TLS_KEY");
  fill(&ca, "BALLAST_TLS_CA");
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MasterServerCredentials(const TlsFiles& tls) {
  if (!tls.on()) return grpc::InsecureServerCredentials();
  if (absl::Status s = CheckPair(tls); !s.ok()) return s;
  if (tls.cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls-ca on the master (mutual TLS) needs its own --tls-cert and --tls-key as well");
  }
  grpc::SslServerCredentialsOptions opts(tls.ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                        : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert = ReadPem("--tls-cert", tls.cert);
  if (!cert.ok()) return cert.status();
  auto key = ReadPem("--tls-key", tls.key);
  if (!key.ok()) return key.status();
  pair.cert_chain = *cert;
  pair.private_key = *key;
  opts.pem_key_cert_pairs.push_back(std::move(pair));
  if (!tls.ca.empty()) {
    auto ca = ReadPem("--tls-ca", tls.ca);
    if (!ca.ok()) return ca.status();
    opts.pem_root_certs = *ca;
  }
  return grpc::SslServerCredentials(opts);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MasterChannelCredentials(const TlsFiles& tls) {
  if (!tls.on()) return grpc::InsecureChannelCredentials();
  if (absl::Status s = CheckPair(tls); !s.ok()) return s;
  if (tls.ca.empty()) {
    return absl::InvalidArgumentError(
        "TLS to the master needs --tls-ca (the CA that signed the master's certificate, or that certificate itself)");
  }
  grpc::SslCredentialsOptions opts;
  auto ca = ReadPem("--tls-ca", tls.ca);
  if (!ca.ok()) return ca.status();
  opts.pem_root_certs = *ca;
  if (!tls.cert.empty()) {
    auto cert = ReadPem("--tls-cert", tls.cert);
    if (!cert.ok()) return cert.status();
    auto key = ReadPem("--tls-key", tls.key);
    if (!key.ok()) return key.status();
    opts.pem_cert_chain = *cert;
    opts.pem_private_key = *key;
  }
  return grpc::SslCredentials(opts);
}

std::shared_ptr<grpc::Channel> MasterChannel(const std::string& endpoint,
                                             std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments args;
  // gRPC's default reconnect backoff grows to minutes; a restarted master must
  // be found again within our own 2 s backoff.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // Despite its name, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is how long a
  // connection attempt (TCP connect, TLS handshake, HTTP/2 settings) may take
  // at least before gRPC abandons it. It was 100 ms here: on a loaded machine
  // a TLS handshake takes longer, was cut off ("handshaker shutdown"), and
  // every retry started a new one, so an agent never reached a master that
  // was there (and reported it unreachable instead of its answer). gRPC's
  // default (20 s), stated here so nobody lowers it for a faster reconnect:
  // the backoff above is what sets that.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 20000);
  args.SetMaxReceiveMessageSize(static_cast<int>(kMaxMessageBytes));
  args.SetMaxSendMessageSize(static_cast<int>(kMaxMessageBytes));
  return grpc::CreateCustomChannel(endpoint, credentials != nullptr ? credentials : grpc::InsecureChannelCredentials(),
                                   args);
}

std::string TlsHint(const std::string& error) {
  const std::string e = absl::AsciiStrToLower(error);
  if (absl::StrContains(e, "handshake") || absl::StrContains(e, "ssl") || absl::StrContains(e, "tls") ||
      absl::StrContains(e, "certificate")) {
    return " (a TLS handshake failed: does the master serve TLS, and do --tls-ca/--tls-cert/--tls-key or "
           "BALLAST_TLS_* match its certificate and CA?)";
  }
  return "";
}

}  // namespace ballast
