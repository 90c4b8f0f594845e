// `netdam dataset load|info`: training data in a memory pool (docs/CLI.md).
#pragma once

#include "tools/cli_pool.h"

namespace netdam::cli {

void add_dataset_commands(CLI::App& app, CommandList& commands);

}  // namespace netdam::cli
