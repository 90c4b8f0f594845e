// `netdam pool ...`: allocations and data of a memory pool, through its
// proxy (netdam-mmu), whose address is the --device option (docs/CLI.md).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <utility>
#include <vector>

#include "tools/cli_commands.h"

namespace netdam::cli {

using CommandList = std::vector<std::pair<CLI::App*, std::function<int(Session&)>>>;
void add_pool_commands(CLI::App& app, CommandList& commands);

}  // namespace netdam::cli
