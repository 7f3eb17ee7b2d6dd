// Whether the client of an HTTP request is still connected.
//
// cpp-httplib 0.11 gives a handler no access to its socket and notices a vanished client only
// when a write fails, which a non-streamed answer does once, at its very end: without this probe
// a client that gives up would leave its request generating to max_tokens. The probe finds the
// request's socket by the connection's addresses (the handler thread owns that connection until
// it returns, so the descriptor stays valid) and polls it for the peer's close (POLLRDHUP), as
// later httplib versions' Request::is_connection_closed() does. A client that only shuts down its
// sending side counts as gone too.
#pragma once

#include <string>

namespace gemma4::server {

class ConnectionProbe {
 public:
  // The open TCP socket of this process whose peer is remote_addr:remote_port (in httplib's
  // numeric spelling) and whose local port is local_port. A probe that finds none reports the
  // client as connected.
  static ConnectionProbe find(const std::string& remote_addr, int remote_port, int local_port);

  bool found() const { return fd_ >= 0; }
  // True once the peer closed, half-closed or reset the connection. Never blocks.
  bool peer_closed() const;

 private:
  explicit ConnectionProbe(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace gemma4::server
