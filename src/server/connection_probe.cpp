#include "server/connection_probe.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <charconv>
#include <cstdlib>
#include <filesystem>

namespace gemma4::server {
namespace {

// host and port of a socket address, spelled as httplib spells Request::remote_addr.
bool numeric_name(const sockaddr_storage& address, socklen_t length, std::string& host, int& port) {
  char host_text[NI_MAXHOST];
  char port_text[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&address), length, host_text, sizeof(host_text),
                  port_text, sizeof(port_text), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return false;
  }
  host = host_text;
  port = std::atoi(port_text);
  return true;
}

}  // namespace

ConnectionProbe ConnectionProbe::find(const std::string& remote_addr, int remote_port,
                                      int local_port) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const std::string name = entry.path().filename().string();
    int fd = -1;
    if (std::from_chars(name.data(), name.data() + name.size(), fd).ec != std::errc{}) continue;
    sockaddr_storage address{};
    socklen_t length = sizeof(address);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) continue;
    std::string host;
    int port = 0;
    if (!numeric_name(address, length, host, port) || port != remote_port || host != remote_addr)
      continue;
    length = sizeof(address);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0 ||
        !numeric_name(address, length, host, port) || port != local_port) {
      continue;
    }
    return ConnectionProbe(fd);
  }
  return ConnectionProbe(-1);
}

bool ConnectionProbe::peer_closed() const {
  if (fd_ < 0) return false;
  // POLLRDHUP: the peer closed (or shut down its sending side); unread bytes do not hide it.
  pollfd state{fd_, POLLRDHUP, 0};
  if (poll(&state, 1, 0) <= 0) return false;
  return (state.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

}  // namespace gemma4::server
