#include "common/mapping.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/units.h"

namespace netdam {

namespace {
bool fail(std::string* error, std::string msg) {
  if (error) *error = std::move(msg) + ": " + std::strerror(errno);
  return false;
}

std::string shm_name(const std::string& name) { return name.starts_with('/') ? name : "/" + name; }
}  // namespace

std::unique_ptr<Mapping> Mapping::anonymous(uint64_t size, std::string* error) {
  if (size == 0) {
    if (error) *error = "device memory size must be at least 1 byte";
    return nullptr;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    fail(error, "cannot allocate " + format_size(size) + " of device memory");
    return nullptr;
  }
  return std::unique_ptr<Mapping>(new Mapping(p, size, -1, {}));
}

std::unique_ptr<Mapping> Mapping::create_shared(const std::string& name, uint64_t size,
                                                std::string* error) {
  const std::string path = shm_name(name);
  int fd = shm_open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    fail(error, "cannot create shared memory /dev/shm" + path);
    return nullptr;
  }
  // A live device holds the lock; a file left by a crashed one does not.
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    fail(error, "shared memory /dev/shm" + path + " is in use by another device");
    close(fd);
    return nullptr;
  }
  // Truncate to zero first so a stale object's contents never leak into the
  // new device: memory starts zeroed, like an anonymous mapping.
  if (ftruncate(fd, 0) != 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) {
    fail(error, "cannot size shared memory /dev/shm" + path + " to " + format_size(size));
    close(fd);
    shm_unlink(path.c_str());
    return nullptr;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    fail(error, "cannot map " + format_size(size) + " of shared memory /dev/shm" + path);
    close(fd);
    shm_unlink(path.c_str());
    return nullptr;
  }
  return std::unique_ptr<Mapping>(new Mapping(p, size, fd, path));
}

std::unique_ptr<Mapping> Mapping::open_shared(const std::string& name, std::string* error) {
  const std::string path = shm_name(name);
  int fd = shm_open(path.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    fail(error, "cannot open device shared memory /dev/shm" + path);
    return nullptr;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    if (error) *error = "device shared memory /dev/shm" + path + " is empty";
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    fail(error, "cannot map device shared memory /dev/shm" + path);
    close(fd);
    return nullptr;
  }
  return std::unique_ptr<Mapping>(new Mapping(p, static_cast<size_t>(st.st_size), fd, {}));
}

Mapping::~Mapping() {
  munmap(addr_, size_);
  if (!unlink_name_.empty()) shm_unlink(unlink_name_.c_str());
  if (fd_ >= 0) close(fd_);
}

}  // namespace netdam
