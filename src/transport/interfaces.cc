#include "transport/interfaces.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace netdam::transport {

namespace {

std::optional<size_t> mtu_of(int fd, const char* name) {
  ifreq req{};
  std::strncpy(req.ifr_name, name, IFNAMSIZ - 1);
  if (ioctl(fd, SIOCGIFMTU, &req) != 0 || req.ifr_mtu <= 0) return std::nullopt;
  return static_cast<size_t>(req.ifr_mtu);
}

}  // namespace

Result<size_t> interface_mtu(uint32_t ip) {
  auto fail = [](std::string text) { return Error::transport(std::move(text)); };
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return fail(std::string("getifaddrs: ") + std::strerror(errno));
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeifaddrs(list);
    return fail(std::string("socket: ") + std::strerror(errno));
  }
  std::optional<size_t> best;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || !(a->ifa_flags & IFF_UP)) continue;
    const uint32_t addr = ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr);
    if (ip != 0 && addr != ip) continue;
    const auto mtu = mtu_of(fd, a->ifa_name);
    if (!mtu) continue;
    if (ip != 0) {
      best = mtu;
      break;
    }
    if (!best || *mtu < *best) best = mtu;
  }
  close(fd);
  freeifaddrs(list);
  if (!best) {
    if (ip == 0) return fail("no interface with an IPv4 address is up");
    in_addr a{htonl(ip)};
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &a, text, sizeof text);
    return fail(std::string("no interface that is up has address ") + text);
  }
  return *best;
}

bool is_host_address(uint32_t ip) {
  if ((ip >> 24) == 127) return true;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool found = false;
  for (const ifaddrs* a = list; a != nullptr && !found; a = a->ifa_next)
    found = a->ifa_addr != nullptr && a->ifa_addr->sa_family == AF_INET &&
            ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr) == ip;
  freeifaddrs(list);
  return found;
}

}  // namespace netdam::transport
