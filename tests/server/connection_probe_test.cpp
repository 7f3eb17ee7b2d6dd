// ConnectionProbe on real loopback TCP connections: it must pick the server side of the
// connection (not the client socket, whose peer is the listener) and see the client's close.
#include "server/connection_probe.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace gemma4::server {
namespace {

int port_of(int fd, bool peer) {
  sockaddr_in address{};
  socklen_t length = sizeof(address);
  const int rc = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length)
                      : getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  return rc == 0 ? ntohs(address.sin_port) : -1;
}

// A listener, one client socket connected to it and the accepted server-side socket.
struct LoopbackConnection {
  int listener = -1;
  int client = -1;
  int accepted = -1;

  LoopbackConnection() {
    listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    listen(listener, 1);
    socklen_t length = sizeof(address);
    getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
    client = socket(AF_INET, SOCK_STREAM, 0);
    connect(client, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    accepted = accept(listener, nullptr, nullptr);
  }
  ~LoopbackConnection() {
    for (int fd : {listener, client, accepted}) {
      if (fd >= 0) close(fd);
    }
  }
  ConnectionProbe probe() const {
    return ConnectionProbe::find("127.0.0.1", port_of(client, false), port_of(listener, false));
  }
};

TEST(ConnectionProbe, SeesTheClientCloseTheConnection) {
  LoopbackConnection connection;
  ASSERT_GE(connection.accepted, 0);
  const ConnectionProbe probe = connection.probe();
  ASSERT_TRUE(probe.found());
  EXPECT_FALSE(probe.peer_closed());
  // Bytes waiting to be read (a pipelined request) are not a close, nor do they hide one.
  ASSERT_EQ(send(connection.client, "x", 1, 0), 1);
  EXPECT_FALSE(probe.peer_closed());
  close(connection.client);
  connection.client = -1;
  EXPECT_TRUE(probe.peer_closed());
}

TEST(ConnectionProbe, UnknownConnectionIsNotFoundAndCountsAsConnected) {
  LoopbackConnection connection;
  const ConnectionProbe probe =
      ConnectionProbe::find("127.0.0.1", port_of(connection.client, false), 1);
  EXPECT_FALSE(probe.found());
  EXPECT_FALSE(probe.peer_closed());
}

}  // namespace
}  // namespace gemma4::server
