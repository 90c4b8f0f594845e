// The --inject-* options of netdamd and netdam-mmu: faults on every
// datagram the process sends (the test machines' kernels have no netem).
// Test and benchmark aids, never for a device or proxy in real use.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "transport/fabric.h"

namespace netdam::device {

inline void add_inject_options(CLI::App& app, transport::FaultModel& inject, const std::string& who) {
  const char* kGroup = "Fault injection (test/benchmark aids; never in production)";
  app.add_option("--inject-drop", inject.drop, "drop each datagram the " + who + " sends with probability P")
      ->check(CLI::Range(0.0, 1.0))
      ->group(kGroup);
  app.add_option("--inject-dup", inject.duplicate, "send each datagram twice with probability P")
      ->check(CLI::Range(0.0, 1.0))
      ->group(kGroup);
  app.add_option("--inject-reorder", inject.reorder, "hold each datagram back behind the next one with probability P")
      ->check(CLI::Range(0.0, 1.0))
      ->group(kGroup);
  app.add_option("--inject-seed", inject.seed, "seed of the fault draws (default 1; netdamd's thread i uses N + i)")
      ->group(kGroup);
}

}  // namespace netdam::device
