// TLS for the control plane (agents, `ballast status` -> the job master).
//
// The master serves TLS with --tls-cert and --tls-key (PEM); with --tls-ca
// as well it requires every client to present a certificate signed by that
// CA (mutual TLS). A client (agent, status) verifies the master's
// certificate against --tls-ca and, for mutual TLS, presents --tls-cert and
// --tls-key. The job token stays required either way. Each flag falls back
// to BALLAST_TLS_CERT / BALLAST_TLS_KEY / BALLAST_TLS_CA, so a Kubernetes
// secret or a launcher can hand them to every process.
//
// Thread safety: plain values and free functions.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"

namespace ballast {

struct TlsFiles {
  std::string cert;  // PEM certificate chain: the master's own, or a client's for mutual TLS
  std::string key;   // its PEM private key
  std::string ca;    // PEM CA bundle: a client verifies the master with it; the master, its clients
  bool on() const { return !cert.empty() || !key.empty() || !ca.empty(); }
  // Empty fields from BALLAST_TLS_CERT / BALLAST_TLS_KEY / BALLAST_TLS_CA.
  void FillFromEnv();
};

// Insecure credentials when TLS is off. kInvalidArgument naming the flag for
// a missing half of a pair (cert without key), an unreadable file or, for the
// master, TLS without a certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MasterServerCredentials(const TlsFiles& tls);
// A client needs --tls-ca to verify the master (cert and key are optional:
// mutual TLS).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MasterChannelCredentials(const TlsFiles& tls);

// A channel to the job master: its credentials, reconnect backoff a
// restarted master is found again within (<= 2 s), and the message limit.
std::shared_ptr<grpc::Channel> MasterChannel(const std::string& endpoint,
                                             std::shared_ptr<grpc::ChannelCredentials> credentials);

// A hint to add to a connection error that looks like a TLS mismatch ("" otherwise).
std::string TlsHint(const std::string& error);

}  // namespace ballast
