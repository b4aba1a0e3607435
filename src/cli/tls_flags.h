// The TLS flags of `ballast master`, `ballast launch` and `ballast status`
// (`ballast run` parses its own, torchrun-style: agent/run_options.cc). See
// common/tls.h for what each side does with them.
#pragma once

#include <CLI/CLI.hpp>
#include "common/tls.h"

namespace ballast::cli {

struct TlsFlags {
  TlsFiles files;

  // `server`: the master's wording (its own certificate; a CA = mutual TLS).
  void Add(CLI::App& app, bool server) {
    app.add_option("--tls-cert,--tls_cert", files.cert,
                   server ? "PEM certificate the master serves TLS with (default: $BALLAST_TLS_CERT)"
                          : "PEM client certificate, for a master with mutual TLS (default: $BALLAST_TLS_CERT)");
    app.add_option("--tls-key,--tls_key", files.key, "PEM private key of --tls-cert (default: $BALLAST_TLS_KEY)");
    app.add_option("--tls-ca,--tls_ca", files.ca,
                   server ? "PEM CA bundle: require client certificates signed by it (mutual TLS; default: "
                            "$BALLAST_TLS_CA)"
                          : "PEM CA bundle that signed the master's certificate (default: $BALLAST_TLS_CA)");
  }
  // The flags, with the environment filling what was not given.
  TlsFiles Get() const {
    TlsFiles t = files;
    t.FillFromEnv();
    return t;
  }
};

}  // namespace ballast::cli
