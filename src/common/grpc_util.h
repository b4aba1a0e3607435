// absl::Status <-> grpc::Status (same code set, passed through unchanged) and
// the token metadata every RPC carries.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/status/status.h"

namespace ballast {

// gRPC metadata key that carries the job token on every RPC.
inline constexpr char kTokenMetadataKey[] = "x-ballast-token";

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// The token a client sent, or "" when none.
inline std::string TokenFromContext(const grpc::ServerContextBase& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(kTokenMetadataKey);
  if (it == md.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

}  // namespace ballast
